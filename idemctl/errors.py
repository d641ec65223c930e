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


class StorageError(IdemctlError):
    """The ledger's storage cannot be used as asked."""


class LedgerNotFoundError(StorageError):
    """No ledger exists at the given path and the caller asked not to create one."""


class NotADatabaseError(StorageError):
    """The path exists but is not a database (a directory, a text file, a corrupt file)."""


class SchemaMissingError(StorageError):
    """The database has no ledger table yet: run `idemctl init`."""


class SchemaTooNewError(StorageError):
    """The database was written by a newer idemctl; this one refuses to touch it."""


class ReadOnlyDatabaseError(StorageError):
    """A write was needed but the database is read-only."""


class LedgerUnavailableError(StorageError):
    """The ledger exists but cannot answer right now; retrying later may work."""


class DatabaseLockedError(LedgerUnavailableError):
    """Another writer held the database lock for longer than the busy timeout."""


class ConnectionFailedError(LedgerUnavailableError):
    """The database server could not be reached or refused the connection."""
