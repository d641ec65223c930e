"""The asynchronous engine on asyncpg: a PostgresEngine's request path on one
event loop, with the same statements, the same settings and the same typed
errors as aio.py's psycopg engine, in fewer microseconds a statement.

Chosen by `PostgresEngine.open_async` when asyncpg is installed (the
``postgres-async`` extra) and the URL says nothing only libpq understands;
``async_driver=psycopg`` in the URL keeps psycopg (url.py).

- Statements: the dialect's text (``%(name)s``) renumbered once per text as
  ``$1..$n`` (`positional`); asyncpg prepares each on a connection once and
  keeps it (its statement cache), so a request's statements are Bind and
  Execute only.
- Connections: a small pool of its own (`_Pool`): a checkout is a list pop,
  a return a list append; no task, no reset query (every statement
  autocommits: there is no session state to reset).
- The commit timeout: one watcher per loop (deadlines.py) cancels a
  statement past it, and asyncpg then sends the server a cancel request;
  the connection is closed once that request is over (or after the
  grace), and the caller gets CommitTimeoutError, as watch.py does for
  psycopg.
- Poolers: detected as for psycopg (pooler.py). Directly, the settings are
  startup parameters and every new connection checks the marker; in
  session pooling they are set once per connection. Behind transaction or
  statement pooling, where each statement must carry its settings in one
  simple-protocol query (which asyncpg cannot send with parameters), the
  psycopg engine serves instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import asyncpg
from psycopg.conninfo import conninfo_to_dict

from ...errors import CommitTimeoutError, LedgerUnavailableError, StorageError
from ...text import single_line
from .. import server
from ..deadlines import ON_THE_WIRE, Deadlines
from ..engine import Params, Rows
from ..server import unreachable
from . import pooler as pooling
from .aio import AsyncPostgresEngine, LoopEngine, within_acquire
from .pooler import adetect, honoured, options_lost, settings_sql
from .schema import EXISTING, existing_tables
from .url import MARKER_SETTING, ServerSettings
from .watch import CANCEL_GRACE_S

_PYFORMAT = re.compile(r"%\((\w+)\)s|%%")

# libpq's connection parameters asyncpg takes under its own name; a URL with
# any other (sslrootcert, service, keepalives, ...) is served by psycopg.
_SAME = {"host": "host", "port": "port", "user": "user", "password": "password", "dbname": "database"}
_TAKEN = {*_SAME, "connect_timeout", "sslmode", "target_session_attrs", "application_name", "options"}


def positional(sql: str) -> tuple[str, tuple[str, ...]]:
    """A ``%(name)s`` statement as asyncpg's ``$n`` one, and the names in
    the order of their numbers (a name used twice keeps its number).

    >>> positional("SELECT %(a)s, %(b)s, %(a)s, 100 %% 7")
    ('SELECT $1, $2, $1, 100 % 7', ('a', 'b'))
    """
    names: dict[str, int] = {}

    def number(m: re.Match[str]) -> str:
        name = m.group(1)
        if name is None:
            return "%"
        return f"${names.setdefault(name, len(names) + 1)}"

    return _PYFORMAT.sub(number, sql), tuple(names)


def connect_arguments(settings: ServerSettings, mode: str) -> dict[str, Any] | None:
    """asyncpg.connect's arguments for the URL in pooler `mode`, or None
    when the URL needs something only libpq understands."""
    if settings.settings is None:
        return None  # options other than -c name=value
    params = conninfo_to_dict(settings.conninfo if mode == "none" else settings.pooled_conninfo)
    if set(params) - _TAKEN:
        return None
    out: dict[str, Any] = {theirs: str(params[ours]) for ours, theirs in _SAME.items() if params.get(ours)}
    if "," in out.get("host", ""):
        out["host"] = out["host"].split(",")
    if "port" in out:
        ports = [int(p) for p in out["port"].split(",")]
        out["port"] = ports if len(ports) > 1 else ports[0]
    out["timeout"] = float(params.get("connect_timeout") or 5)
    if params.get("sslmode"):
        out["ssl"] = str(params["sslmode"])
    if params.get("target_session_attrs"):
        out["target_session_attrs"] = str(params["target_session_attrs"])
    server: dict[str, str] = {}
    if params.get("application_name"):
        server["application_name"] = str(params["application_name"])
    if mode == "none":
        # The URL's -c settings and idemctl's own, as startup parameters
        # (what libpq's options carry), the marker last.
        server.update(settings.settings)
        server[MARKER_SETTING] = "on"
    out["server_settings"] = server
    return out


def _end_without_the_loop(conn: asyncpg.Connection) -> None:
    """End `conn`'s server session with its event loop gone: asyncpg's
    terminate() needs the loop, so the socket is shut down first (the
    server sees the client leave at once)."""
    transport = getattr(conn, "_transport", None)
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(Exception):
        conn.terminate()


# What asyncpg raises, outside the server's own errors, when there is no
# usable connection.
_CONNECTION_LOST = (OSError, TimeoutError, asyncpg.InterfaceError, asyncpg.exceptions.TargetServerAttributeNotMatched)


class _Pool:
    """At most `size` connections on one loop: the idle ones in a list, the
    callers waiting for one in a queue of futures."""

    def __init__(self, connect: Callable[[], Awaitable[asyncpg.Connection]], size: int) -> None:
        self._connect = connect
        self._size = size
        self._count = 0
        self._idle: list[asyncpg.Connection] = []
        self._waiting: deque[asyncio.Future[asyncpg.Connection | None]] = deque()
        # Every connection made, in use or idle: `abandon` ends them all
        # once their loop is gone.
        self._made: weakref.WeakSet[asyncpg.Connection] = weakref.WeakSet()
        self.closed = False

    def take(self) -> asyncpg.Connection | None:
        """An idle connection, or None: the request path's checkout, without
        a coroutine of its own."""
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.is_closed():
                return conn
            self._count -= 1  # the server closed it while idle
            self._hand_on()
        return None

    async def get(self, timeout_s: float) -> asyncpg.Connection:
        conn = self.take()
        if conn is not None:
            return conn
        if self._count >= self._size:
            fut: asyncio.Future[asyncpg.Connection | None] = asyncio.get_running_loop().create_future()
            self._waiting.append(fut)
            try:
                handed = await asyncio.wait_for(fut, timeout_s)
            except BaseException:
                if fut.done() and not fut.cancelled():
                    # Handed over as the wait ended: back to the pool.
                    late = fut.result()
                    if late is not None:
                        self.put(late)
                    else:
                        self._count -= 1
                        self._hand_on()
                raise
            if handed is not None:
                return handed
            # A connection closed and its place was handed on: connect in it.
        else:
            self._count += 1
        try:
            conn = await self._connect()
        except BaseException:
            self._count -= 1
            self._hand_on()
            raise
        self._made.add(conn)
        return conn

    def put(self, conn: asyncpg.Connection) -> None:
        if conn.is_closed() or self.closed:
            if not conn.is_closed():
                conn.terminate()
            self._count -= 1
            self._hand_on()
            return
        waiting = self._waiting
        while waiting:
            fut = waiting.popleft()
            if not fut.done():
                fut.set_result(conn)
                return
        self._idle.append(conn)

    def _hand_on(self) -> None:
        # A place came free: the first caller still waiting connects in it.
        while self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():
                self._count += 1
                fut.set_result(None)
                return

    async def close(self) -> None:
        self.closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), CANCEL_GRACE_S)
            if not conn.is_closed():
                conn.terminate()

    def abandon(self) -> None:
        self.closed = True
        # Held here first: the idle list was the last reference to some.
        made = list(self._made)
        self._idle = []
        for conn in made:
            _end_without_the_loop(conn)


class AsyncpgEngine(LoopEngine):
    """The request path of a PostgresEngine on one event loop, on asyncpg
    (see the module's docstring). Nothing connects until the first
    statement; `aclose` closes the connections."""

    # Its statements are marked on the wire and bounded by the deadlines
    # watcher alone: a write is awaited in the request's task (landing.py).
    lands_in_place = True

    def _start(self) -> None:
        self._grace_s = min(CANCEL_GRACE_S, self._commit_timeout_s)
        # The commit timeout of every statement on this loop, kept by one
        # watcher: asyncpg's own `timeout=` is a timer (a heap entry) per statement.
        self._deadlines = Deadlines()
        self._pool: _Pool | None = None
        self._opening: asyncio.Lock | None = None
        # Behind transaction or statement pooling: psycopg's engine serves.
        self._psycopg: AsyncPostgresEngine | None = None
        self._texts: dict[str, tuple[str, tuple[str, ...]]] = {}
        # As AsyncPostgresEngine._options_lost: a new direct connection came
        # without its startup options (a pooler now stands in between).
        self._options_lost = False
        self._closed = False

    # -- connections -------------------------------------------------------------------
    async def _open(self) -> _Pool | None:
        if self._closed:
            raise StorageError(f"the ledger at {self.describe()} is closed")
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._pool is None and self._psycopg is None:
                mode = await within_acquire(adetect(self._settings, self._translate), self._acquire_s, self.describe())
                self.pooler = mode
                arguments = connect_arguments(self._settings, mode)
                if arguments is None or mode not in ("none", "session"):
                    self._psycopg = AsyncPostgresEngine(self._settings, self._translate, mode)
                else:
                    self._pool = _Pool(self._connector(mode, arguments), self._translate.pool_max_size)
            return self._pool

    def _connector(self, mode: str, arguments: dict[str, Any]) -> Callable[[], Awaitable[asyncpg.Connection]]:
        session = settings_sql(self._settings.settings or (), local=False) if mode == "session" else ""
        where = self.describe()

        async def connect() -> asyncpg.Connection:
            try:
                conn = await asyncio.wait_for(asyncpg.connect(**arguments), self._acquire_s)
            except TimeoutError:
                raise unreachable("PostgreSQL", where, f"no connection within {self._acquire_s:g} s") from None
            except Exception as exc:
                raise self._error(exc, connecting=True) from exc
            try:
                if mode == "none":
                    if not honoured(await conn.fetchval(pooling.MARKER_QUERY)):
                        # The next statement detects what the URL leads to now.
                        self._options_lost = True
                        raise options_lost(where)
                elif session:
                    await conn.execute(session)
            except BaseException as exc:
                conn.terminate()
                if isinstance(exc, Exception) and not isinstance(exc, StorageError):
                    raise self._error(exc, connecting=True) from exc
                raise
            return conn

        return connect

    def _error(self, exc: BaseException, *, connecting: bool = False, lost: bool = False) -> StorageError:
        """What asyncpg raised as the error the psycopg engine gives for it;
        `lost`: the statement's connection is closed now. A client-side error
        on it is the connection failing, not the statement: an idle one the
        server had just ended (its farewell read, the close not yet seen)
        makes asyncpg refuse the statement as "another operation is in
        progress", and a completion must then be tried again on a fresh one."""
        if isinstance(exc, StorageError):
            return exc
        if isinstance(exc, asyncpg.PostgresError):
            state = exc.sqlstate
            if state == "22021" and "0x00" in str(exc):
                return StorageError(f"PostgreSQL cannot store a NUL character in a text column ({exc})")
            return self._translate(exc, connecting=connecting or (state or "").startswith("08"))
        reason = self._translate.scrub(single_line(str(exc) or type(exc).__name__))
        if not (lost or isinstance(exc, _CONNECTION_LOST)):
            return server.database_error(self.describe(), reason)
        # The socket, not the server, failed: a refused or lost connection
        # (OSError, asyncpg's "connection is closed"), no answer, or no
        # host of the URL that takes writes.
        if isinstance(exc, OSError) and exc.errno:
            # As libpq words it ("Connection refused"), not the socket call that failed.
            reason = os.strerror(exc.errno)
        return unreachable("PostgreSQL", self.describe(), reason)

    async def _checkout(self) -> tuple[_Pool, asyncpg.Connection]:
        pool = self._pool
        if pool is None:
            pool = await self._open()
            if pool is None:
                raise _Delegated
        try:
            return pool, await pool.get(self._acquire_s)
        except StorageError:
            if self._options_lost and self._pool is pool:
                self._pool, self._options_lost = None, False
                pool.abandon()
            raise
        except TimeoutError:
            raise LedgerUnavailableError(
                f"no connection to {self.describe()} within {self._acquire_s:g} s: "
                f"the server is unreachable or all {self._translate.pool_max_size} pooled connections are busy"
            ) from None

    def _positional(self, sql: str) -> tuple[str, tuple[str, ...]]:
        found = self._texts.get(sql)
        if found is None:
            found = self._texts[sql] = positional(sql)
        return found

    async def _fetch(self, conn: asyncpg.Connection, sql: str, params: Params) -> Rows:
        text, names = self._positional(sql)
        deadlines = self._deadlines
        bound = deadlines.enter(self._commit_timeout_s)  # Deadlines.within, inlined
        ON_THE_WIRE.set(True)
        try:
            records = await conn.fetch(text, *[params[n] for n in names])
        except asyncio.CancelledError:
            if bound is None or not deadlines.expired(bound):
                raise
            # Cancelled at its bound, asyncpg sent a cancel request; whatever the
            # statement did, it counts as failed, and its connection is not used again.
            # Its outcome is settled now: off the wire, so that the wait for the
            # cancel request (asyncpg's own timer) is not taken for the request's
            # cancellation (landing.py).
            ON_THE_WIRE.set(False)
            deadlines.leave(bound)
            await self._retire(conn)
            raise CommitTimeoutError(self.describe(), self._commit_timeout_s) from None
        except Exception as exc:
            raise self._error(exc, lost=conn.is_closed()) from exc
        finally:
            ON_THE_WIRE.set(False)
            if bound is not None:
                deadlines.leave(bound)
        return [tuple(r) for r in records]

    async def _retire(self, conn: asyncpg.Connection) -> None:
        # Once the cancel request is over (asyncpg's own wait, bounded by the
        # grace): a late cancel must not reach a next statement.
        protocol = getattr(conn, "_protocol", None)
        try:
            with contextlib.suppress(Exception):
                if protocol is not None and protocol._is_cancelling():
                    await protocol._wait_for_cancellation(self._grace_s)
        finally:  # the request cancelled meanwhile: closed all the same
            conn.terminate()

    # -- statements --------------------------------------------------------------------
    async def execute(self, sql: str, params: Params) -> Rows:
        """One auto-committed statement (read or write); its rows."""
        pool = self._pool
        conn = pool.take() if pool is not None else None
        if pool is None or conn is None:
            try:
                pool, conn = await self._checkout()
            except _Delegated:
                return await self._delegate().execute(sql, params)
        try:
            return await self._fetch(conn, sql, params)
        finally:
            pool.put(conn)

    async def write_turn(self, statements: Sequence[tuple[str, Params]]) -> list[Rows]:
        try:
            pool, conn = await self._checkout()
        except _Delegated:
            return await self._delegate().write_turn(statements)
        try:
            return [await self._fetch(conn, sql, params) for sql, params in statements]
        finally:
            pool.put(conn)

    def _delegate(self) -> AsyncPostgresEngine:
        assert self._psycopg is not None
        return self._psycopg

    async def table_names(self, names: Iterable[str]) -> set[str]:
        return existing_tables(await self.execute(EXISTING, {"names": list(names)}))

    async def aclose(self) -> None:
        self._closed = True
        pool, self._pool = self._pool, None
        other, self._psycopg = self._psycopg, None
        if pool is not None:
            await pool.close()
        if other is not None:
            await other.aclose()

    def abandon(self) -> None:
        """Close the sockets of connections whose event loop is gone."""
        self._closed = True
        pool, self._pool = self._pool, None
        other, self._psycopg = self._psycopg, None
        if pool is not None:
            pool.abandon()
        if other is not None:
            other.abandon()


class _Delegated(Exception):
    """The URL leads to a transaction or statement pooler: psycopg serves."""
