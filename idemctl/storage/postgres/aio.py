"""The asynchronous engine: a PostgresEngine's request path on one event
loop, with the same statements and the same errors, awaited on psycopg's
AsyncConnection instead of run in a thread."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import weakref
from collections.abc import Awaitable, Iterable, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg_pool import AsyncConnectionPool

from ...errors import StorageError
from ..dialect import POSTGRES
from ..engine import Params, Rows
from ..server import unreachable
from .errors import Translator
from .pooler import (
    MARKER_QUERY,
    AsyncSettingsCursor,
    StatementSettings,
    adetect,
    honoured,
    options_lost,
    pool_arguments,
    settings_sql,
)
from .schema import EXISTING, existing_tables
from .url import ServerSettings
from .watch import AsyncCommitWatch

log = logging.getLogger("idemctl")
T = TypeVar("T")


class _AsyncPooledConnection(psycopg.AsyncConnection[tuple[Any, ...]]):
    """A pooled connection with one kept cursor for the one-statement steps
    (as the synchronous pool's connections have)."""

    statement_cursor: psycopg.AsyncCursor[tuple[Any, ...]] | None = None
    idemctl_settings: StatementSettings | None = None


async def within_acquire(opening: Awaitable[T], acquire_s: float, where: str) -> T:
    """`opening` (a pool's first connection), or ConnectionFailedError once
    it has taken `acquire_s`."""
    try:
        return await asyncio.wait_for(opening, acquire_s)
    except TimeoutError:
        raise unreachable("PostgreSQL", where, f"no answer within {acquire_s:g} s (the commit timeout)") from None


class LoopEngine:
    """What both asynchronous engines (psycopg's here, asyncpg's in
    asyncpg_engine.py) take and share: the URL's settings, the translator,
    the pooler the synchronous engine found (None: detect it), the commit
    timeout and how long a request waits for a connection. `_start` sets up
    the rest."""

    dialect = POSTGRES
    # psycopg's pool waits with asyncio.wait_for, which cancels the task on
    # Python 3.12 and later: each write keeps a task and a shield of its own.
    lands_in_place = False

    def __init__(self, settings: ServerSettings, translate: Translator, pooler: str | None = None) -> None:
        # `translate` is the synchronous engine's: its pool timeout is already
        # the wait for a connection (settings.acquire_s).
        self._settings = settings
        self._translate = translate
        self._commit_timeout_s = settings.commit_timeout_s
        self._acquire_s = settings.acquire_s
        # What the URL leads to (see PostgresEngine.pooler): known if the
        # synchronous engine already connected, else detected here.
        self.pooler = pooler
        self._start()

    def _start(self) -> None:
        """The engine's own state."""

    def describe(self) -> str:
        return self._translate.where


class AsyncPostgresEngine(LoopEngine):
    """The request path of a PostgresEngine on one event loop: psycopg's
    AsyncConnection in a psycopg_pool.AsyncConnectionPool with the same
    settings (URL, pool sizes, timeouts, session options) and the same error
    translation; a statement waits on the loop, never in a thread, and is
    bounded by the same commit timeout (watch.py). Nothing connects until
    the first statement; `aclose` closes the pool. `PostgresEngine.open_async`
    makes one."""

    def _start(self) -> None:
        self._watch = AsyncCommitWatch(self._commit_timeout_s, self.describe())
        self._pool: AsyncConnectionPool[_AsyncPooledConnection] | None = None
        self._opening: asyncio.Lock | None = None
        # Every connection the pool made, so that `abandon` can close their
        # sockets without the loop (once the loop is gone).
        self._made: weakref.WeakSet[_AsyncPooledConnection] = weakref.WeakSet()
        # As PostgresEngine._options_lost; pools being closed after it.
        self._options_lost = False
        self._closing: set[asyncio.Future[None]] = set()
        self._closed = False

    async def _current_pool(self) -> AsyncConnectionPool[_AsyncPooledConnection]:
        pool = self._pool
        if pool is not None:
            return pool
        if self._closed:
            # Closed for good (the ledger's aclose): a new pool here would be
            # one nobody closes, its connections and tasks left behind.
            raise StorageError(f"the ledger at {self.describe()} is closed")
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._pool is None:
                self._pool = await within_acquire(self._new_pool(), self._acquire_s, self.describe())
            return self._pool

    async def _new_pool(self) -> AsyncConnectionPool[_AsyncPooledConnection]:
        # As the synchronous pool: a first connection says what the URL leads
        # to, and gives libpq's reason at once if nothing answers.
        mode = self.pooler = await adetect(self._settings, self._translate)
        conninfo, kwargs = pool_arguments(self._settings, mode, self.describe(), AsyncSettingsCursor)
        session = settings_sql(self._settings.settings or (), local=False) if mode == "session" else ""
        prefix = StatementSettings.of(self._settings)
        made = self._made

        async def remember(conn: _AsyncPooledConnection) -> None:
            made.add(conn)
            if mode == "none":
                row = await (await conn.execute(MARKER_QUERY)).fetchone()
                if not honoured(row[0] if row else None):
                    self._options_lost = True
                    raise options_lost(self.describe())
            elif mode == "session":
                await psycopg.AsyncClientCursor(conn).execute(session)
            else:
                conn.idemctl_settings = prefix

        pool = AsyncConnectionPool(
            conninfo,
            connection_class=_AsyncPooledConnection,
            kwargs=kwargs,
            # Connections are made as the loop needs them, never ahead: the
            # pool's workers swallow a cancellation while they connect, and
            # a loop ending then (asyncio.run returning) would wait forever.
            min_size=0,
            max_size=self._translate.pool_max_size,
            timeout=self._translate.pool_timeout_s,
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
            conn = await pool.getconn(self._acquire_s)
        except psycopg.Error as exc:
            if self._options_lost and self._pool is pool:
                # Its new connections lack their startup options: the next
                # statement opens a pool on what the URL leads to now.
                self._pool, self._options_lost = None, False
                closing = asyncio.ensure_future(pool.close())
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)
            raise self._translate(exc) from exc
        watch = self._watch
        late = None
        try:
            try:
                watch.watch(conn)  # inside: whatever it raises, release() follows
                cur = conn.statement_cursor
                if cur is None:
                    cur = conn.statement_cursor = conn.cursor()
                await cur.execute(sql, params)
                rows: Rows = await cur.fetchall()
            finally:
                late = watch.release(conn)
            if late is not None:
                raise watch.error()
            return rows
        except psycopg.Error as exc:
            conn.statement_cursor = None
            if late is not None:
                raise watch.error() from exc
            if conn.broken:
                await self._drop_broken_idle(pool)
            raise self._translate(exc) from exc
        finally:
            if late is not None:
                await watch.retire(conn, late)
            await pool.putconn(conn)

    async def write_turn(self, statements: Sequence[tuple[str, Params]]) -> list[Rows]:
        pool = await self._current_pool()
        try:
            conn = await pool.getconn(self._acquire_s)
        except psycopg.Error as exc:
            raise self._translate(exc) from exc
        watch = self._watch
        late = None
        try:
            out: list[Rows] = []
            for sql, params in statements:
                try:
                    watch.watch(conn)
                    cur = await conn.execute(sql, params)
                    rows = await cur.fetchall()
                finally:
                    late = watch.release(conn)
                if late is not None:
                    raise watch.error()
                out.append(rows)
            return out
        except psycopg.Error as exc:
            if late is not None:
                raise watch.error() from exc
            raise self._translate(exc) from exc
        finally:
            if late is not None:
                await watch.retire(conn, late)
            await pool.putconn(conn)

    async def table_names(self, names: Iterable[str]) -> set[str]:
        return existing_tables(await self.execute(EXISTING, {"names": list(names)}))

    @staticmethod
    async def _drop_broken_idle(pool: AsyncConnectionPool[_AsyncPooledConnection]) -> None:
        # The server closed a connection: a restart or failover closes every
        # idle one too, and each would fail one more request. The pool's
        # check drops the dead ones now.
        try:
            await pool.check()
        except Exception:
            log.debug("checking the pool's idle connections failed", exc_info=True)

    async def aclose(self) -> None:
        self._closed = True
        self._watch.close()
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    def abandon(self) -> None:
        """Close the sockets of a pool whose event loop is gone (it cannot
        be closed the asynchronous way any more)."""
        self._closed = True
        self._watch.close()
        pool, self._pool = self._pool, None
        if pool is not None:
            # Its workers died with their loop: nothing is left to stop when
            # the pool is collected (which would call into the closed loop).
            pool._closed = True
        for conn in list(self._made):
            with contextlib.suppress(Exception):
                conn.pgconn.finish()
