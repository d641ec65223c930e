"""Typed errors. The library raises these with one-line messages; only the
CLI (and the WSGI middleware, which must answer something) turns them into
exit codes or HTTP responses."""

from __future__ import annotations


class IdemctlError(Exception):
    """Base class of every error idemctl raises on purpose."""


class PolicyError(IdemctlError, ValueError):
    """A Policy knob holds a value that cannot work (TTL <= 0, retention <= TTL, ...)."""


class InvalidKeyError(IdemctlError, ValueError):
    """An Idempotency-Key that is not 1-255 printable ASCII characters."""


class InvalidBodyError(IdemctlError, TypeError):
    """A request or response body that is not bytes."""


class InvalidPrincipalError(IdemctlError, ValueError):
    """A principal that cannot be stored exactly: empty, not valid UTF-8 (a
    lone surrogate), or holding a NUL character."""


class InvalidRequestError(IdemctlError, ValueError):
    """A method or path that HTTP cannot carry (control characters): two
    different requests could otherwise share a fingerprint."""


class StorageError(IdemctlError):
    """The ledger's storage cannot be used as asked."""


class SchemaMissingError(StorageError):
    """The database has no ledger table yet: `Ledger.init()` creates it."""


class LedgerNotFoundError(SchemaMissingError):
    """No ledger file exists at the given path (nothing was created)."""


class NotADatabaseError(StorageError):
    """The path exists but is not a database (a directory, a text file, a corrupt file)."""


class SchemaTooNewError(StorageError):
    """The database was written by a newer idemctl; this one refuses to touch it."""


class SchemaOutdatedError(StorageError):
    """The ledger's schema predates what the request path needs (a ledger
    written by the recipe's Worker or by an older idemctl): it can be read,
    and `Ledger.init()` upgrades it in place."""


class MalformedRowError(StorageError):
    """A ledger row that idemctl did not write and cannot interpret (a status
    other than pending/completed, a non-integer generation or timestamp, ...).

    >>> MalformedRowError("acct", "k", "status 'done' is neither pending nor completed").principal
    'acct'
    """

    def __init__(self, principal: object, key: object, problem: str) -> None:
        self.principal = principal
        self.key = key
        self.problem = problem
        super().__init__(f"malformed ledger row principal={principal!r} key={key!r}: {problem}")


class ReadOnlyDatabaseError(StorageError):
    """A write was needed but the database is read-only."""


class LedgerUnavailableError(StorageError):
    """The ledger exists but cannot answer right now; retrying later may work."""


class DatabaseLockedError(LedgerUnavailableError):
    """Another writer held the database lock for longer than the busy timeout."""


class ConnectionFailedError(LedgerUnavailableError):
    """The database server could not be reached or refused the connection."""
