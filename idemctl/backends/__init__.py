"""Storage backends. `open_backend` picks one from the target's form."""

from __future__ import annotations

import os

from ..errors import StorageError
from .base import Backend

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def is_postgres_url(target: str | os.PathLike[str]) -> bool:
    return isinstance(target, str) and target.startswith(POSTGRES_SCHEMES)


def open_backend(
    target: str | os.PathLike[str],
    *,
    create: bool = True,
    readonly: bool = False,
    busy_timeout_ms: int = 5000,
    synchronous: str = "FULL",
    write_queue: bool = True,
) -> Backend:
    """A SQLite file path (or ":memory:" in tests), or a postgresql:// URL.
    `synchronous` and `write_queue` are SQLite settings; PostgreSQL ignores them."""
    if is_postgres_url(target):
        try:
            from .postgres import PostgresBackend
        except ImportError as exc:  # the driver lives behind the `postgres` extra
            raise StorageError(
                f"PostgreSQL support needs the driver: pip install 'idemctl[postgres]' ({exc.name} is missing)"
            ) from exc
        return PostgresBackend(str(target), readonly=readonly, busy_timeout_ms=busy_timeout_ms)
    if isinstance(target, str) and "://" in target:
        raise StorageError(f"unsupported ledger URL {target.split('://', 1)[0]}://…: use a file path or postgresql://")
    from .sqlite import SqliteBackend

    return SqliteBackend(
        target,
        create=create,
        readonly=readonly,
        busy_timeout_ms=busy_timeout_ms,
        synchronous=synchronous,
        write_queue=write_queue,
    )


__all__ = ["Backend", "open_backend", "is_postgres_url"]
