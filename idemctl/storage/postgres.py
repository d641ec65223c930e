"""PostgreSQL engine: a per-process connection pool and PostgreSQL's errors.

Each request-path step is a single statement on an auto-commit connection, so
its atomicity is PostgreSQL's row-level atomicity of one statement under READ
COMMITTED: a concurrent writer of the same row is waited for, and the WHERE
clause is re-checked against the row version that writer committed.

Connections come from a psycopg_pool.ConnectionPool that is opened on first
use and belongs to one process: after a fork the child builds its own pool
and never touches the parent's sockets. An event loop gets its own
AsyncConnectionPool (AsyncPostgresEngine) for the asynchronous request path:
the same statements and the same errors, awaited instead of run in a thread."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar
from urllib.parse import quote, unquote, urlsplit

import psycopg
import psycopg.sql
from psycopg import errors as pgerrors
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolClosed, PoolTimeout

from ..errors import (
    ConnectionFailedError,
    DatabaseLockedError,
    LedgerNotFoundError,
    LedgerUnavailableError,
    ReadOnlyDatabaseError,
    SchemaMissingError,
    SchemaOutdatedError,
    StorageError,
)
from ..text import single_line
from .dialect import POSTGRES
from .engine import Params, Rows

log = logging.getLogger("idemctl")
T = TypeVar("T")

# URL query parameters that configure the pool. They are idemctl's, not
# libpq's, so they are taken out of the URL before it reaches libpq.
POOL_PARAMS = ("pool_min_size", "pool_max_size", "pool_timeout")
DEFAULT_POOL_MIN_SIZE = 1
DEFAULT_POOL_MAX_SIZE = 10
DEFAULT_CONNECT_TIMEOUT_S = 5
# Once connecting failed, statements in the next moment fail at once with that
# error instead of each trying again: during a failover every request gets
# its 503 without delay, and the first one after this pause that finds a host
# accepting writes reconnects.
RECONNECT_PAUSE_S = 0.2

SQL_STORAGE_BYTES = """
SELECT coalesce(sum(pg_total_relation_size(t)), 0)
FROM (SELECT to_regclass(name) AS t FROM unnest(%(names)s::text[]) AS name) AS tables
WHERE t IS NOT NULL
"""

# What decides whether a completion this server acknowledged is on a standby
# too, as this connection's session sees it (a role or database can override
# synchronous_commit), and which standbys stream from it now.
SQL_REPLICATION = """
SELECT current_setting('synchronous_commit'), current_setting('synchronous_standby_names'),
       pg_is_in_recovery(),
       coalesce((SELECT array_agg(application_name || '=' || coalesce(sync_state, 'unknown')
                                  ORDER BY application_name)
                 FROM pg_stat_replication), '{}')
"""

# SQLSTATEs that mean "waited on another session past a timeout".
_LOCKED_STATES = {"55P03", "57014", "40P01", "40001"}
# Server going away, refusing, or out of connection slots.
_GONE_STATES = {"57P01", "57P02", "57P03", "53300", "53400"}
# Errors that mean two inits raced to create the same catalog objects.
_INIT_RACE = (pgerrors.UniqueViolation, pgerrors.DuplicateTable, pgerrors.DuplicateObject)


_SERVER_PREFIX = re.compile(r'^connection to server (?:at|on socket) "[^"]*"(?: \([^)]*\))?(?:, port \d+)? failed: ')


def _libpq_reason(text: str) -> str:
    """The reason inside libpq's connection error, without the parts the
    caller already shows (which server) or that add nothing (hint lines).
    With several hosts in the URL, one `host:port: reason` per host."""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("\t")]
    if "All failures were:" in text:
        per_host = []
        for line in lines:
            m = re.match(r"- host: '([^']*)', port: '([^']*)'(?:, hostaddr: '[^']*')?: (.*)", line)
            if m:
                per_host.append(f"{m.group(1)}:{m.group(2)}: {_libpq_reason(m.group(3))}")
        if per_host:
            return "; ".join(per_host)
    reasons: list[str] = []
    for line in lines:
        line = line.strip().removeprefix("connection failed: ")
        line = _SERVER_PREFIX.sub("", line)
        line = re.sub(r"^FATAL:\s+", "", line)
        if line not in reasons:
            reasons.append(line)
    return single_line("; ".join(reasons)) or "connection failed"


def _split_pool_params(url: str) -> tuple[str, dict[str, str]]:
    """Take idemctl's pool_* parameters out of the query string, leaving the
    rest of the URL byte for byte as given."""
    base, sep, query = url.partition("?")
    if not sep:
        return url, {}
    kept: list[str] = []
    pool: dict[str, str] = {}
    for part in query.split("&"):
        name, _, value = part.partition("=")
        if name in POOL_PARAMS:
            pool[name] = unquote(value)
        elif part:
            kept.append(part)
    return (base + "?" + "&".join(kept)) if kept else base, pool


def _secrets_of(url: str) -> list[str]:
    """Every spelling of the password the URL carries, for scrubbing messages."""
    found: list[str] = []
    with contextlib.suppress(ValueError):
        if urlsplit(url).password:
            found.append(urlsplit(url).password or "")
    for match in re.finditer(r"[?&]password=([^&]*)", url):
        found.append(match.group(1))
    out: list[str] = []
    for s in found:
        out.extend(v for v in (s, unquote(s)) if v and v not in out)
    return out


# Every engine of this process, so that fork() never copies `_lock` while
# another thread holds it (it is held while a pool connects): the child would
# wait for it forever.
_ENGINES: weakref.WeakSet[PostgresEngine] = weakref.WeakSet()
_FORKING: list[PostgresEngine] = []


def _before_fork() -> None:
    engines = list(_ENGINES)
    for engine in engines:
        engine._lock.acquire()
    _FORKING[:] = engines


def _after_fork_in_parent() -> None:
    engines, _FORKING[:] = list(_FORKING), []
    for engine in engines:
        engine._lock.release()


def _after_fork_in_child() -> None:
    engines, _FORKING[:] = list(_FORKING), []
    for engine in engines:
        engine._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
    )


class DatabaseNotCreatedError(StorageError):
    """The database a URL names does not exist, and this role could not create
    it (`PostgresEngine.create_database`): `reason` is the server's word."""

    def __init__(self, where: str, database: str, role: str | None, reason: str) -> None:
        self.where, self.database, self.role, self.reason = where, database, role, reason
        super().__init__(f"cannot create the database {database!r} for {where}: {reason}")


class _PooledConnection(psycopg.Connection[tuple[Any, ...]]):
    """A pooled connection that keeps one cursor for the one-statement steps
    it runs (a connection serves one caller at a time): a new cursor per
    statement is a measurable part of a request's own CPU."""

    statement_cursor: psycopg.Cursor[tuple[Any, ...]] | None = None


class PostgresEngine:
    """A ledger in a PostgreSQL database, shared by any number of threads,
    processes and hosts.

    Pool settings ride on the URL as idemctl's own query parameters:
    ``pool_min_size`` (default 1), ``pool_max_size`` (default 10) and
    ``pool_timeout`` (seconds to wait for a free connection; default the busy
    timeout). libpq's own parameters (``connect_timeout``, default 5 s;
    ``options=-csearch_path=…``; ``sslmode``; ...) pass through unchanged.

    Nothing connects until the first statement.

    >>> PostgresEngine("postgresql://app:secret@db:5432/payments?pool_max_size=20").describe()
    'postgresql://app@db:5432/payments'
    """

    dialect = POSTGRES

    def __init__(
        self,
        url: str,
        *,
        readonly: bool = False,
        busy_timeout_ms: int = 5000,
        pool_min_size: int | None = None,
        pool_max_size: int | None = None,
        pool_timeout_s: float | None = None,
    ) -> None:
        self._secrets = _secrets_of(url)
        self.readonly = readonly
        self.busy_timeout_ms = int(busy_timeout_ms)
        if self.busy_timeout_ms < 0:
            raise StorageError(f"busy timeout must be >= 0 ms, got {busy_timeout_ms}")
        libpq_url, pool_params = _split_pool_params(url)
        try:
            params = conninfo_to_dict(libpq_url)
        except psycopg.Error as exc:
            raise StorageError(f"bad PostgreSQL URL: {self._scrub(single_line(str(exc)))}") from exc
        self.url_params = {k: str(v) for k, v in params.items() if k != "password"}
        for port in str(params.get("port", "")).split(","):
            if port and not (port.isdigit() and 0 < int(port) < 65536):
                raise StorageError(f"bad PostgreSQL URL: port {port!r} is not a number from 1 to 65535")
        self.pool_min_size = self._pool_int(pool_min_size, pool_params, "pool_min_size", DEFAULT_POOL_MIN_SIZE, 0)
        self.pool_max_size = self._pool_int(pool_max_size, pool_params, "pool_max_size", DEFAULT_POOL_MAX_SIZE, 1)
        if self.pool_max_size < self.pool_min_size:
            raise StorageError(
                f"bad PostgreSQL URL: pool_max_size ({self.pool_max_size}) "
                f"is below pool_min_size ({self.pool_min_size})"
            )
        if pool_timeout_s is None:
            raw = pool_params.get("pool_timeout")
            try:
                pool_timeout_s = float(raw) if raw is not None else max(self.busy_timeout_ms / 1000, 0.1)
            except ValueError:
                raise StorageError(f"bad PostgreSQL URL: pool_timeout={raw!r} is not a number of seconds") from None
        if pool_timeout_s <= 0:
            raise StorageError(f"bad PostgreSQL URL: pool_timeout must be > 0 seconds, got {pool_timeout_s}")
        self.pool_timeout_s = float(pool_timeout_s)
        # Session settings ride in libpq's `options`, ahead of the URL's own,
        # so an explicit `-c lock_timeout=…` in the URL still wins.
        # lock_timeout=0 would mean "wait forever"; a zero busy timeout means
        # "do not wait", as on SQLite.
        ours = [f"-c lock_timeout={max(1, self.busy_timeout_ms)}"]
        if readonly:
            ours.append("-c default_transaction_read_only=on")
        options = " ".join([*ours, str(params["options"])] if params.get("options") else ours)
        extra: dict[str, Any] = {"options": options}
        if "connect_timeout" not in params:
            extra["connect_timeout"] = DEFAULT_CONNECT_TIMEOUT_S
        hosts = str(params.get("host") or params.get("hostaddr") or "")
        if "," in hosts and not readonly and "target_session_attrs" not in params:
            # Several hosts are a primary and its standbys: only a host that
            # accepts writes can serve the ledger, whichever one that is now.
            extra["target_session_attrs"] = "read-write"
        self._conninfo = make_conninfo(libpq_url, **extra)
        self._lock = threading.Lock()
        self._pool: ConnectionPool[_PooledConnection] | None = None
        # Until when (monotonic) statements fail at once, and with what: see
        # RECONNECT_PAUSE_S.
        self._unreachable: tuple[float, StorageError] | None = None
        self._pid = os.getpid()
        # Pools inherited across fork stay referenced and untouched: closing
        # one in the child would shut down sockets the parent still uses.
        self._inherited: list[ConnectionPool[_PooledConnection]] = []
        _ENGINES.add(self)

    @staticmethod
    def _pool_int(given: int | None, params: dict[str, str], name: str, default: int, floor: int) -> int:
        raw: object = given if given is not None else params.get(name, default)
        try:
            value = int(str(raw))
        except ValueError:
            raise StorageError(f"bad PostgreSQL URL: {name}={raw!r} is not a whole number") from None
        if value < floor:
            raise StorageError(f"bad PostgreSQL URL: {name} must be >= {floor}, got {value}")
        return value

    # -- describing without secrets -------------------------------------------------
    def describe(self) -> str:
        p = self.url_params
        user = f"{quote(p['user'], safe='')}@" if p.get("user") else ""
        hosts = (p.get("host") or p.get("hostaddr") or "").split(",")
        ports = p["port"].split(",") if p.get("port") else []
        # libpq: one port for every host, or one port per host.
        netloc = ",".join(
            quote(h, safe="") + (f":{ports[min(i, len(ports) - 1)]}" if ports else "") for i, h in enumerate(hosts)
        )
        return f"postgresql://{user}{netloc}/{quote(p.get('dbname', ''), safe='')}"

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    # -- connections ---------------------------------------------------------------
    def _new_pool(self) -> ConnectionPool[_PooledConnection]:
        # A direct connection first: if the server is down or refuses us, the
        # caller gets libpq's reason at once instead of a pool timeout.
        try:
            conn = psycopg.connect(self._conninfo, autocommit=True)
        except psycopg.Error as exc:
            raise self._translate(exc, connecting=True) from exc
        conn.close()
        return ConnectionPool(
            self._conninfo,
            connection_class=_PooledConnection,
            kwargs={"autocommit": True},
            min_size=self.pool_min_size,
            max_size=self.pool_max_size,
            timeout=self.pool_timeout_s,
            name=f"idemctl-{os.getpid()}",
            open=True,
        )

    def _current_pool(self) -> ConnectionPool[_PooledConnection]:
        pid = os.getpid()
        pool = self._pool
        if pool is not None and self._pid == pid:
            return pool
        with self._lock:
            if self._pid != pid:
                # First use after a fork: leave the parent's pool alone.
                if self._pool is not None:
                    self._inherited.append(self._pool)
                self._pool, self._pid = None, pid
            if self._pool is None:
                failed = self._unreachable
                if failed is not None and time.monotonic() < failed[0]:
                    # A new instance each time: threads must not share a traceback.
                    raise type(failed[1])(str(failed[1]))
                try:
                    self._pool = self._new_pool()
                except ConnectionFailedError as exc:
                    self._unreachable = (time.monotonic() + RECONNECT_PAUSE_S, exc)
                    raise
                self._unreachable = None
            return self._pool

    def _checkout(self) -> tuple[ConnectionPool[_PooledConnection], _PooledConnection]:
        pool = self._current_pool()
        try:
            return pool, pool.getconn()
        except PoolClosed:
            # Another thread's failure discarded this pool between the two
            # lines: its replacement is the one to use.
            pool = self._current_pool()
            return pool, pool.getconn()

    @contextlib.contextmanager
    def _connection(self) -> Iterator[psycopg.Connection]:
        # The pool's own connection() context manager, plus replacing the
        # pool when the server closed the connection under us.
        try:
            pool, conn = self._checkout()
        except psycopg.Error as exc:
            raise self._translate(exc) from exc
        try:
            yield conn
        except psycopg.Error as exc:
            error = self._translate(exc)
            if self._server_lost(conn, error):
                self._discard(pool, error)
            raise error from exc
        finally:
            pool.putconn(conn)

    def _server_lost(self, conn: psycopg.Connection[Any], error: StorageError) -> bool:
        """Whether this connection's server can no longer serve the ledger:
        it closed the connection, or (for a ledger that writes) it refuses
        writes now: an old primary fenced read-only, or demoted to a standby
        behind a name that has moved to the new primary."""
        return conn.broken or (not self.readonly and isinstance(error, ReadOnlyDatabaseError))

    def _discard(self, pool: ConnectionPool[_PooledConnection], error: StorageError) -> None:
        """Replace the pool whose server was lost (see _server_lost). A
        restart or failover closes every connection at once: each idle one in
        the pool would fail one more request, and the pool's own reconnection
        backs off (1 s, then 2, 4, ...) after the first refusal, long after a
        promoted standby accepts writes. So the whole pool goes: the next statement
        connects afresh, through every host of the URL, to whichever accepts
        writes now, or fails at once while none does. Connections other
        threads still hold are closed as they come back. A read-only server
        also pauses reconnecting (RECONNECT_PAUSE_S): if it is still the one
        the URL leads to, each request must not open a pool of its own."""
        with self._lock:
            if self._pool is not pool:
                return  # another thread's failure already replaced it
            self._pool = None
            if isinstance(error, ReadOnlyDatabaseError):
                self._unreachable = (time.monotonic() + RECONNECT_PAUSE_S, error)
        threading.Thread(target=_close_quietly, args=(pool,), name="idemctl-pool-close", daemon=True).start()

    def create_database(self) -> bool:
        """Create the database the URL names, as the URL's role, connected to
        the server's maintenance database (``postgres``, else ``template1``).
        True if this call created it, False if it already existed. A role
        that may not create databases gets DatabaseNotCreatedError, whose
        fields say what an administrator has to run."""
        name = self.url_params.get("dbname", "")
        role = self.url_params.get("user") or None
        if not name:
            raise DatabaseNotCreatedError(self.describe(), name, role, "the URL names no database")
        last: psycopg.Error | None = None
        for maintenance in ("postgres", "template1"):
            try:
                conn = psycopg.connect(make_conninfo(self._conninfo, dbname=maintenance), autocommit=True)
            except psycopg.Error as exc:
                last = exc
                continue
            try:
                conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
                return True
            except pgerrors.DuplicateDatabase:
                return False  # another init got there first: the database is there
            except psycopg.Error as exc:
                reason = self._scrub(single_line(str(exc)))
                raise DatabaseNotCreatedError(self.describe(), name, role, reason) from exc
            finally:
                conn.close()
        reason = self._scrub(_libpq_reason(str(last))) if last is not None else "no maintenance database"
        raise DatabaseNotCreatedError(self.describe(), name, role, reason)

    def open_async(self) -> AsyncPostgresEngine:
        """The request path of this engine for the running event loop (see
        AsyncPostgresEngine); it connects on its first statement."""
        return AsyncPostgresEngine(self)

    def close(self) -> None:
        # As on SQLite, a closed backend that is used again reconnects.
        with self._lock:
            pool, self._pool = self._pool, None
            mine = self._pid == os.getpid()
        if pool is not None and mine:
            pool.close()

    # -- errors ----------------------------------------------------------------------
    def _translate(self, exc: BaseException, *, connecting: bool = False) -> StorageError:
        where = self.describe()
        if isinstance(exc, PoolTimeout):
            return LedgerUnavailableError(
                f"no connection to {where} within {self.pool_timeout_s:g} s: "
                f"the server is unreachable or all {self.pool_max_size} pooled connections are busy"
            )
        if isinstance(exc, PoolClosed):
            return StorageError(f"the ledger at {where} is closed")
        state = getattr(exc, "sqlstate", None)
        diag = getattr(exc, "diag", None)
        primary = getattr(diag, "message_primary", None) if diag is not None else None
        msg = self._scrub(single_line(primary or str(exc)))
        if state == "55P03":
            return DatabaseLockedError(
                f"{where} is locked: another session held the row or table past the lock timeout "
                f"({self.busy_timeout_ms} ms unless the URL sets lock_timeout): {msg}"
            )
        if state == "57014":
            return DatabaseLockedError(f"a statement on {where} was cancelled or ran past statement_timeout: {msg}")
        if state in _LOCKED_STATES:  # deadlock or serialisation failure: the other session won
            return DatabaseLockedError(f"{where} is busy: this statement conflicted with another session: {msg}")
        if state == "25006":
            return ReadOnlyDatabaseError(f"{where} is read-only ({msg})")
        if state == "42P01":
            if "idempotency_keys" in msg:
                return SchemaMissingError(where)
            if "idemctl_" in msg:
                return SchemaOutdatedError(where)
            return StorageError(f"database error on {where}: {msg}")
        if state == "42703" and '"token"' in msg:
            return SchemaOutdatedError(where)
        if state == "3F000":
            return StorageError(f"{where}: the search_path names no existing schema to create the ledger in ({msg})")
        if state == "42501":
            return StorageError(f"permission denied on {where}: {msg}")
        if state == "3D000" or (connecting and re.search(r'database "[^"]*" does not exist', msg)):
            reason = self._scrub(_libpq_reason(primary or str(exc)))
            return LedgerNotFoundError(where, f"cannot open the ledger at {where}: {reason}")
        if (
            connecting
            or state in _GONE_STATES
            or (state or "").startswith("08")
            or (isinstance(exc, psycopg.OperationalError) and state is None)
        ):
            detail = self._scrub(_libpq_reason(primary or str(exc)))
            return ConnectionFailedError(f"cannot reach PostgreSQL at {where}: {detail}")
        if isinstance(exc, psycopg.DataError) and "NUL" in msg:
            return StorageError(f"PostgreSQL cannot store a NUL character in a text column ({msg})")
        return StorageError(f"database error on {where}: {msg}")

    # -- statements --------------------------------------------------------------------
    # Every statement autocommits on its own pooled connection, reads and
    # writes alike.
    def read(self, sql: str, params: Params) -> Rows:
        return self._run(sql, params)

    def write(self, sql: str, params: Params) -> Rows:
        return self._run(sql, params)

    def _run(self, sql: str, params: Params) -> Rows:
        # The request path's every step: the connection straight from the
        # pool and its kept cursor, without the pool's context manager (an
        # auto-commit connection has no transaction for it to end).
        try:
            pool, conn = self._checkout()
        except psycopg.Error as exc:
            raise self._translate(exc) from exc
        try:
            cur = conn.statement_cursor
            if cur is None:
                cur = conn.statement_cursor = conn.cursor()
            cur.execute(sql, params)
            rows: Rows = cur.fetchall()
            return rows
        except psycopg.Error as exc:
            conn.statement_cursor = None
            error = self._translate(exc)
            if self._server_lost(conn, error):
                self._discard(pool, error)
            raise error from exc
        finally:
            pool.putconn(conn)

    def write_turn(self, statements: Sequence[tuple[str, Params]]) -> list[Rows]:
        with self._connection() as conn:
            return [conn.execute(sql, params).fetchall() for sql, params in statements]

    def stream(self, sql: str, params: Params) -> Iterator[tuple[Any, ...]]:
        # A server-side cursor streams the rows in batches: a million rows
        # never sit in memory at once. It needs a transaction (read-only
        # work, so it holds no lock that the request path waits on).
        with self._connection() as conn, conn.transaction(), conn.cursor(name="idemctl_stream") as cur:
            cur.itersize = 500
            cur.execute(sql, params)
            yield from cur

    def table_names(self, names: Iterable[str]) -> set[str]:
        wanted = list(names)
        with self._connection() as conn:
            return _existing(conn, wanted)

    def storage_bytes(self, tables: Iterable[str]) -> int | None:
        """On-disk size of the ledger's tables and indexes (pg_total_relation_size)."""
        row = self.read(SQL_STORAGE_BYTES, {"names": list(tables)})
        return int(row[0][0]) if row else None

    def replication_settings(self) -> tuple[str, str, bool, tuple[str, ...]]:
        """synchronous_commit, synchronous_standby_names, whether this server
        is a standby, and its standbys as ``name=sync_state`` (``unknown``
        unless the role may read pg_stat_replication's details: a superuser
        or a member of pg_monitor)."""
        rows = self.read(SQL_REPLICATION, {})
        commit, names, recovering, standbys = rows[0]
        return str(commit), str(names), bool(recovering), tuple(str(x) for x in standbys)

    # -- schema ------------------------------------------------------------------------
    def migrate(self, body: Callable[[_PostgresTx], T], *, write: bool) -> T:
        # Two inits on a fresh database both create the same catalog entries;
        # the loser fails on the catalog's unique index once the winner
        # commits, and its retry finds the version table and waits on its lock.
        for attempt in range(5):
            try:
                return self._migrate_once(body, write)
            except psycopg.Error as exc:
                if isinstance(exc, _INIT_RACE) and attempt < 4:
                    continue
                raise self._translate(exc) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _migrate_once(self, body: Callable[[_PostgresTx], T], write: bool) -> T:
        pool = self._current_pool()
        try:
            with pool.connection() as conn:
                with conn.transaction() as tx:
                    if _existing(conn, ["idemctl_schema_version"]):
                        # Schema administration, not the request path: readers
                        # and the request path are unaffected by this lock.
                        conn.execute("LOCK TABLE idemctl_schema_version IN SHARE ROW EXCLUSIVE MODE")
                    result = body(_PostgresTx(self, conn))
                    if not write:
                        raise psycopg.Rollback(tx)  # leaves the block, writes nothing
                return result
        except PoolTimeout as exc:
            raise self._translate(exc) from exc


def _close_quietly(pool: ConnectionPool[_PooledConnection]) -> None:
    # Off the request path: closing waits for the pool's workers, and one
    # may be inside a connection attempt.
    try:
        pool.close(timeout=DEFAULT_CONNECT_TIMEOUT_S)
    except Exception:
        log.debug("closing a discarded pool failed", exc_info=True)


def _existing(conn: psycopg.Connection[Any], names: list[str]) -> set[str]:
    # to_regclass resolves through the connection's search_path, exactly as
    # the unqualified names in every statement do.
    row = conn.execute(
        "SELECT array_agg(name) FILTER (WHERE to_regclass(name) IS NOT NULL) FROM unnest(%s::text[]) AS name",
        (names,),
    ).fetchone()
    return set(row[0] or []) if row else set()


class _PostgresTx:
    def __init__(self, engine: PostgresEngine, conn: psycopg.Connection[Any]) -> None:
        self.engine = engine
        self.conn = conn

    def execute(self, sql: str, params: Params) -> Rows:
        cur = self.conn.execute(sql, params)
        return cur.fetchall() if cur.description is not None else []

    def script(self, sql: str) -> None:
        self.conn.execute(sql)

    def table_names(self, names: Iterable[str]) -> set[str]:
        return _existing(self.conn, list(names))

    def check_recipe_table(self) -> None:
        """A ledger table made by hand from the recipe's DDL has a TEXT body
        column, which cannot hold every response: say how to fix it rather
        than adopting it."""
        row = self.conn.execute(
            "SELECT format_type(atttypid, atttypmod) FROM pg_attribute"
            " WHERE attrelid = to_regclass('idempotency_keys') AND attname = 'response_body' AND NOT attisdropped",
        ).fetchone()
        if row is not None and row[0] != "bytea":
            raise StorageError(
                f"{self.engine.describe()}: idempotency_keys.response_body is {row[0]}, "
                "and idemctl on PostgreSQL stores "
                "response bodies as bytea; convert it first: ALTER TABLE idempotency_keys ALTER COLUMN response_body "
                "TYPE bytea USING convert_to(response_body, 'UTF8')"
            )


# -- the asynchronous engine: the same statements on psycopg's async connections --------


class _AsyncPooledConnection(psycopg.AsyncConnection[tuple[Any, ...]]):
    """The asynchronous twin of _PooledConnection, with its one kept cursor."""

    statement_cursor: psycopg.AsyncCursor[tuple[Any, ...]] | None = None


class AsyncPostgresEngine:
    """The request path of a PostgresEngine on one event loop: psycopg's
    AsyncConnection in a psycopg_pool.AsyncConnectionPool with the same
    settings (URL, pool sizes, timeouts, session options) and the same error
    translation; a statement waits on the loop, never in a thread. Nothing
    connects until the first statement; `aclose` closes the pool."""

    dialect = POSTGRES

    def __init__(self, engine: PostgresEngine) -> None:
        self.engine = engine
        self._pool: AsyncConnectionPool[_AsyncPooledConnection] | None = None
        self._opening: asyncio.Lock | None = None
        # Every connection the pool made, so that `abandon` can close their
        # sockets without the loop (once the loop is gone).
        self._made: weakref.WeakSet[_AsyncPooledConnection] = weakref.WeakSet()

    def describe(self) -> str:
        return self.engine.describe()

    async def _current_pool(self) -> AsyncConnectionPool[_AsyncPooledConnection]:
        pool = self._pool
        if pool is not None:
            return pool
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._pool is None:
                self._pool = await self._new_pool()
            return self._pool

    async def _new_pool(self) -> AsyncConnectionPool[_AsyncPooledConnection]:
        engine = self.engine
        # As the synchronous pool: a direct connection first, for libpq's reason.
        try:
            conn = await psycopg.AsyncConnection.connect(engine._conninfo, autocommit=True)
        except psycopg.Error as exc:
            raise engine._translate(exc, connecting=True) from exc
        await conn.close()

        async def remember(made: _AsyncPooledConnection) -> None:
            self._made.add(made)

        pool = AsyncConnectionPool(
            engine._conninfo,
            connection_class=_AsyncPooledConnection,
            kwargs={"autocommit": True},
            # Connections are made as the loop needs them, never ahead: the
            # pool's workers swallow a cancellation while they connect, and
            # a loop ending then (asyncio.run returning) would wait forever.
            min_size=0,
            max_size=engine.pool_max_size,
            timeout=engine.pool_timeout_s,
            name=f"idemctl-async-{os.getpid()}",
            configure=remember,
            open=False,
        )
        await pool.open()
        return pool

    async def execute(self, sql: str, params: Params) -> Rows:
        """One auto-committed statement (read or write); its rows."""
        pool = await self._current_pool()
        try:
            conn = await pool.getconn()
        except psycopg.Error as exc:
            raise self.engine._translate(exc) from exc
        try:
            cur = conn.statement_cursor
            if cur is None:
                cur = conn.statement_cursor = conn.cursor()
            await cur.execute(sql, params)
            rows: Rows = await cur.fetchall()
            return rows
        except psycopg.Error as exc:
            conn.statement_cursor = None
            if conn.broken:
                await self._drop_broken_idle(pool)
            raise self.engine._translate(exc) from exc
        finally:
            await pool.putconn(conn)

    async def write_turn(self, statements: Sequence[tuple[str, Params]]) -> list[Rows]:
        pool = await self._current_pool()
        try:
            async with pool.connection() as conn:
                out: list[Rows] = []
                for sql, params in statements:
                    cur = await conn.execute(sql, params)
                    out.append(await cur.fetchall())
                return out
        except psycopg.Error as exc:
            raise self.engine._translate(exc) from exc

    async def table_names(self, names: Iterable[str]) -> set[str]:
        rows = await self.execute(_EXISTING, {"names": list(names)})
        return set(rows[0][0] or []) if rows else set()

    @staticmethod
    async def _drop_broken_idle(pool: AsyncConnectionPool[_AsyncPooledConnection]) -> None:
        # See PostgresEngine._drop_broken_idle.
        try:
            await pool.check()
        except Exception:
            log.debug("checking the pool's idle connections failed", exc_info=True)

    async def aclose(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    def abandon(self) -> None:
        """Close the sockets of a pool whose event loop is gone (it cannot
        be closed the asynchronous way any more)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            # Its workers died with their loop: nothing is left to stop when
            # the pool is collected (which would call into the closed loop).
            pool._closed = True
        for conn in list(self._made):
            with contextlib.suppress(Exception):
                conn.pgconn.finish()


_EXISTING = (
    "SELECT array_agg(name) FILTER (WHERE to_regclass(name) IS NOT NULL) FROM unnest(%(names)s::text[]) AS name"
)
