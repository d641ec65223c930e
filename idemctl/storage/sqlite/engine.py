"""The SQLite engine: statements on one ledger file.

Request-path statements run on auto-commit connections (isolation_level=None):
each is its own transaction, and RETURNING rows are fetched in full before the
statement is finished, so nothing is left holding the write lock. The
connections are connections.py's (per thread, per process, fork-safe), writes
take their turn in writer_queue.py's queue, and group_commit.py may share one
commit among threads."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import sqlite_utils

from ...errors import LedgerNotFoundError, NotADatabaseError, SchemaMissingError, StorageError
from ...policy import DEFAULT_BUSY_TIMEOUT_MS
from ..dialect import SQLITE
from ..engine import Params, Rows, SchemaTx
from .connections import Connections
from .errors import translate
from .files import companion_mode, create_ledger_file, nobody_writes_it
from .group_commit import GroupCommit, write_together
from .options import SQLITE_DEFAULTS, SqliteOptions
from .schema import AbsentTx, SqliteTx, admin_view
from .writer_queue import WriterQueue, queue_path

T = TypeVar("T")

# A D1 database's local file (wrangler dev, miniflare) has this table: the
# recipe's Worker reads the same ledger, and a BLOB reaches it as an array of
# numbers it cannot replay, so such a file stores text answers only.
_D1_FILE = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = '_cf_METADATA'"
SQLITE_SHARED_WITH_WORKERS = replace(SQLITE, binary_bodies=False)


class SqliteEngine:
    """One SQLite ledger file, shared safely by threads and processes.

    `options` are the file's own settings (SqliteOptions).

    Writer queue (``write_queue=True``, the default on POSIX): every write
    statement first takes an exclusive ``flock`` on ``<db>-idemctl.lock``
    and waits for it in the kernel, so writers of every process take turns
    (writer_queue.py). ``write_queue=False`` opts out, and any failure to
    open the lock file falls back to SQLite alone.

    Group commit (``group_commit=True``, off by default): write statements
    that threads of this process issue at the same time are committed
    together, in one transaction and so one fsync of the WAL
    (group_commit.py). Memory databases have no fsync to share and never
    batch.

    Opening never creates a file: the ledger file (owner-only by default,
    ``file_mode``) appears when the schema is first created.

    >>> engine = SqliteEngine(":memory:")
    >>> engine.read("SELECT 1 + 1", {})
    [(2,)]
    """

    dialect = SQLITE

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        readonly: bool = False,
        busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
        options: SqliteOptions = SQLITE_DEFAULTS,
    ) -> None:
        options.check()
        self.options = options
        self.busy_timeout_ms = int(busy_timeout_ms)
        self.synchronous = options.synchronous.upper()
        self.readonly = readonly
        self.file_mode = options.file_mode
        raw = os.fspath(path)
        self.memory = raw == ":memory:"
        if self.memory:
            # Tests and examples: a shared-cache memory database so every thread sees one ledger.
            self.path = raw
            self._uri = f"file:idemctl-mem-{id(self)}?mode=memory&cache=shared"
        else:
            if not raw:
                raise LedgerNotFoundError("", "no ledger path given")
            p = Path(raw).expanduser()
            self.path = str(p)
            if p.is_dir():
                raise NotADatabaseError(f"{p} is a directory, not a ledger file")
            if not p.exists():
                if readonly or not options.create:
                    raise LedgerNotFoundError(str(p))
                if not p.parent.is_dir():
                    raise LedgerNotFoundError(
                        str(p), f"cannot create a ledger at {p}: directory {p.parent} does not exist"
                    )
            self._uri = f"file:{quote(str(p.resolve()))}?mode={'ro' if readonly else 'rw'}"
        # Memory databases and read-only opens have no writers to queue.
        self._queue = WriterQueue(
            queue_path(self.path, options.write_queue and not self.memory and not readonly),
            self.busy_timeout_ms,
            lambda: companion_mode(self.path, self.file_mode),
        )
        self.write_queue_path = self._queue.path
        self.group_commit = bool(options.group_commit) and not self.memory and not readonly
        self._group = GroupCommit(self.path, lambda: self._connections.lock, self._write_alone, self.write_batch)
        self._connections = Connections(
            self.path, self._connect, self.busy_timeout_ms, memory=self.memory, companion=self._group
        )
        self._keepalive: sqlite3.Connection | None = None
        if self.memory:
            self._keepalive = self._conn()
        elif self.exists():
            gate = self._connections.gate
            gate.enter()
            try:
                conn = self._conn()  # a file that is not a database fails here, at open
                if conn.execute(_D1_FILE).fetchone() is not None:
                    self.dialect = SQLITE_SHARED_WITH_WORKERS
            except sqlite3.Error as exc:
                raise self._translate(exc) from exc
            finally:
                gate.leave()

    def exists(self) -> bool:
        return self.memory or os.path.exists(self.path)

    # -- connections ------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        if not self.exists():
            raise SchemaMissingError(self.path)
        try:
            return self._connect_to(self._uri)
        except StorageError:
            # A reader in a directory where SQLite cannot make the -shm file
            # that WAL mode needs: when nobody can be writing the ledger,
            # read the file as it is.
            if not (self.readonly and nobody_writes_it(self.path)):
                raise
            self._uri += "&immutable=1"
            return self._connect_to(self._uri)

    def _connect_to(self, uri: str) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(
                uri,
                uri=True,
                isolation_level=None,
                timeout=self.busy_timeout_ms / 1000,
                check_same_thread=False,
            )
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc
        try:
            conn.execute(f"PRAGMA synchronous={self.synchronous}")
            if not self.readonly and not self.memory:
                mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
                if mode.lower() != "wal":
                    conn.execute("PRAGMA journal_mode=WAL").fetchall()
        except sqlite3.Error as exc:
            conn.close()
            raise self._translate(exc) from exc
        return conn

    def _conn(self) -> sqlite3.Connection:
        return self._connections.slot().conn

    def _translate(self, exc: sqlite3.Error) -> StorageError:
        return translate(exc, self.path, self.busy_timeout_ms, self.memory)

    def close(self) -> None:
        self._connections.close()
        if self._keepalive is not None:
            self._keepalive = None  # a closed memory ledger is gone, as a file's rows would not be

    def describe(self) -> str:
        return self.path

    def admin(self) -> sqlite_utils.Database:
        """sqlite-utils view of this thread's connection, for introspection and admin."""
        return admin_view(self._conn())

    # -- statements ---------------------------------------------------------------
    def read(self, sql: str, params: Params) -> Rows:
        # fetchall() is what finishes (and so commits) a RETURNING statement on
        # an auto-commit connection; a half-read cursor would hold the lock.
        connections = self._connections
        gate = connections.gate
        gate.enter()
        try:
            return connections.slot().conn.execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc
        finally:
            gate.leave()

    # Writes go through the writer queue; reads never wait in it (WAL readers
    # do not block writers, nor writers readers). Plain try/except rather than
    # context managers: this runs twice per request.
    def write(self, sql: str, params: Params) -> Rows:
        if self.group_commit:
            return self._group.write(sql, params)
        return self._write_alone(sql, params)

    def _write_alone(self, sql: str, params: Params) -> Rows:
        """One auto-committed statement in the writer queue: a plain write."""
        return self._in_turn(lambda conn: conn.execute(sql, params).fetchall())

    def _in_turn(self, run: Callable[[sqlite3.Connection], T]) -> T:
        """`run` on this thread's connection, through the fork gate, in one
        turn of the writer queue; SQLite's errors as idemctl's."""
        connections = self._connections
        gate = connections.gate
        gate.enter()
        try:
            slot = connections.slot()
            queue = self._queue
            fd, shortened = queue.enter(slot)
            try:
                return run(slot.conn)
            finally:
                queue.leave(slot, fd, shortened)
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc
        finally:
            gate.leave()

    def write_batch(self, statements: Sequence[tuple[str, Params]]) -> list[Rows | Exception]:
        """Independent write statements committed together: one transaction,
        one turn of the writer queue, one fsync (group commit runs its
        batches so). Each statement's RETURNING rows, or the error it alone
        failed with: SQLite undoes a failing statement by itself and the
        others commit. When the transaction itself fails (it cannot begin,
        the disk is full) nothing is durable and every statement has that
        error.

        >>> engine = SqliteEngine(":memory:")
        >>> engine.write_batch([("SELECT 1", {}), ("SELECT x", {})])[0]
        [(1,)]
        """
        connections = self._connections
        gate = connections.gate
        gate.enter()
        try:
            slot = connections.slot()
            try:
                fd, shortened = self._queue.enter(slot)
                try:
                    outcomes = write_together(slot.conn, statements)
                finally:
                    self._queue.leave(slot, fd, shortened)
            except sqlite3.Error as exc:
                # Nothing is durable: every statement hears why, each in an error of its own.
                failed: list[Rows | Exception] = []
                for _ in statements:
                    error = self._translate(exc)
                    error.__cause__ = exc
                    failed.append(error)
                return failed
        finally:
            gate.leave()
        self._group.committed(sum(1 for o in outcomes if not isinstance(o, Exception)))
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, sqlite3.Error):
                error = outcomes[i] = self._translate(outcome)
                error.__cause__ = outcome
        return outcomes

    @property
    def batches_committed(self) -> int:
        """Commits made by group commit (or `write_batch`) in this process; a
        lone statement counts as one."""
        return self._group.batches

    @property
    def statements_committed(self) -> int:
        """Statements those commits made durable (failed statements not counted)."""
        return self._group.statements

    @property
    def statements_waiting(self) -> int:
        """Write statements of this process queued for group commit's next
        batch, behind the commit in progress (how far commits lag behind)."""
        return len(self._group.queue)

    def write_turn(self, statements: Sequence[tuple[str, Params]]) -> list[Rows]:
        # The sweep's DELETEs share one turn of the writer queue: each extra
        # turn is one more hand-over between processes.
        return self._in_turn(lambda conn: [conn.execute(sql, params).fetchall() for sql, params in statements])

    def stream(self, sql: str, params: Params) -> Iterator[tuple[Any, ...]]:
        # A private connection: a million rows never sit in memory at once,
        # and this thread's request-path connection stays free. It stays open
        # between rows, so a fork cannot wait for it: it is counted instead.
        connections = self._connections
        if connections.unusable is not None:
            raise StorageError(connections.unusable)
        connections.stream_opened()
        try:
            conn = self._connect()
            try:
                yield from conn.execute(sql, params)
            except sqlite3.Error as exc:
                raise self._translate(exc) from exc
            finally:
                conn.close()
        finally:
            connections.stream_closed()

    def table_names(self, names: Iterable[str]) -> set[str]:
        if not self.exists():
            return set()
        gate = self._connections.gate
        gate.enter()
        try:
            return set(names) & set(self.admin().table_names())
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc
        finally:
            gate.leave()

    def storage_bytes(self, tables: Iterable[str]) -> int | None:
        if self.memory:
            return None
        return sum(os.path.getsize(p) for p in (self.path, self.path + "-wal") if os.path.exists(p))

    # -- schema -------------------------------------------------------------------
    def migrate(self, body: Callable[[SchemaTx], T], *, write: bool) -> T:
        gate = self._connections.gate
        gate.enter()
        try:
            return self._migrate(body, write)
        finally:
            gate.leave()

    def _migrate(self, body: Callable[[SchemaTx], T], write: bool) -> T:
        if write and not self.readonly and not self.exists():
            create_ledger_file(self.path, self.file_mode)
        if not self.exists():
            return body(AbsentTx())
        conn = self._conn()
        try:
            # IMMEDIATE: two concurrent inits serialise instead of both
            # deciding from the same stale version.
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                result = body(SqliteTx(conn))
                conn.execute("COMMIT" if write else "ROLLBACK")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc
        if write:
            with contextlib.suppress(sqlite3.Error):
                # A file made by another tool may still be in rollback-journal mode.
                self.admin().enable_wal()
        return result
