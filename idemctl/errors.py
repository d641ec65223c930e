"""Typed errors. The library raises these with one-line messages; only the
CLI (and the WSGI middleware, which must answer something) turns them into
exit codes or HTTP responses."""

from __future__ import annotations

from .outcomes import Answer


class IdemctlError(Exception):
    """Base class of every error idemctl raises on purpose."""


class PolicyError(IdemctlError, ValueError):
    """A Policy knob holds a value that cannot work (TTL <= 0, retention <= TTL, ...)."""


class InvalidKeyError(IdemctlError, ValueError):
    """An Idempotency-Key that is not 1-255 printable ASCII characters."""


class InvalidBodyError(IdemctlError, TypeError):
    """A request or response body that is not bytes."""


class InvalidResponseError(IdemctlError, ValueError):
    """The mutation returned an answer that cannot be stored (a status outside
    100-999). It ran: the reservation stays pending for a takeover."""


class InvalidPrincipalError(IdemctlError, ValueError):
    """A principal that cannot be stored exactly: empty, not valid UTF-8 (a
    lone surrogate), or holding a NUL character."""


class InvalidRequestError(IdemctlError, ValueError):
    """A method or path that HTTP cannot carry (control characters): two
    different requests could otherwise share a fingerprint."""


class StorageError(IdemctlError):
    """The ledger's storage cannot be used as asked."""


class SchemaMissingError(StorageError):
    """The database has no ledger table yet: `Ledger.init()` creates it.
    ``reason`` is what is wrong, without the advice the message adds.

    >>> error = SchemaMissingError("/var/lib/app/idempotency.db")
    >>> error.where, error.reason
    ('/var/lib/app/idempotency.db', '/var/lib/app/idempotency.db has no idempotency ledger')
    >>> str(error)
    '/var/lib/app/idempotency.db has no idempotency ledger (ledger.init() creates it)'
    """

    advice = "ledger.init() creates it"

    def __init__(self, where: str, message: str | None = None) -> None:
        self.where = where
        self.reason = message or f"{where} has no idempotency ledger"
        super().__init__(f"{self.reason} ({self.advice})")


class LedgerNotFoundError(SchemaMissingError):
    """No ledger exists at the given place (nothing was created there): on
    a server, the database itself may be missing, which `idemctl init`
    creates (when the URL's role may) and `Ledger.init()` does not."""

    advice = "`idemctl init` creates it, a server's database included; ledger.init() creates only the tables"

    def __init__(self, where: str, reason: str | None = None) -> None:
        super().__init__(where, f"no ledger at {where}" if reason is None else reason)


class NotADatabaseError(StorageError):
    """The path exists but is not a database (a directory, a text file, a corrupt file)."""


class SchemaTooNewError(StorageError):
    """The database was written by a newer idemctl; this one refuses to touch it."""

    def __init__(self, where: str, version: int, known: int) -> None:
        self.where, self.version, self.known = where, version, known
        super().__init__(f"{where} has ledger schema version {version}; this idemctl knows up to {known}")


class SchemaOutdatedError(StorageError):
    """The ledger's schema predates what the request path needs (a ledger
    written by the recipe's Worker or by an older idemctl): it can be read,
    and `Ledger.init()` upgrades it in place."""

    def __init__(self, where: str) -> None:
        self.where = where
        super().__init__(
            f"{where} has an older ledger schema; requests need the current one (init upgrades it in place)"
        )


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


class AnswerNotStoredError(StorageError):
    """The mutation ran but its answer could not be stored. `answer` is what
    the app computed, shaped exactly as a stored answer would be: send it
    rather than invite a retry that would run the mutation again."""

    def __init__(self, answer: Answer, cause: StorageError) -> None:
        self.answer = answer
        self.cause = cause
        super().__init__(f"the mutation ran but its answer could not be stored: {cause}")


class ReadOnlyDatabaseError(StorageError):
    """A write was needed but the database is read-only."""


class LedgerUnavailableError(StorageError):
    """The ledger exists but cannot answer right now; retrying later may work."""


class DatabaseLockedError(LedgerUnavailableError):
    """Another writer held the database lock for longer than the busy timeout."""


class ConnectionFailedError(LedgerUnavailableError):
    """The database server could not be reached or refused the connection."""


class CommitTimeoutError(LedgerUnavailableError):
    """A statement, its commit included, did not finish within the ledger's
    commit timeout and was cancelled (PostgreSQL: most often a synchronous
    standby that does not acknowledge the commit). What it wrote may be
    committed on the server without a standby's acknowledgement, so it is
    treated as not done: a claim is no reservation of the caller's, a
    completion is not stored.

    >>> CommitTimeoutError("postgresql://app@db/payments", 2.5).timeout_s
    2.5
    """

    def __init__(self, where: str, timeout_s: float) -> None:
        self.where, self.timeout_s = where, timeout_s
        super().__init__(
            f"a statement on {where} did not commit within the commit timeout ({timeout_s:g} s) and was "
            "cancelled: no synchronous standby acknowledged it, or the server did not answer; what it wrote may "
            "be committed on the primary without a standby's copy, and is treated as not stored"
        )


class ScenarioError(IdemctlError, ValueError):
    """A scenario for `simulate` that cannot run: an unknown name, a malformed
    file, a bad step."""


class ConfigError(IdemctlError, ValueError):
    """A setting (an environment variable) that cannot be used as given."""

    def __init__(self, name: str, value: str, message: str) -> None:
        self.name = name
        self.value = value
        super().__init__(message)


class CallError(IdemctlError):
    """An idempotent function's call under (principal, key) did not give a
    value: the base of the errors below, each carrying both.

    >>> isinstance(KeyReusedError("billing", "pay_1"), CallError)
    True
    """

    def __init__(self, principal: str, key: str, message: str) -> None:
        self.principal = principal
        self.key = key
        super().__init__(f"key {key!r} of principal {principal!r} {message}")


class KeyReusedError(CallError):
    """An idempotent function was called again with a key it already ran
    under, but with other arguments: the 409 "reused" of functions. Nothing
    ran and nothing is replayed.

    >>> KeyReusedError("billing", "pay_1").key
    'pay_1'
    """

    def __init__(self, principal: str, key: str) -> None:
        super().__init__(
            principal,
            key,
            "was used for a call with other arguments; "
            "a repeat must pass the same arguments, a new call needs a new key",
        )


class CallInProgressError(CallError):
    """Another call with this key and these arguments holds the reservation
    and is younger than the pending TTL: try again in `retry_after` seconds,
    when a reservation whose owner died can be taken over.

    >>> CallInProgressError("billing", "pay_1", 1, 2500).retry_after
    2.5
    """

    def __init__(self, principal: str, key: str, generation: int, retry_after_ms: int) -> None:
        self.generation = generation
        self.retry_after_ms = retry_after_ms
        super().__init__(principal, key, f"is in progress (generation {generation}); retry in {retry_after_ms} ms")

    @property
    def retry_after(self) -> float:
        """`retry_after_ms` in seconds, for time.sleep or asyncio.sleep."""
        return self.retry_after_ms / 1000


class UnserializableArgumentsError(IdemctlError, TypeError):
    """The arguments that identify a call are not JSON (a dataclass, a
    Decimal, a dict with non-str keys, NaN), so they have no stable
    fingerprint. Nothing was claimed and nothing ran.

    >>> UnserializableArgumentsError("arguments['amount']", "a Decimal").path
    "arguments['amount']"
    """

    def __init__(self, path: str, problem: str) -> None:
        self.path, self.problem = path, problem
        super().__init__(
            f"cannot fingerprint the call: {path} is {problem}, not JSON; choose the arguments that "
            "identify the call with args=[names], or map them to JSON with args=lambda ...: {...}"
        )


class UnsupportedFunctionError(IdemctlError, TypeError):
    """A function that cannot be made idempotent: calling it does not do the
    work but returns a generator (or an async generator), whose body would
    run after the call was stored, or never. Refused when decorated, or at
    the first call before anything is claimed."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"{name} cannot be made idempotent: {problem}")
        self.name = name
        self.problem = problem


class ResultNotStoredError(CallError):
    """An idempotent function ran, but its return value could not be stored.
    The call is complete (it never runs again under this key): its first
    caller and every repeat get this error instead of a value."""

    def __init__(self, principal: str, key: str, reason: str) -> None:
        self.reason = reason
        super().__init__(principal, key, f"ran once, but its result was not stored: {reason}")


class ResultTooLargeError(ResultNotStoredError):
    """The serialized return value exceeded the policy's body cap: it is not
    stored (never a truncated value). `size` is None on a repeat.

    >>> ResultTooLargeError("billing", "pay_1", 20_000, 16_384).reason
    'it is 20000 bytes serialized, over the cap of 16384 bytes'
    """

    def __init__(self, principal: str, key: str, size: int | None, cap: int) -> None:
        self.size = size
        self.cap = cap
        what = "it was" if size is None else f"it is {size} bytes"
        super().__init__(principal, key, f"{what} serialized, over the cap of {cap} bytes")


class ResultNotSerializableError(ResultNotStoredError, TypeError):
    """The serializer could not turn the return value into bytes.

    >>> ResultNotSerializableError("billing", "pay_1", "Receipt").type_name
    'Receipt'
    """

    def __init__(self, principal: str, key: str, type_name: str, detail: str | None = None) -> None:
        self.type_name = type_name
        reason = f"the serializer cannot write a {type_name}" + (f" ({detail})" if detail else "")
        super().__init__(principal, key, reason)


def missing_extra(needs: str, extra: str, exc: ImportError) -> ModuleNotFoundError:
    """The error of a module whose optional dependency is not installed:
    `needs` says what it needs, `extra` is the extra that brings it.

    >>> str(missing_extra("idemctl.otel needs the OpenTelemetry API", "otel", ImportError(name="opentelemetry")))
    "idemctl.otel needs the OpenTelemetry API: pip install 'idemctl[otel]' (opentelemetry is missing)"
    """
    return ModuleNotFoundError(f"{needs}: pip install 'idemctl[{extra}]' ({exc.name} is missing)", name=exc.name)
