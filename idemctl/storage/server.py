"""What the engines of a database server (PostgreSQL, MariaDB/MySQL) share:
the busy timeout's check, the numbers a URL's options carry, the URL's
password kept out of every message,
what a missing table means, and the words of the errors both translate
their drivers' errors into, so an operator reads the same line on either."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from ..errors import (
    ConnectionFailedError,
    LedgerNotFoundError,
    ReadOnlyDatabaseError,
    SchemaMissingError,
    SchemaOutdatedError,
    StorageError,
)

N = TypeVar("N", int, float)
D = TypeVar("D")


def checked_busy_timeout(busy_timeout_ms: int) -> int:
    """The busy timeout in whole ms; a negative one is refused.

    >>> checked_busy_timeout(250)
    250
    """
    value = int(busy_timeout_ms)
    if value < 0:
        raise StorageError(f"busy timeout must be >= 0 ms, got {busy_timeout_ms}")
    return value


def number_option(
    options: Mapping[str, str], name: str, default: D, kind: Callable[[str], N], floor: N, bad_url: str
) -> N | D:
    """The URL option `name` as a number of `kind` no smaller than `floor`,
    `default` when the URL does not give it; a malformed one is a
    StorageError that begins with `bad_url` (how the engine names its URL
    in messages, never with its password).

    >>> number_option({"pool_max_size": "4"}, "pool_max_size", 10, int, 1, "bad MySQL URL")
    4
    >>> number_option({}, "pool_timeout", None, float, 0.001, "bad MySQL URL") is None
    True
    """
    raw = options.get(name)
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise StorageError(f"{bad_url}: {name}={raw!r} is not a number") from None
    if value < floor:
        raise StorageError(f"{bad_url}: {name} must be >= {floor}, got {raw}")
    return value


def scrub(text: str, secrets: Iterable[str]) -> str:
    """`text` with every spelling of the password replaced by ``***``.

    >>> scrub("password authentication failed for s3cret", ["s3cret"])
    'password authentication failed for ***'
    """
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def missing_table(where: str, message: str) -> StorageError | None:
    """The server's "no such table" for one of the ledger's tables: the
    ledger table means no schema, one of idemctl's own an outdated one;
    None for any other table."""
    if "idempotency_keys" in message:
        return SchemaMissingError(where)
    if "idemctl_" in message:
        return SchemaOutdatedError(where)
    return None


def read_only(where: str, message: str) -> ReadOnlyDatabaseError:
    return ReadOnlyDatabaseError(f"{where} is read-only ({message})")


def no_such_database(where: str, reason: str) -> LedgerNotFoundError:
    return LedgerNotFoundError(where, f"cannot open the ledger at {where}: {reason}")


def unreachable(server: str, where: str, reason: str) -> ConnectionFailedError:
    """A connection that could not be made or was lost (a 503 from the adapters).

    >>> str(unreachable("MySQL", "mysql://app@db/ledger", "Connection refused"))
    'cannot reach MySQL at mysql://app@db/ledger: Connection refused'
    """
    return ConnectionFailedError(f"cannot reach {server} at {where}: {reason}")


def login_refused(server: str, where: str, reason: str) -> ConnectionFailedError:
    """A server that answered and refused the login (a wrong password, an
    unknown role, no rule letting it in): reached, so not "cannot reach".

    >>> str(login_refused("MySQL", "mysql://app@db/ledger", "Access denied for user 'app'"))
    "MySQL at mysql://app@db/ledger refused the login: Access denied for user 'app'"
    """
    return ConnectionFailedError(f"{server} at {where} refused the login: {reason}")


def permission_denied(where: str, message: str) -> StorageError:
    return StorageError(f"permission denied on {where}: {message}")


def database_error(where: str, message: str) -> StorageError:
    return StorageError(f"database error on {where}: {message}")
