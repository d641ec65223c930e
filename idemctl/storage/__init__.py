"""Storage: one SQL core (store.py) over an engine per database, and Redis
with a store of its own (redis/).

`open_engine` picks the engine from the target's form: a file path (or
":memory:") is SQLite, a ``postgresql://`` URL is PostgreSQL, a
``mysql://`` or ``mariadb://`` URL is MariaDB/MySQL, a ``redis://``,
``rediss://`` or ``redis+sentinel://`` URL is Redis (or Valkey).
`store_for` gives the Store that speaks an engine's language."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import cast

from ..errors import StorageError
from .engine import Engine
from .locations import dsn_url, keyword_dsn
from .sqlite import DEFAULT_FILE_MODE, SQLITE_DEFAULTS, SqliteEngine, SqliteOptions
from .store import Store

POSTGRES_SCHEMES = ("postgresql://", "postgres://")
MYSQL_SCHEMES = ("mysql://", "mariadb://")
REDIS_SCHEMES = ("redis://", "rediss://", "redis+sentinel://", "rediss+sentinel://")


def is_postgres_url(target: str | os.PathLike[str]) -> bool:
    """A postgresql:// URL or a libpq keyword/value connection string."""
    return isinstance(target, str) and (target.startswith(POSTGRES_SCHEMES) or keyword_dsn(target) is not None)


def is_mysql_url(target: str | os.PathLike[str]) -> bool:
    return isinstance(target, str) and target.startswith(MYSQL_SCHEMES)


def is_redis_url(target: str | os.PathLike[str]) -> bool:
    return isinstance(target, str) and target.startswith(REDIS_SCHEMES)


def is_server_url(target: str | os.PathLike[str]) -> bool:
    """A database server's URL (nothing connects before the first statement), not a file."""
    return is_postgres_url(target) or is_mysql_url(target) or is_redis_url(target)


def store_for(engine: Engine) -> Store:
    """The Store for an engine: the SQL core, or the engine's own (Redis
    brings one that runs its steps as scripts).

    >>> type(store_for(open_engine(":memory:"))).__name__
    'Store'
    """
    own = getattr(engine, "store", None)
    return cast(Store, own()) if own is not None else Store(engine)


def _server_engine(module: str, name: str, server: str, extra: str) -> Callable[..., Engine]:
    """A server engine's class, imported only when a URL names that server:
    its driver lives behind an extra of the package."""
    try:
        return cast("Callable[..., Engine]", getattr(importlib.import_module(f".{module}", __name__), name))
    except ImportError as exc:
        raise StorageError(
            f"{server} support needs the driver: pip install 'idemctl[{extra}]' ({exc.name} is missing)"
        ) from exc


def open_engine(
    target: str | os.PathLike[str],
    *,
    readonly: bool = False,
    busy_timeout_ms: int = 5000,
    sqlite: SqliteOptions = SQLITE_DEFAULTS,
) -> Engine:
    """The engine for a SQLite file path, a postgresql://, mysql:// or redis:// URL;
    `sqlite` holds what only a SQLite file has (a server URL ignores it).

    >>> open_engine(":memory:").dialect.name
    'sqlite'
    """
    if not isinstance(target, (str, os.PathLike)):
        raise StorageError(
            "a ledger is a file path, a postgresql:// URL or connection string, or a mysql:// URL,"
            f" got {type(target).__name__}"
        )
    if is_postgres_url(target):
        engine = _server_engine("postgres", "PostgresEngine", "PostgreSQL", "postgres")
        pairs = keyword_dsn(target)
        url = dsn_url(pairs) if pairs is not None else str(target)
        return engine(url, readonly=readonly, busy_timeout_ms=busy_timeout_ms)
    if is_mysql_url(target):
        engine = _server_engine("mysql", "MysqlEngine", "MariaDB/MySQL", "mysql")
        return engine(str(target), readonly=readonly, busy_timeout_ms=busy_timeout_ms)
    if is_redis_url(target):
        engine = _server_engine("redis", "RedisEngine", "Redis", "redis")
        return engine(str(target), readonly=readonly, busy_timeout_ms=busy_timeout_ms)
    if isinstance(target, str) and "://" in target:
        raise StorageError(
            f"unsupported ledger URL {target.split('://', 1)[0]}://…: use a file path, postgresql://, mysql:// "
            "or redis://"
        )
    return SqliteEngine(target, readonly=readonly, busy_timeout_ms=busy_timeout_ms, options=sqlite)


__all__ = [
    "DEFAULT_FILE_MODE",
    "Engine",
    "SqliteOptions",
    "Store",
    "is_mysql_url",
    "is_postgres_url",
    "is_redis_url",
    "is_server_url",
    "keyword_dsn",
    "open_engine",
    "store_for",
]
