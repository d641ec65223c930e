"""Storage: one SQL core (store.py) over an engine per database, and the
registry of engines (registry.py).

`open_engine` and `open_store` ask the registry which engine a location
names: a file path (or ":memory:") is SQLite, a ``postgresql://`` URL or a
libpq connection string is PostgreSQL, a ``mysql://`` or ``mariadb://`` URL
is MariaDB/MySQL, a ``d1://ACCOUNT_ID/DATABASE_ID`` URL is Cloudflare D1
through its HTTP API; an engine added with `register` is found the same way.
Nothing outside this package names an engine, imports a driver or reads a
URL's scheme (docs/engines.md)."""

from __future__ import annotations

import os

from ..errors import StorageError
from .capabilities import DatabaseCreated, DatabaseNotCreatedError
from .engine import Engine
from .locations import keyword_dsn
from .registry import (
    Capabilities,
    EngineKind,
    Locations,
    accepted_urls,
    async_opener,
    create_database,
    database_missing,
    engine_kind,
    failover_facts,
    is_file_location,
    kind_of,
    kinds,
    open_engine,
    open_store,
    reads_where_it_writes,
    register,
)
from .sqlite import DEFAULT_FILE_MODE, SQLITE_DEFAULTS, SqliteOptions
from .store import Store


def _is(name: str, target: str | os.PathLike[str]) -> bool:
    if not isinstance(target, (str, os.PathLike)):
        return False
    try:
        return kind_of(target).name == name
    except StorageError:  # a URL of no registered kind is none of them
        return False


def is_postgres_url(target: str | os.PathLike[str]) -> bool:
    """A postgresql:// URL or a libpq keyword/value connection string.

    >>> is_postgres_url("host=db dbname=payments"), is_postgres_url("ledger.db")
    (True, False)
    """
    return _is("postgres", target)


def is_mysql_url(target: str | os.PathLike[str]) -> bool:
    """A mysql:// or mariadb:// URL."""
    return _is("mysql", target)


def is_server_url(target: str | os.PathLike[str]) -> bool:
    """A database server's location (nothing connects before the first
    statement), not a file: a registered kind whose ``server`` is True.

    >>> is_server_url("mysql://app@db/payments"), is_server_url("ledger.db"), is_server_url("x://y")
    (True, False, False)
    """
    if not isinstance(target, (str, os.PathLike)):
        return False
    try:
        return kind_of(target).capabilities.server
    except StorageError:
        return False


__all__ = [
    "DEFAULT_FILE_MODE",
    "SQLITE_DEFAULTS",
    "Capabilities",
    "DatabaseCreated",
    "DatabaseNotCreatedError",
    "Engine",
    "EngineKind",
    "Locations",
    "SqliteOptions",
    "Store",
    "accepted_urls",
    "async_opener",
    "create_database",
    "database_missing",
    "engine_kind",
    "failover_facts",
    "is_file_location",
    "is_mysql_url",
    "is_postgres_url",
    "is_server_url",
    "keyword_dsn",
    "kind_of",
    "kinds",
    "open_engine",
    "open_store",
    "reads_where_it_writes",
    "register",
]
