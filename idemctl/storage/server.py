"""What the engines of a database server (PostgreSQL, MariaDB/MySQL) share:
the busy timeout's check, the URL's password kept out of every message, and
what a missing table means."""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import SchemaMissingError, SchemaOutdatedError, StorageError


def checked_busy_timeout(busy_timeout_ms: int) -> int:
    """The busy timeout in whole ms; a negative one is refused.

    >>> checked_busy_timeout(250)
    250
    """
    value = int(busy_timeout_ms)
    if value < 0:
        raise StorageError(f"busy timeout must be >= 0 ms, got {busy_timeout_ms}")
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
