"""MariaDB / MySQL engine: a per-process connection pool and the server's errors.

Each request-path step is a single auto-committed statement on InnoDB, so
its atomicity is the row locks of one statement: a concurrent writer of the
same row is waited for, and the WHERE clause is evaluated against the row
version that writer committed (an UPDATE or DELETE always reads the latest
committed version of the rows it locks).

Every connection is set up the same way (`_SESSION`):

* READ COMMITTED, not InnoDB's default REPEATABLE READ: every step is one
  statement, so a snapshot across statements buys nothing, and REPEATABLE
  READ takes gap locks: a sweep's DELETE over the oldest rows would lock the
  gap at the end of the updated_at index where every new claim inserts.
  READ COMMITTED keeps only the gap locks of duplicate-key checks (inside a
  claim of an existing key, for the statement's few microseconds).
* A deadlock (1213) rolls back the one statement it picked, which then did
  nothing: that statement runs again, up to DEADLOCK_TRIES times.
* A lost connection (2006, 2013, a KILL) is not retried here: the statement
  may have committed before the answer was lost. It fails as
  ConnectionFailedError (a 503 from the adapters), as on the other engines;
  the ledger stores a completion again on a fresh connection, because the
  fenced completion can tell its own committed try from a takeover
  (ledger/steps.py).
* innodb_lock_wait_timeout and lock_wait_timeout (metadata locks, whose
  default is a year) are the busy timeout in whole seconds, at least 1.
* sql_mode STRICT_ALL_TABLES: a value a column cannot hold is an error,
  never a silent truncation; time_zone UTC; character set utf8mb4.
* On a Galera node (wsrep_on), causal reads: wsrep_sync_wait gains bits 1
  and 2, so a read or fenced UPDATE sees every commit the cluster
  acknowledged before it, whichever node took it (_set_sync_wait).

Connections come from a small pool that belongs to one process: after a
fork the child opens its own and never touches the parent's sockets."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import pymysql
import pymysql.cursors

from ..errors import (
    DatabaseLockedError,
    LedgerUnavailableError,
    SchemaOutdatedError,
    StorageError,
)
from ..policy import DEFAULT_BUSY_TIMEOUT_MS
from ..text import single_line
from . import server
from .capabilities import DatabaseCreated
from .dialect import MYSQL
from .engine import Params, Rows
from .failover.mysql import MysqlFacts
from .mysql_admin import create_database, read_failover_facts
from .mysql_schema import MysqlTx, existing_tables
from .server import checked_busy_timeout, missing_table, number_option, scrub

log = logging.getLogger("idemctl")
T = TypeVar("T")

DEFAULT_PORT = 3306
DEFAULT_POOL_MAX_SIZE = 10
DEFAULT_CONNECT_TIMEOUT_S = 5
# How a malformed URL's messages begin (they never show the password).
_BAD_URL = "bad MySQL URL"
# A deadlock victim's statement did nothing; these many runs in all.
DEADLOCK_TRIES = 5
# A connection idle this long is pinged before use: the server may have
# closed it (wait_timeout, a restart) and the first statement would fail.
IDLE_PING_S = 30.0
# An init waits this long at least for another init to finish.
INIT_LOCK_WAIT_S = 30

# URL query parameters idemctl reads; anything else is refused.
URL_PARAMS = (
    "pool_max_size",
    "pool_timeout",
    "connect_timeout",
    "unix_socket",
    "ssl_ca",
    "ssl_cert",
    "ssl_key",
    "ssl_verify_identity",
    "wsrep_sync_wait",
)
# Galera: the wsrep_sync_wait bits idemctl sets on each connection to a node
# of a cluster, ORed with the server's own: 1, a SELECT waits until the node
# has applied every write the cluster committed before it (a replay on
# another node reads the completion, not the claim it replaced); 2, an
# UPDATE or DELETE does too (a completion, release or takeover sent through
# a load balancer to another node than its claim finds the claim's row).
GALERA_SYNC_WAIT = 3

_LOCKED = {1205}  # lock wait timeout
_DEADLOCK = 1213
_TIMED_OUT = {1969, 3024}  # max_statement_time (MariaDB), max_execution_time (MySQL)
_READ_ONLY = {1792, 1290, 1836}
# The connection is gone or was never made: server away, killed, shut down,
# too many connections, unknown host, handshake failures.
_GONE = {1040, 1053, 1077, 1152, 1153, 1154, 1156, 1158, 1159, 1160, 1161, 1927, 2002, 2003, 2005}
_GONE |= {2006, 2013, 2014, 2026, 2055, 4031}
_ACCESS_DENIED = {1044, 1045, 1698}
_NO_PRIVILEGE = {1142, 1143, 1227, 1370}
# A Galera node outside a Primary component (or still joining) refuses
# every statement with ER_UNKNOWN_COM_ERROR: "WSREP has not yet prepared
# node for application use".
_WSREP_NOT_READY = 1047

# The SQL bits that are the engine's own (connections, locks, catalog), not the ledger's.
_SESSION = (
    "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",
    "SET SESSION innodb_lock_wait_timeout = {seconds}, lock_wait_timeout = {seconds},"
    " time_zone = '+00:00', sql_mode = 'STRICT_ALL_TABLES,NO_ENGINE_SUBSTITUTION'",
)
_READ_ONLY_SESSION = "SET SESSION TRANSACTION READ ONLY"
# One round trip for what a new connection must know; `wsrep_on` is absent
# on MySQL and OFF on a MariaDB server that is not a Galera node.
_SERVER_FACTS = "SHOW SESSION VARIABLES WHERE Variable_name IN ('max_allowed_packet', 'wsrep_on', 'wsrep_sync_wait')"
_SYNC_WAIT = "SET SESSION wsrep_sync_wait = %s"
_STORAGE_BYTES = (
    "SELECT coalesce(sum(data_length + index_length), 0) FROM information_schema.tables"
    " WHERE table_schema = DATABASE() AND table_name IN ({names})"
)
# Server-wide advisory lock, one per database: inits serialise on it (DDL
# commits implicitly here, so no transaction can hold them apart).
_INIT_LOCK = "SELECT GET_LOCK(CONCAT('idemctl:init:', SHA1(DATABASE())), %s)"
_INIT_UNLOCK = "DO RELEASE_LOCK(CONCAT('idemctl:init:', SHA1(DATABASE())))"


def _code(exc: BaseException) -> int | None:
    args: tuple[Any, ...] = getattr(exc, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def _message(exc: BaseException) -> str:
    args: tuple[Any, ...] = getattr(exc, "args", ())
    if len(args) >= 2 and isinstance(args[1], str):
        return args[1]
    return str(exc) or type(exc).__name__


class _Pooled:
    """A connection and the moment it was last handed back."""

    __slots__ = ("conn", "idle_since", "max_packet")

    def __init__(self, conn: pymysql.connections.Connection[Any], max_packet: int) -> None:
        self.conn = conn
        self.max_packet = max_packet
        self.idle_since = time.monotonic()


class MysqlEngine:
    """A ledger in a MariaDB or MySQL database, shared by any number of
    threads, processes and hosts.

    ``mysql://user:password@host:3306/database`` (or ``mariadb://``). Query
    parameters: ``pool_max_size`` (default 10), ``pool_timeout`` (seconds to
    wait for a free connection; default the busy timeout),
    ``connect_timeout`` (default 5 s), ``unix_socket``, ``ssl_ca``,
    ``ssl_cert``, ``ssl_key``, ``ssl_verify_identity``, ``wsrep_sync_wait``
    (Galera: the causal-read bits for every connection, in place of the
    server's value ORed with GALERA_SYNC_WAIT that idemctl sets on a node).

    Nothing connects until the first statement.

    >>> MysqlEngine("mysql://app:secret@db:3306/payments?pool_max_size=20").describe()
    'mysql://app@db:3306/payments'
    """

    dialect = MYSQL

    def __init__(self, url: str, *, readonly: bool = False, busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS) -> None:
        self.readonly = readonly
        self.busy_timeout_ms = checked_busy_timeout(busy_timeout_ms)
        self._scheme = url.split("://", 1)[0]
        self._secrets: list[str] = []
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise StorageError(f"bad MySQL URL: {self._scrub_raw(url, str(exc))}") from None
        if parts.password:
            self._secrets = [s for s in {parts.password, unquote(parts.password)} if s]
        self.user = unquote(parts.username or "")
        self.host = unquote(parts.hostname or "")
        self.port = port or DEFAULT_PORT
        self.database = unquote(parts.path.lstrip("/"))
        if not self.database or "/" in self.database:
            raise StorageError("bad MySQL URL: name one database, as in mysql://user@host:3306/ledger")
        params: dict[str, str] = {}
        for name, value in parse_qsl(parts.query, keep_blank_values=True):
            if name not in URL_PARAMS:
                raise StorageError(f"bad MySQL URL: unknown parameter {name!r} (known: {', '.join(URL_PARAMS)})")
            params[name] = value
        if not self.host and "unix_socket" not in params:
            self.host = "127.0.0.1"
        self.pool_max_size = number_option(params, "pool_max_size", DEFAULT_POOL_MAX_SIZE, int, 1, _BAD_URL)
        default_wait = max(self.busy_timeout_ms / 1000, 0.1)
        self.pool_timeout_s = number_option(params, "pool_timeout", default_wait, float, 0.001, _BAD_URL)
        self.connect_timeout_s = number_option(params, "connect_timeout", DEFAULT_CONNECT_TIMEOUT_S, int, 1, _BAD_URL)
        self.lock_wait_s = max(1, math.ceil(self.busy_timeout_ms / 1000))
        forced = number_option(params, "wsrep_sync_wait", None, int, 0, _BAD_URL)
        if forced is not None and forced > 15:
            raise StorageError(f"bad MySQL URL: wsrep_sync_wait is a bitmask from 0 to 15, got {forced}")
        self.forced_sync_wait: int | None = forced
        # What the last new connection found: whether the server is a Galera
        # node, and the wsrep_sync_wait in force on its session (None: not Galera).
        self.galera: bool | None = None
        self.sync_wait: int | None = None
        self._connect_kwargs: dict[str, Any] = {
            "user": self.user,
            "password": unquote(parts.password or ""),
            "database": self.database,
            "charset": "utf8mb4",
            "autocommit": True,
            "connect_timeout": self.connect_timeout_s,
        }
        if "unix_socket" in params:
            self._connect_kwargs["unix_socket"] = params["unix_socket"]
        else:
            self._connect_kwargs.update(host=self.host, port=self.port)
        ssl = {k: params[k] for k in ("ssl_ca", "ssl_cert", "ssl_key") if params.get(k)}
        if ssl:
            self._connect_kwargs.update(ssl)
        if params.get("ssl_verify_identity", "").lower() in ("1", "true", "yes"):
            self._connect_kwargs["ssl_verify_identity"] = True
        self._lock = threading.Lock()
        self._idle: deque[_Pooled] = deque()
        self._slots = threading.BoundedSemaphore(self.pool_max_size)
        self._pid = os.getpid()
        self._epoch = 0  # bumped by close(): connections handed out before are closed on return
        # Connections inherited across fork stay referenced and untouched:
        # closing one in the child would send COM_QUIT on the parent's socket.
        self._inherited: list[_Pooled] = []
        # Statements run again after losing a deadlock (for tests and curious operators).
        self.deadlock_retries = 0

    # -- describing without secrets -------------------------------------------------
    def describe(self) -> str:
        user = f"{quote(self.user, safe='')}@" if self.user else ""
        where = f"{self.host}:{self.port}" if "unix_socket" not in self._connect_kwargs else "localhost"
        return f"{self._scheme}://{user}{where}/{quote(self.database, safe='')}"

    def _scrub(self, text: str) -> str:
        return scrub(text, self._secrets)

    @staticmethod
    def _scrub_raw(url: str, text: str) -> str:
        with contextlib.suppress(ValueError):
            password = urlsplit(url).password
            if password:
                text = text.replace(password, "***")
        return single_line(text)

    # -- connections ---------------------------------------------------------------
    def _connect(self) -> _Pooled:
        try:
            conn = pymysql.connect(**self._connect_kwargs)
        except pymysql.MySQLError as exc:
            raise self._translate(exc, connecting=True) from exc
        try:
            with conn.cursor() as cur:
                for statement in _SESSION:
                    cur.execute(statement.format(seconds=self.lock_wait_s))
                if self.readonly:
                    cur.execute(_READ_ONLY_SESSION)
                cur.execute(_SERVER_FACTS)
                facts = {str(name).lower(): str(value) for name, value in cur.fetchall()}
                self._set_sync_wait(cur, facts)
        except pymysql.MySQLError as exc:
            conn.close()
            raise self._translate(exc) from exc
        except BaseException:
            conn.close()
            raise
        return _Pooled(conn, int(facts.get("max_allowed_packet", 0)))

    def _set_sync_wait(self, cur: Any, facts: dict[str, str]) -> None:
        """Causal reads on a Galera node: a node applies the others' commits
        a little after they were acknowledged, so without them a retry on
        another node can read the claim a completion already replaced and
        answer 409 in progress. A server that is not a Galera node pays
        nothing (not even a statement) unless the URL forces a value."""
        galera = facts.get("wsrep_on", "OFF").upper() == "ON"
        self.galera = galera
        if self.forced_sync_wait is not None:
            if "wsrep_sync_wait" not in facts:
                raise StorageError(
                    f"bad MySQL URL for {self.describe()}: wsrep_sync_wait is a MariaDB Galera setting "
                    "and this server has no such variable"
                )
            wanted = self.forced_sync_wait
        elif galera:
            wanted = int(facts.get("wsrep_sync_wait", "0") or 0) | GALERA_SYNC_WAIT
        else:
            self.sync_wait = None
            return
        if wanted != int(facts.get("wsrep_sync_wait", "0") or 0):
            cur.execute(_SYNC_WAIT, (wanted,))
        self.sync_wait = wanted if galera else None

    def _fork_check(self) -> None:
        pid = os.getpid()
        if self._pid != pid:
            with self._lock:
                if self._pid != pid:
                    # First use after a fork: leave the parent's connections alone.
                    self._inherited.extend(self._idle)
                    self._idle = deque()
                    self._slots = threading.BoundedSemaphore(self.pool_max_size)
                    self._pid = pid

    def _acquire(self) -> tuple[_Pooled, int]:
        self._fork_check()
        if not self._slots.acquire(timeout=self.pool_timeout_s):
            raise LedgerUnavailableError(
                f"no connection to {self.describe()} within {self.pool_timeout_s:g} s: "
                f"all {self.pool_max_size} pooled connections are busy"
            )
        try:
            while True:
                with self._lock:
                    pooled = self._idle.pop() if self._idle else None
                    epoch = self._epoch
                if pooled is None:
                    return self._connect(), epoch
                if time.monotonic() - pooled.idle_since < IDLE_PING_S or self._alive(pooled):
                    return pooled, epoch
                self._discard(pooled)
        except BaseException:
            self._slots.release()
            raise

    def _release(self, pooled: _Pooled, epoch: int, *, broken: bool = False) -> None:
        try:
            with self._lock:
                keep = not broken and epoch == self._epoch and self._pid == os.getpid()
                if keep:
                    pooled.idle_since = time.monotonic()
                    self._idle.append(pooled)
            if not keep:
                self._discard(pooled)
        finally:
            self._slots.release()

    @staticmethod
    def _alive(pooled: _Pooled) -> bool:
        try:
            pooled.conn.ping(reconnect=False)
            return True
        except Exception:
            return False

    @staticmethod
    def _discard(pooled: _Pooled) -> None:
        with contextlib.suppress(Exception):
            pooled.conn.close()

    def _drop_dead_idle(self) -> None:
        """The server closed a connection under us. A restart or failover
        closes every connection at once, and each idle one would fail one
        more request: ping them now (a round trip each) and drop the dead."""
        with self._lock:
            idle, self._idle = list(self._idle), deque()
        alive = [p for p in idle if self._alive(p)]
        for pooled in idle:
            if pooled not in alive:
                self._discard(pooled)
        with self._lock:
            self._idle.extendleft(reversed(alive))

    @contextlib.contextmanager
    def _connection(self) -> Iterator[_Pooled]:
        pooled, epoch = self._acquire()
        broken = False
        try:
            yield pooled
        except pymysql.MySQLError as exc:
            broken = self._is_gone(exc)
            raise self._translate(exc) from exc
        except StorageError:
            raise
        except BaseException:
            # Interrupted mid-statement: the protocol state is unknown.
            broken = True
            raise
        finally:
            self._release(pooled, epoch, broken=broken)
            if broken:
                self._drop_dead_idle()

    def close(self) -> None:
        # As on the other engines, a closed ledger that is used again reconnects.
        with self._lock:
            mine = self._pid == os.getpid()
            idle, self._idle = list(self._idle), deque()
            self._epoch += 1
        if mine:
            for pooled in idle:
                self._discard(pooled)

    # -- errors ----------------------------------------------------------------------
    @staticmethod
    def _is_gone(exc: BaseException) -> bool:
        return isinstance(exc, pymysql.err.InterfaceError) or _code(exc) in _GONE

    def _translate(self, exc: BaseException, *, connecting: bool = False) -> StorageError:
        where = self.describe()
        code = _code(exc)
        msg = self._scrub(single_line(_message(exc)))
        if code in _LOCKED:
            return DatabaseLockedError(
                f"{where} is locked: another session held the row past the lock wait timeout "
                f"({self.lock_wait_s} s, the busy timeout in whole seconds): {msg}"
            )
        if code == _DEADLOCK:
            return DatabaseLockedError(
                f"{where} is busy: this statement lost a deadlock {DEADLOCK_TRIES} times in a row: {msg}"
            )
        if code in _TIMED_OUT:
            return DatabaseLockedError(f"a statement on {where} ran past the server's statement time limit: {msg}")
        if code in _READ_ONLY:
            return server.read_only(where, msg)
        if code == _WSREP_NOT_READY:
            return server.unreachable(
                "MySQL", where, f"this Galera node is not in a Primary component or not synced yet: {msg}"
            )
        missing = missing_table(where, msg) if code == 1146 else None
        if missing is not None:
            return missing
        if code == 1054 and ("'token'" in msg or "'key_id'" in msg):
            return SchemaOutdatedError(where)
        if code == 1049:
            return server.no_such_database(where, msg)
        if code in _ACCESS_DENIED:
            return server.login_refused("MySQL", where, msg)
        if code in _NO_PRIVILEGE:
            return server.permission_denied(where, msg)
        if code == 1153:
            return StorageError(
                f"a statement to {where} was larger than the server's max_allowed_packet: {msg} "
                "(raise max_allowed_packet above twice the policy's body cap)"
            )
        if connecting or self._is_gone(exc):
            return server.unreachable("MySQL", where, msg)
        return server.database_error(where, msg)

    # -- statements --------------------------------------------------------------------
    def read(self, sql: str, params: Params) -> Rows:
        with self._connection() as pooled:
            return self._execute(pooled, sql, params)

    def write(self, sql: str, params: Params) -> Rows:
        with self._connection() as pooled:
            return self._execute(pooled, sql, params)

    def write_turn(self, statements: Sequence[tuple[str, Params]]) -> list[Rows]:
        with self._connection() as pooled:
            return [self._execute(pooled, sql, params) for sql, params in statements]

    def _execute(self, pooled: _Pooled, sql: str, params: Params) -> Rows:
        """One auto-committed statement: its rows, or for a statement with
        no result set one row (LAST_INSERT_ID(),) per affected row (the
        store's forms for engines without RETURNING read their answer so)."""
        with pooled.conn.cursor() as cur:
            query = cur.mogrify(sql, params)
            self._check_packet(pooled, query)
            for attempt in range(1, DEADLOCK_TRIES + 1):
                try:
                    affected = cur.execute(query)
                    break
                except pymysql.MySQLError as exc:
                    if _code(exc) == _DEADLOCK and attempt < DEADLOCK_TRIES:
                        # The victim's statement was rolled back whole: run it again.
                        self.deadlock_retries += 1
                        log.info("deadlock on %s, running the statement again (try %d)", self.describe(), attempt + 1)
                        time.sleep(random.uniform(0, 0.002 * attempt))
                        continue
                    raise
            if cur.description is not None:
                return list(cur.fetchall())
            return [(cur.lastrowid,)] * affected

    def _check_packet(self, pooled: _Pooled, query: str) -> None:
        # The server would refuse a larger statement and close the connection
        # (error 1153): refuse it here instead, saying which limit to raise.
        limit = pooled.max_packet
        if limit and len(query) * 4 > limit:
            size = len(query.encode("utf-8", "surrogateescape"))
            if size > limit:
                raise StorageError(
                    f"a statement of {size} bytes does not fit the max_allowed_packet of {self.describe()} "
                    f"({limit} bytes): raise max_allowed_packet above twice the policy's body cap, "
                    "or lower the cap"
                )

    def stream(self, sql: str, params: Params) -> Iterator[tuple[Any, ...]]:
        # An unbuffered cursor: a million rows never sit in memory at once.
        # Under READ COMMITTED the SELECT is a consistent read holding no locks.
        # A consumer that stops early leaves rows unread on the wire: the
        # connection is then dropped rather than drained.
        with self._connection() as pooled:
            cur = pooled.conn.cursor(pymysql.cursors.SSCursor)
            cur.execute(sql, params)
            try:
                yield from cur
            except GeneratorExit:
                # Stopped early: the connection is closed with its rows unread,
                # so the cursor must not try to read them when collected.
                result = getattr(cur, "_result", None)
                if result is not None:
                    result.unbuffered_active = False
                cur._result = None
                raise
            cur.close()

    def table_names(self, names: Iterable[str]) -> set[str]:
        with self._connection() as pooled:
            return existing_tables(pooled.conn, list(names))

    def storage_bytes(self, tables: Iterable[str]) -> int | None:
        """Data and index size of the ledger's tables (information_schema)."""
        wanted = list(tables)
        sql = _STORAGE_BYTES.format(names=", ".join(["%s"] * len(wanted)))
        with self._connection() as pooled, pooled.conn.cursor() as cur:
            cur.execute(sql, wanted)
            row = cur.fetchone()
        return int(row[0]) if row else None

    def failover_facts(self) -> MysqlFacts:
        """What `idemctl doctor` assesses, as the ledger's own session reads it (mysql_admin.py)."""
        with self._connection() as pooled, pooled.conn.cursor() as cur:
            return read_failover_facts(cur)

    def create_database(self) -> DatabaseCreated:
        """Create the URL's database as its user; one who may not gets the
        statements an administrator runs instead (mysql_admin.py)."""
        return create_database(self._connect_kwargs, self.describe(), self._scrub)

    # -- schema ------------------------------------------------------------------------
    def migrate(self, body: Callable[[MysqlTx], T], *, write: bool) -> T:
        # DDL commits implicitly on these servers: no transaction can hold
        # two inits apart, so they take turns on an advisory lock, and the
        # DDL is all IF NOT EXISTS (a failed init leaves nothing half-done
        # that the next one trips over). `write` needs nothing more: the
        # store's body writes nothing when it is False.
        wait = max(self.lock_wait_s, INIT_LOCK_WAIT_S)
        with self._connection() as pooled:
            with pooled.conn.cursor() as cur:
                cur.execute(_INIT_LOCK, (wait,))
                got = cur.fetchone()
            if not got or got[0] != 1:
                raise DatabaseLockedError(f"{self.describe()}: another init held the schema lock for {wait} s")
            try:
                return body(MysqlTx(self, pooled))
            finally:
                # On a lost connection the server has released the lock already.
                with contextlib.suppress(pymysql.MySQLError), pooled.conn.cursor() as cur:
                    cur.execute(_INIT_UNLOCK)
