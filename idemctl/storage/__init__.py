"""Storage: one SQL core (store.py) over an engine per database.

`open_engine` picks the engine from the target's form: a file path (or
":memory:") is SQLite, a ``postgresql://`` URL is PostgreSQL, a
``mysql://`` or ``mariadb://`` URL is MariaDB/MySQL."""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable
from typing import cast
from urllib.parse import quote

from ..errors import StorageError
from .engine import Engine
from .sqlite import DEFAULT_FILE_MODE, SQLITE_DEFAULTS, SqliteEngine, SqliteOptions
from .store import Store

POSTGRES_SCHEMES = ("postgresql://", "postgres://")
MYSQL_SCHEMES = ("mysql://", "mariadb://")


# libpq's connection keywords (its manual, "Parameter Key Words") and
# idemctl's pool parameters: a string made only of `keyword=value` pairs
# with these keywords is a PostgreSQL connection string, never a file name.
LIBPQ_KEYWORDS = frozenset(
    {
        "host", "hostaddr", "port", "dbname", "user", "password", "passfile", "require_auth",
        "channel_binding", "connect_timeout", "client_encoding", "options", "application_name",
        "fallback_application_name", "keepalives", "keepalives_idle", "keepalives_interval",
        "keepalives_count", "tcp_user_timeout", "replication", "gssencmode", "sslmode", "requiressl",
        "sslcompression", "sslcert", "sslkey", "sslpassword", "sslcertmode", "sslrootcert", "sslcrl",
        "sslcrldir", "sslsni", "requirepeer", "ssl_min_protocol_version", "ssl_max_protocol_version",
        "krbsrvname", "gsslib", "gssdelegation", "service", "target_session_attrs", "load_balance_hosts",
        "pool_min_size", "pool_max_size", "pool_timeout",
    }
)  # fmt: skip
# One pair: a keyword, `=` (spaces around it allowed), and a value that is
# single-quoted (\' and \\ escaped) or runs to the next space.
_DSN_PAIR = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*('(?:[^'\\]|\\.)*'|(?:[^\s'\\]|\\.)+)")
_DSN_ESCAPE = re.compile(r"\\(.)")


def keyword_dsn(target: object) -> list[tuple[str, str]] | None:
    r"""The pairs of a libpq keyword/value connection string, or None when
    `target` is not one (a file path, a URL). Every keyword must be one of
    libpq's: ``data=1.db`` stays a file name.

    >>> keyword_dsn("host=db user=app password='a b\\'c' dbname=payments")
    [('host', 'db'), ('user', 'app'), ('password', "a b'c"), ('dbname', 'payments')]
    >>> keyword_dsn("ledger=1.db"), keyword_dsn("idempotency.db"), keyword_dsn("postgresql://db/x")
    (None, None, None)
    """
    if not isinstance(target, str) or "://" in target or "=" not in target:
        return None
    pairs: list[tuple[str, str]] = []
    pos, end = 0, len(target.rstrip())
    while pos < end:
        match = _DSN_PAIR.match(target, pos)
        if match is None or match.group(1) not in LIBPQ_KEYWORDS:
            return None
        pos = match.end()
        if pos < end and not target[pos].isspace():
            return None
        raw = match.group(2)
        value = raw[1:-1] if raw.startswith("'") else raw
        pairs.append((match.group(1), _DSN_ESCAPE.sub(r"\1", value)))
    return pairs or None


def dsn_url(pairs: list[tuple[str, str]]) -> str:
    """A keyword/value connection string as the postgresql:// URL libpq reads
    the same way (every pair a query parameter).

    >>> dsn_url([("host", "db"), ("dbname", "pay ments")])
    'postgresql://?host=db&dbname=pay%20ments'
    """
    return "postgresql://?" + "&".join(f"{name}={quote(value, safe='')}" for name, value in pairs)


def is_postgres_url(target: str | os.PathLike[str]) -> bool:
    """A postgresql:// URL or a libpq keyword/value connection string."""
    return isinstance(target, str) and (target.startswith(POSTGRES_SCHEMES) or keyword_dsn(target) is not None)


def is_mysql_url(target: str | os.PathLike[str]) -> bool:
    return isinstance(target, str) and target.startswith(MYSQL_SCHEMES)


def is_server_url(target: str | os.PathLike[str]) -> bool:
    """A database server's URL (nothing connects before the first statement), not a file."""
    return is_postgres_url(target) or is_mysql_url(target)


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
    """The engine for a SQLite file path, a postgresql:// or a mysql:// URL;
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
    if isinstance(target, str) and "://" in target:
        raise StorageError(
            f"unsupported ledger URL {target.split('://', 1)[0]}://…: use a file path, postgresql:// or mysql://"
        )
    return SqliteEngine(target, readonly=readonly, busy_timeout_ms=busy_timeout_ms, options=sqlite)


__all__ = [
    "DEFAULT_FILE_MODE",
    "Engine",
    "SqliteOptions",
    "Store",
    "is_mysql_url",
    "is_postgres_url",
    "is_server_url",
    "keyword_dsn",
    "open_engine",
]
