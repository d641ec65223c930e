"""PostgreSQL engine: a per-process connection pool and PostgreSQL's errors.

Each request-path step is a single statement on an auto-commit connection, so
its atomicity is PostgreSQL's row-level atomicity of one statement under READ
COMMITTED: a concurrent writer of the same row is waited for, and the WHERE
clause is re-checked against the row version that writer committed.

Connections come from a psycopg_pool.ConnectionPool that is opened on first
use and belongs to one process: after a fork the child builds its own pool
and never touches the parent's sockets. An event loop gets its own
AsyncConnectionPool (aio.py's AsyncPostgresEngine) for the asynchronous
request path (on asyncpg when it is installed: asyncpg_engine.py).
errors.py turns what psycopg raises into idemctl's errors; schema.py holds the schema transactions."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import psycopg
import psycopg.sql
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from ...errors import ConnectionFailedError, ReadOnlyDatabaseError, StorageError
from ...policy import DEFAULT_BUSY_TIMEOUT_MS
from ..aio import AsyncEngine
from ..capabilities import DatabaseCreated
from ..dialect import POSTGRES
from ..engine import Params, Rows
from ..failover.postgres import ReplicationSettings
from ..server import checked_busy_timeout, scrub
from .admin import create_database
from .aio import AsyncPostgresEngine
from .errors import INIT_RACE, Translator, pooler_mode_refused
from .pooler import (
    MARKER_QUERY,
    SettingsCursor,
    StatementSettings,
    detect,
    honoured,
    options_lost,
    pool_arguments,
    settings_sql,
)
from .schema import PostgresTx, existing
from .url import DEFAULT_CONNECT_TIMEOUT_S, ServerSettings
from .watch import CommitWatch

log = logging.getLogger("idemctl")
T = TypeVar("T")

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
        engine._watch = engine._watch.forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


class _PooledConnection(psycopg.Connection[tuple[Any, ...]]):
    """A pooled connection that keeps one cursor for the one-statement steps
    it runs (a connection serves one caller at a time): a new cursor per
    statement is a measurable part of a request's own CPU."""

    statement_cursor: psycopg.Cursor[tuple[Any, ...]] | None = None
    # Behind a transaction or statement pooler: the settings each statement
    # carries (pooler.py's SettingsCursor reads them).
    idemctl_settings: StatementSettings | None = None
    # Set when something other than an error (Ctrl-C, a thread's exit)
    # stopped a statement on it: given back mid-statement, the pool closes it.
    interrupted: bool = False


class _QuietWhenInterrupted(logging.Filter):
    """psycopg_pool warns, in two lines, when it is given back a connection
    still running a statement ("closing returned connection", "discarding
    closed connection"). After Ctrl-C that is how every interrupted
    statement ends, and whoever pressed it hears it once (the CLI exits 130):
    those two lines are dropped for a connection idemctl saw interrupted,
    and only for one."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and args and getattr(args[0], "interrupted", False) is True)


logging.getLogger("psycopg.pool").addFilter(_QuietWhenInterrupted())


class PostgresEngine:
    """A ledger in a PostgreSQL database, shared by any number of threads,
    processes and hosts.

    Pool settings ride on the URL as idemctl's own query parameters:
    ``pool_min_size`` (default 1), ``pool_max_size`` (default 10),
    ``pool_timeout`` (seconds to wait for a free connection; default the busy
    timeout), ``commit_timeout`` (seconds a statement may take, its
    commit's wait for a synchronous standby included, before it is cancelled
    and fails with CommitTimeoutError; default twice the busy timeout, at
    least 1 s: see watch.py). ``pooler`` says what the URL leads to
    (``auto``, the default, detects it; ``none``, ``session``,
    ``transaction``, ``statement``: see pooler.py) and ``prepare_threshold``
    is psycopg's (a number, or ``none`` for never; a transaction or
    statement pooler never prepares). ``async_driver=psycopg`` keeps the
    asynchronous request path on psycopg when asyncpg is installed (see
    open_async). libpq's own parameters
    (``connect_timeout``, default 5 s;
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
        busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
        pool_min_size: int | None = None,
        pool_max_size: int | None = None,
        pool_timeout_s: float | None = None,
        commit_timeout_s: float | None = None,
    ) -> None:
        self.readonly = readonly
        self.busy_timeout_ms = checked_busy_timeout(busy_timeout_ms)
        settings = ServerSettings.parse(
            url,
            readonly=readonly,
            busy_timeout_ms=self.busy_timeout_ms,
            pool_min_size=pool_min_size,
            pool_max_size=pool_max_size,
            pool_timeout_s=pool_timeout_s,
            commit_timeout_s=commit_timeout_s,
        )
        self._secrets = settings.secrets
        self._settings = settings
        self._conninfo = settings.conninfo
        # What the URL led to when the pool last opened: "none" (the server
        # itself), or the pool mode of the pooler in between.
        self.pooler: str | None = None
        # Set when a direct pool's new connection lost the startup options:
        # the pool is replaced (and the pooler detected) on the next failure.
        self._options_lost = False
        self.url_params = settings.url_params
        self.pool_min_size, self.pool_max_size = settings.pool_min_size, settings.pool_max_size
        self.pool_timeout_s = settings.pool_timeout_s
        self.commit_timeout_s = settings.commit_timeout_s
        self._describe = settings.describe()
        self._acquire_s = settings.acquire_s
        self._translate = Translator(
            self._describe, self._scrub, self.busy_timeout_ms, self._acquire_s, self.pool_max_size
        )
        self._lock = threading.Lock()
        self._watch = CommitWatch(self.commit_timeout_s, self._describe)
        self._pool: ConnectionPool[_PooledConnection] | None = None
        # Until when (monotonic) statements fail at once, and with what: see
        # RECONNECT_PAUSE_S.
        self._unreachable: tuple[float, StorageError] | None = None
        self._pid = os.getpid()
        # Pools inherited across fork stay referenced and untouched: closing
        # one in the child would shut down sockets the parent still uses.
        self._inherited: list[ConnectionPool[_PooledConnection]] = []
        _ENGINES.add(self)

    # -- describing without secrets -------------------------------------------------
    def describe(self) -> str:
        return self._describe

    def _scrub(self, text: str) -> str:
        return scrub(text, self._secrets)

    # -- connections ---------------------------------------------------------------
    def _new_pool(self) -> ConnectionPool[_PooledConnection]:
        mode = detect(self._settings, self._translate)
        if mode != self.pooler:
            if mode != "none":
                how = "per session" if mode == "session" else "per transaction, without prepared statements"
                log.info(
                    "PostgreSQL at %s is behind a connection pooler (%s pooling): settings apply %s",
                    self._describe,
                    mode,
                    how,
                )
            self.pooler = mode
        self._options_lost = False
        conninfo, kwargs = pool_arguments(self._settings, mode, self._describe, SettingsCursor)
        return ConnectionPool(
            conninfo,
            connection_class=_PooledConnection,
            kwargs=kwargs,
            min_size=self.pool_min_size,
            max_size=self.pool_max_size,
            timeout=self._acquire_s,
            name=f"idemctl-{os.getpid()}",
            configure=self._configure_for(mode),
            open=True,
        )

    def _configure_for(self, mode: str) -> Callable[[_PooledConnection], None]:
        """Each new connection's one round trip, once: a direct one checks
        that its startup options arrived; a pooled one gets its settings."""
        if mode == "none":

            def check(conn: _PooledConnection) -> None:
                row = conn.execute(MARKER_QUERY).fetchone()
                if not honoured(row[0] if row else None):
                    # Never run a statement without its settings: this pool
                    # goes, and the next one detects what is there now.
                    self._options_lost = True
                    raise options_lost(self._describe)

            return check
        if mode == "session":
            query = settings_sql(self._settings.settings or (), local=False)

            def set_session(conn: _PooledConnection) -> None:
                psycopg.ClientCursor(conn).execute(query)

            return set_session
        prefix = StatementSettings.of(self._settings)

        def remember(conn: _PooledConnection) -> None:
            conn.idemctl_settings = prefix

        return remember

    def _transaction_settings(self, conn: psycopg.Connection[Any]) -> None:
        """Right after BEGIN on a pooled connection: the settings, for the
        statements that do not go through its SettingsCursor."""
        prefix: StatementSettings | None = getattr(conn, "idemctl_settings", None)
        if prefix is not None and prefix.plain:
            psycopg.ClientCursor(conn).execute(prefix.plain)

    def _refuse_transactions(self) -> None:
        """A statement pooler refuses any transaction: say so before trying."""
        if self.pooler == "statement":
            raise pooler_mode_refused(self._describe)

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
        try:
            pool = self._current_pool()
            try:
                return pool, pool.getconn()
            except PoolClosed:
                # Another thread's failure discarded this pool between the two
                # lines: its replacement is the one to use.
                pool = self._current_pool()
                return pool, pool.getconn()
        except psycopg.Error as exc:
            error = self._translate(exc)
            lost = self._pool
            if self._options_lost and lost is not None:
                self._discard(lost, error)  # its new connections lack their settings: see _configure_for
            raise error from exc

    def _failed(
        self, pool: ConnectionPool[_PooledConnection], conn: psycopg.Connection[Any], exc: psycopg.Error
    ) -> StorageError:
        """The error to raise for `exc` on `conn`; the pool goes if its server was lost."""
        error = self._translate(exc)
        if self._server_lost(conn, error):
            self._discard(pool, error)
        return error

    @contextlib.contextmanager
    def _connection(self) -> Iterator[psycopg.Connection]:
        # The pool's own connection() context manager, plus replacing the
        # pool when the server closed the connection under us.
        pool, conn = self._checkout()
        try:
            yield conn
        except psycopg.Error as exc:
            raise self._failed(pool, conn, exc) from exc
        except BaseException:
            _interrupted(conn)
            raise
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

    def create_database(self) -> DatabaseCreated:
        """Create the database the URL names, as the URL's role (admin.py);
        a role that may not gets DatabaseNotCreatedError, with the createdb
        an administrator runs instead."""
        return create_database(self._settings, self.describe(), self._scrub)

    def open_async(self) -> AsyncEngine:
        """The request path of this engine for the running event loop: on
        asyncpg when it is installed and the URL does not say
        ``async_driver=psycopg`` (asyncpg_engine.py), else on psycopg
        (AsyncPostgresEngine); it connects on its first statement."""
        if self._settings.async_driver == "auto" and _asyncpg_installed():
            from .asyncpg_engine import AsyncpgEngine

            return AsyncpgEngine(self._settings, self._translate, self.pooler)
        return AsyncPostgresEngine(self._settings, self._translate, self.pooler)

    def close(self) -> None:
        # As on SQLite, a closed backend that is used again reconnects.
        with self._lock:
            pool, self._pool = self._pool, None
            mine = self._pid == os.getpid()
        self._watch.close()
        if pool is not None and mine:
            pool.close()

    # -- statements --------------------------------------------------------------------
    # Every statement autocommits on its own pooled connection, reads and
    # writes alike, and is bounded by the commit timeout (watch.py): one
    # still running then is cancelled, and fails whatever it returns.
    def read(self, sql: str, params: Params) -> Rows:
        return self._run(sql, params)

    def write(self, sql: str, params: Params) -> Rows:
        return self._run(sql, params)

    def _run(self, sql: str, params: Params) -> Rows:
        # The request path's every step: the connection straight from the
        # pool and its kept cursor, without the pool's context manager (an
        # auto-commit connection has no transaction for it to end).
        pool, conn = self._checkout()
        watch = self._watch
        late = None
        try:
            try:
                watch.watch(conn)  # inside: whatever it raises, release() follows
                cur = conn.statement_cursor
                if cur is None:
                    cur = conn.statement_cursor = conn.cursor()
                cur.execute(sql, params)
                rows: Rows = cur.fetchall()
            finally:
                late = watch.release(conn)
            if late is not None:
                raise watch.error()
            return rows
        except psycopg.Error as exc:
            conn.statement_cursor = None
            if late is not None:
                raise watch.error() from exc
            raise self._failed(pool, conn, exc) from exc
        except BaseException:
            _interrupted(conn)
            raise
        finally:
            if late is not None:
                watch.retire(conn, late)
            pool.putconn(conn)

    def write_turn(self, statements: Sequence[tuple[str, Params]]) -> list[Rows]:
        # Each statement commits on its own, so each is bounded on its own.
        pool, conn = self._checkout()
        watch = self._watch
        late = None
        try:
            out: list[Rows] = []
            for sql, params in statements:
                try:
                    watch.watch(conn)
                    rows = conn.execute(sql, params).fetchall()
                finally:
                    late = watch.release(conn)
                if late is not None:
                    raise watch.error()
                out.append(rows)
            return out
        except psycopg.Error as exc:
            if late is not None:
                raise watch.error() from exc
            raise self._failed(pool, conn, exc) from exc
        finally:
            if late is not None:
                watch.retire(conn, late)
            pool.putconn(conn)

    def stream(self, sql: str, params: Params) -> Iterator[tuple[Any, ...]]:
        # A server-side cursor streams the rows in batches: a million rows
        # never sit in memory at once. It needs a transaction (read-only
        # work, so it holds no lock that the request path waits on).
        with self._connection() as conn:
            self._refuse_transactions()
            with conn.transaction(), conn.cursor(name="idemctl_stream") as cur:
                self._transaction_settings(conn)
                cur.itersize = 500
                cur.execute(sql, params)
                yield from cur

    def table_names(self, names: Iterable[str]) -> set[str]:
        wanted = list(names)
        with self._connection() as conn:
            return existing(conn, wanted)

    def storage_bytes(self, tables: Iterable[str]) -> int | None:
        """On-disk size of the ledger's tables and indexes (pg_total_relation_size)."""
        row = self.read(SQL_STORAGE_BYTES, {"names": list(tables)})
        return int(row[0][0]) if row else None

    def failover_facts(self) -> ReplicationSettings:
        """synchronous_commit, synchronous_standby_names, whether this server
        is a standby, and its standbys as ``name=sync_state`` (``unknown``
        unless the role may read pg_stat_replication's details: a superuser
        or a member of pg_monitor), as the ledger's own session sees them."""
        rows = self.read(SQL_REPLICATION, {})
        commit, names, recovering, standbys = rows[0]
        return ReplicationSettings(str(commit), str(names), bool(recovering), tuple(str(x) for x in standbys))

    # -- schema ------------------------------------------------------------------------
    def migrate(self, body: Callable[[PostgresTx], T], *, write: bool) -> T:
        # Two inits on a fresh database both create the same catalog entries;
        # the loser fails on the catalog's unique index once the winner
        # commits, and its retry finds the version table and waits on its lock.
        for attempt in range(5):
            try:
                return self._migrate_once(body, write)
            except psycopg.Error as exc:
                if isinstance(exc, INIT_RACE) and attempt < 4:
                    continue
                raise self._translate(exc) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _migrate_once(self, body: Callable[[PostgresTx], T], write: bool) -> T:
        pool = self._current_pool()
        self._refuse_transactions()
        try:
            with pool.connection() as conn:
                with conn.transaction() as tx:
                    self._transaction_settings(conn)
                    if existing(conn, ["idemctl_schema_version"]):
                        # Schema administration, not the request path: readers
                        # and the request path are unaffected by this lock.
                        conn.execute("LOCK TABLE idemctl_schema_version IN SHARE ROW EXCLUSIVE MODE")
                    result = body(PostgresTx(self._describe, conn))
                    if not write:
                        raise psycopg.Rollback(tx)  # leaves the block, writes nothing
                return result
        except PoolTimeout as exc:
            raise self._translate(exc) from exc


_CLOSED_BY_THE_POOL = (TransactionStatus.ACTIVE, TransactionStatus.UNKNOWN)


def _interrupted(conn: psycopg.Connection[Any]) -> None:
    """`conn` goes back to the pool with its statement stopped by something
    other than an error: the pool closes it without a word (see
    _QuietWhenInterrupted), as the statement is still running on it."""
    # Only a connection the pool will close (mid-statement, or already
    # broken): it is never handed out again, so the mark cannot silence a
    # later warning about the same object.
    if isinstance(conn, _PooledConnection) and conn.pgconn.transaction_status in _CLOSED_BY_THE_POOL:
        conn.statement_cursor = None
        conn.interrupted = True


@functools.cache
def _asyncpg_installed() -> bool:
    return importlib.util.find_spec("asyncpg") is not None


def _close_quietly(pool: ConnectionPool[_PooledConnection]) -> None:
    # Off the request path: closing waits for the pool's workers, and one
    # may be inside a connection attempt.
    try:
        pool.close(timeout=DEFAULT_CONNECT_TIMEOUT_S)
    except Exception:
        log.debug("closing a discarded pool failed", exc_info=True)
