"""SQLite storage: every statement idemctl runs against SQLite lives here.

Request-path statements run on auto-commit connections (isolation_level=None):
each is its own transaction, and RETURNING rows are fetched in full before the
statement is finished, so nothing is left holding the write lock.
Connections are per thread and per process: SQLite connections must not
cross threads, and must never be used on the far side of a fork."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Iterator
from urllib.parse import quote

import sqlite_utils

try:
    import fcntl
except ImportError:  # Windows: no flock; SQLite's own busy handler is all there is
    fcntl = None  # type: ignore[assignment]

from ..errors import (
    DatabaseLockedError,
    LedgerNotFoundError,
    NotADatabaseError,
    ReadOnlyDatabaseError,
    SchemaMissingError,
    SchemaTooNewError,
    StorageError,
)
from ..outcomes import (
    FencedEvent,
    InitAction,
    InitResult,
    PurgeResult,
    Stats,
    Status,
    StoredRow,
    SweepResult,
)
from ..schema import SCHEMA_VERSION, schema_files
from .steps import SqlSteps, event_from, stats_from

LEDGER_TABLE = "idempotency_keys"
FENCED_TABLE = "idemctl_fenced_out"
VERSION_TABLE = "idemctl_schema_version"

# The writer queue's lock file sits next to the ledger: `<db>-idemctl.lock`.
WRITE_QUEUE_SUFFIX = "-idemctl.lock"
_UNOPENED = object()  # a thread's queue descriptor before its first write

_ROW_COLUMNS = (
    "principal, key, fingerprint, status, generation, response_status, "
    "response_body, response_headers, created_at, updated_at"
)

SQL_CLAIM = """
INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, created_at, updated_at)
VALUES (?, ?, ?, 'pending', 1, ?, ?)
ON CONFLICT (principal, key) DO NOTHING
RETURNING generation
"""

SQL_LOOKUP = f"SELECT {_ROW_COLUMNS} FROM idempotency_keys WHERE principal = ? AND key = ?"

# Still pending, still stale, still the same request: all in the WHERE, so
# two racers cannot both take over the same generation.
SQL_TAKEOVER = """
UPDATE idempotency_keys
SET generation = generation + 1, updated_at = ?
WHERE principal = ? AND key = ? AND status = 'pending' AND fingerprint = ? AND updated_at < ?
RETURNING generation
"""

SQL_COMPLETE = """
UPDATE idempotency_keys
SET status = 'completed', response_status = ?, response_body = ?, response_headers = ?, updated_at = ?
WHERE principal = ? AND key = ? AND generation = ? AND status = 'pending'
RETURNING generation
"""

# One statement: the event and the generation that superseded it are read and
# written together, so the log never disagrees with the row it describes.
SQL_RECORD_FENCED = """
INSERT INTO idemctl_fenced_out
  (principal, key, superseded_generation, current_generation, computed_status, fenced_at)
VALUES (?, ?, ?, (SELECT generation FROM idempotency_keys WHERE principal = ? AND key = ?), ?, ?)
RETURNING id, principal, key, superseded_generation, current_generation, computed_status, fenced_at
"""

SQL_RELEASE = """
DELETE FROM idempotency_keys
WHERE principal = ? AND key = ? AND generation = ? AND status = 'pending'
RETURNING generation
"""

# SQLite has no DELETE ... LIMIT: bound the batch through a rowid subquery that
# walks idx_idempotency_keys_updated_at oldest first.
SQL_SWEEP = """
DELETE FROM idempotency_keys WHERE rowid IN (
  SELECT rowid FROM idempotency_keys WHERE updated_at < ? ORDER BY updated_at LIMIT ?
)
"""

SQL_SWEEP_FENCED = """
DELETE FROM idemctl_fenced_out WHERE id IN (
  SELECT id FROM idemctl_fenced_out WHERE fenced_at < ? ORDER BY fenced_at LIMIT ?
)
"""

SQL_COUNT_EXPIRED = "SELECT count(*) FROM idempotency_keys WHERE updated_at < ?"

# Read-only probes through the same indexes: when nothing is expired (the
# steady state), the per-request sweep takes no write lock and no queue turn.
SQL_ANY_EXPIRED = "SELECT EXISTS (SELECT 1 FROM idempotency_keys WHERE updated_at < ?)"
SQL_ANY_EXPIRED_WITH_FENCED = (
    "SELECT EXISTS (SELECT 1 FROM idempotency_keys WHERE updated_at < ?)"
    " OR EXISTS (SELECT 1 FROM idemctl_fenced_out WHERE fenced_at < ?)"
)

SQL_STATS = """
SELECT
  count(*),
  coalesce(sum(status = 'pending' AND updated_at >= :stale AND updated_at >= :expired), 0),
  coalesce(sum(status = 'pending' AND updated_at < :stale AND updated_at >= :expired), 0),
  coalesce(sum(status = 'completed' AND updated_at >= :expired), 0),
  coalesce(sum(updated_at < :expired), 0),
  coalesce(sum(generation > 1), 0),
  min(CASE WHEN status = 'pending' THEN created_at END),
  min(CASE WHEN status = 'completed' THEN created_at END),
  min(created_at)
FROM idempotency_keys
"""

SQL_COUNT_FENCED = "SELECT count(*) FROM idemctl_fenced_out"

# Purge refuses a fresh pending row inside the statement itself: its owner may
# still be running, and deleting it would let a retry run the mutation twice.
SQL_PURGE = f"""
DELETE FROM idempotency_keys
WHERE principal = ? AND key = ? AND (status <> 'pending' OR ? IS NULL OR updated_at < ?)
RETURNING {_ROW_COLUMNS}
"""


def _row(values: tuple) -> StoredRow:
    (principal, key, fp, status, generation, rstatus, rbody, rheaders, created, updated) = values
    return StoredRow(
        principal=principal,
        key=key,
        fingerprint=fp,
        status=Status(status),
        generation=int(generation),
        response_status=None if rstatus is None else int(rstatus),
        response_body=rbody,
        response_headers=rheaders,
        created_at=int(created),
        updated_at=int(updated),
    )


class SqliteBackend(SqlSteps):
    """One SQLite ledger file, shared safely by threads and processes.

    Writer queue (``write_queue=True``, the default on POSIX): every write
    statement first takes an exclusive ``flock`` on ``<db>-idemctl.lock`` and
    waits for it in the kernel. SQLite's own busy handler polls with growing
    sleeps (up to 100 ms each) and grants the lock to whoever happens to poll
    right after it is freed, so under several writer processes one request
    could wait for seconds while others went through; blocked ``flock``
    waiters are woken the moment the lock is released and take turns. Only
    idemctl's own writers queue; correctness never depends on the queue (the
    SQLite lock still decides), so ``write_queue=False`` opts out and any
    failure to open the lock file silently falls back to SQLite alone.

    >>> Ledger(SqliteBackend("idempotency.db", write_queue=False))  # doctest: +SKIP
    """

    dialect = "sqlite"
    # A batch holds the one database-wide write lock, and every claim waits
    # for the batch in progress: 250 rows keep a concurrent claimer's p99
    # within 50 ms on a 10^6-row backlog (1 000 rows: 130-170 ms) and drain
    # in 0-10 % more time (bench (5)), because the cost per row is the
    # scattered primary-key pages, not the number of statements.
    drain_batch = 250

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        create: bool = True,
        readonly: bool = False,
        busy_timeout_ms: int = 5000,
        synchronous: str = "FULL",
        write_queue: bool = True,
    ) -> None:
        if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise StorageError(f"synchronous must be OFF, NORMAL, FULL or EXTRA, got {synchronous!r}")
        self.busy_timeout_ms = int(busy_timeout_ms)
        self.synchronous = synchronous.upper()
        self.readonly = readonly
        raw = os.fspath(path)
        if raw == ":memory:":
            # Tests only: a shared-cache memory database so every thread sees one ledger.
            self.path = raw
            self._uri = f"file:idemctl-mem-{id(self)}?mode=memory&cache=shared"
            self._keepalive: sqlite3.Connection | None = None
        else:
            p = Path(raw).expanduser()
            self.path = str(p)
            if p.is_dir():
                raise NotADatabaseError(f"{p} is a directory, not a ledger file")
            if not p.exists():
                if readonly or not create:
                    raise LedgerNotFoundError(f"no ledger at {p} — run `idemctl init`")
                if not p.parent.is_dir():
                    raise LedgerNotFoundError(f"cannot create a ledger at {p}: directory {p.parent} does not exist")
            mode = "ro" if readonly else ("rwc" if create else "rw")
            self._uri = f"file:{quote(str(p.resolve()))}?mode={mode}"
            self._keepalive = None
        # Memory databases and read-only opens have no writers to queue.
        self.write_queue_path: str | None = (
            str(Path(self.path).resolve()) + WRITE_QUEUE_SUFFIX
            if write_queue and fcntl is not None and raw != ":memory:" and not readonly
            else None
        )
        self._local = threading.local()
        self._lock = threading.Lock()
        self._conns: list[sqlite3.Connection] = []
        self._queue_fds: list[int] = []
        # Connections inherited across fork are never closed in the child:
        # closing them could checkpoint or unlock on behalf of the parent.
        self._inherited: list[sqlite3.Connection] = []
        self._pid = os.getpid()
        conn = self._conn()
        if raw == ":memory:":
            self._keepalive = conn
        self.has_fenced_log = False
        self._refresh_schema()

    # -- connections ------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(
                self._uri,
                uri=True,
                isolation_level=None,
                timeout=self.busy_timeout_ms / 1000,
                check_same_thread=False,
            )
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc
        try:
            conn.execute(f"PRAGMA synchronous={self.synchronous}")
            if not self.readonly and self._uri.find("mode=memory") < 0:
                mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
                if mode.lower() != "wal":
                    conn.execute("PRAGMA journal_mode=WAL").fetchall()
        except sqlite3.Error as exc:
            conn.close()
            raise self._translate(exc) from exc
        return conn

    def _conn(self) -> sqlite3.Connection:
        pid = os.getpid()
        local = self._local
        if getattr(local, "pid", None) == pid:
            return local.conn
        with self._lock:
            if self._pid != pid:
                # First use after a fork: the parent's connections are off
                # limits here; keep them referenced so they are never closed.
                self._inherited.extend(self._conns)
                self._conns = []
                # The parent's queue descriptors stay open too: they share the
                # parent's open file description, so unlocking or closing here
                # could drop a lock the parent holds.
                self._queue_fds = []
                self._pid = pid
            conn = self._connect()
            self._conns.append(conn)
        local.conn, local.pid = conn, pid
        local.queue_fd = _UNOPENED
        return conn

    def _queue_fd(self) -> int | None:
        """This thread's descriptor on the lock file, opened at its first write
        (so read-only use never creates the file). One open file description
        per connection: flock excludes descriptions, so threads of one process
        queue exactly like processes do."""
        local = self._local
        fd = getattr(local, "queue_fd", None)
        if fd is not _UNOPENED:
            return fd
        fd = None
        if self.write_queue_path is not None:
            try:
                fd = os.open(self.write_queue_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            except OSError:
                fd = None  # e.g. a directory we may not create files in: SQLite's busy handler alone
            else:
                with self._lock:
                    self._queue_fds.append(fd)
        local.queue_fd = fd
        return fd

    def _enter_queue(self, conn: sqlite3.Connection) -> tuple[int | None, bool]:
        """Wait for this database's writer queue; returns (fd to unlock, shortened).

        The wait in flock counts against the busy timeout: once the lock is
        ours, SQLite gets only what is left of it, so a queue stuck behind a
        foreign writer fails within about one busy timeout, not one per
        waiter. Waits under a tenth of the timeout (the normal turn-taking
        of a busy ledger) are not deducted: that keeps two PRAGMA statements
        out of every contended turn, at the price of failing up to 10% late."""
        fd = self._local.queue_fd
        if fd is _UNOPENED:
            fd = self._queue_fd()
        if fd is None:
            return None, False
        started = time.monotonic()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # e.g. ENOLCK on a file system without flock: SQLite alone decides
            return None, False
        waited_ms = int((time.monotonic() - started) * 1000)
        if waited_ms <= 0 or waited_ms * 10 < self.busy_timeout_ms:
            return fd, False
        try:
            conn.execute(f"PRAGMA busy_timeout = {max(0, self.busy_timeout_ms - waited_ms)}")
        except BaseException:
            fcntl.flock(fd, fcntl.LOCK_UN)
            raise
        return fd, True

    def _leave_queue(self, conn: sqlite3.Connection, fd: int | None, shortened: bool) -> None:
        if fd is None:
            return
        # Unlock first: restoring the timeout is this thread's own business
        # and need not keep the next writer waiting.
        fcntl.flock(fd, fcntl.LOCK_UN)
        if shortened:
            conn.execute(f"PRAGMA busy_timeout = {self.busy_timeout_ms}")

    def close(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
            fds, self._queue_fds = self._queue_fds, []
        for conn in conns:
            with contextlib.suppress(sqlite3.Error):
                conn.close()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._local = threading.local()

    def describe(self) -> str:
        return self.path

    def admin(self) -> sqlite_utils.Database:
        """sqlite-utils view of this thread's connection, for introspection and admin."""
        return sqlite_utils.Database(self._conn(), recursive_triggers=False, execute_plugins=False)

    # -- errors -----------------------------------------------------------------
    def _translate(self, exc: sqlite3.Error) -> StorageError:
        name = getattr(exc, "sqlite_errorname", "") or ""
        msg = str(exc)
        low = msg.lower()
        if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "database is locked" in low:
            return DatabaseLockedError(
                f"database {self.path} is locked: another writer held it past the {self.busy_timeout_ms} ms busy timeout"
            )
        if name.startswith("SQLITE_READONLY") or "readonly" in low:
            return ReadOnlyDatabaseError(f"database {self.path} is read-only")
        if name.startswith(("SQLITE_NOTADB", "SQLITE_CORRUPT")) or "not a database" in low or "malformed" in low:
            return NotADatabaseError(f"{self.path} is not an SQLite database, or it is corrupt")
        if f"no such table: {LEDGER_TABLE}" in low:
            return SchemaMissingError(f"{self.path} has no idempotency ledger — run `idemctl init`")
        if name.startswith("SQLITE_CANTOPEN") or "unable to open" in low:
            return self._cannot_open()
        if name.startswith("SQLITE_FULL"):
            return StorageError(f"disk full while writing {self.path}")
        return StorageError(f"database error on {self.path}: {msg}")

    def _cannot_open(self) -> StorageError:
        """Say why an existing ledger cannot be opened, when we can tell."""
        if self.path == ":memory:" or not os.path.exists(self.path):
            return LedgerNotFoundError(f"cannot open the ledger at {self.path}")
        if not os.access(self.path, os.R_OK):
            return StorageError(f"cannot open the ledger at {self.path}: the file is not readable by this user")
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.access(directory, os.W_OK):
            # Even a reader of a WAL database needs the -shm index beside it;
            # the 3 a.m. case is an operator who is not the app's user.
            return StorageError(
                f"cannot open the ledger at {self.path}: SQLite must create its -wal/-shm files in {directory}, "
                "which this user cannot write to; run idemctl as the ledger's owner"
            )
        return StorageError(f"cannot open the ledger at {self.path}")

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc

    def _all(self, sql: str, params: tuple | dict = ()) -> list[tuple]:
        # fetchall() is what finishes (and so commits) a RETURNING statement on
        # an auto-commit connection; a half-read cursor would hold the lock.
        with self._errors():
            return self._conn().execute(sql, params).fetchall()

    # Writes go through the writer queue; reads never wait in it (WAL readers
    # do not block writers, nor writers readers).
    # (Plain try/except rather than context managers: this runs twice per
    # request, and the generator machinery cost more than the flock calls.)
    def _write_all(self, sql: str, params: tuple | dict = ()) -> list[tuple]:
        try:
            conn = self._conn()
            fd, shortened = self._enter_queue(conn)
            try:
                return conn.execute(sql, params).fetchall()
            finally:
                self._leave_queue(conn, fd, shortened)
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc

    # -- schema -----------------------------------------------------------------
    def _version_from(self, db: sqlite_utils.Database) -> int | None:
        tables = set(db.table_names())
        if LEDGER_TABLE not in tables:
            return None
        if VERSION_TABLE not in tables:
            return 0
        row = db.execute(f"SELECT max(version) FROM {VERSION_TABLE}").fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def _refresh_schema(self) -> None:
        with self._errors():
            db = self.admin()
            version = self._version_from(db)
            tables = set(db.table_names())
        if version is not None and version > SCHEMA_VERSION:
            raise SchemaTooNewError(
                f"{self.path} has ledger schema version {version}; this idemctl knows up to {SCHEMA_VERSION} — upgrade idemctl"
            )
        self.has_fenced_log = FENCED_TABLE in tables

    def schema_version(self) -> int | None:
        with self._errors():
            return self._version_from(self.admin())

    def init(self, now: int, dry_run: bool) -> InitResult:
        db = self.admin()
        with self._errors():
            # IMMEDIATE: two concurrent inits serialise instead of both deciding
            # from the same stale version.
            db.execute("BEGIN IMMEDIATE")
            try:
                before = self._version_from(db)
                if before is not None and before > SCHEMA_VERSION:
                    raise SchemaTooNewError(
                        f"{self.path} has ledger schema version {before}; this idemctl knows up to {SCHEMA_VERSION}"
                    )
                if before == SCHEMA_VERSION:
                    action = InitAction.UP_TO_DATE
                elif before is None:
                    action = InitAction.CREATED
                else:
                    action = InitAction.UPGRADED
                if action is not InitAction.UP_TO_DATE and not dry_run:
                    floor = -1 if before is None else before
                    for f in schema_files(self.dialect):
                        if f.version > floor:
                            db.executescript(f.sql)
                    db.execute(
                        f"INSERT OR IGNORE INTO {VERSION_TABLE} (version, applied_at) VALUES (?, ?)",
                        (SCHEMA_VERSION, now),
                    )
                    db.execute("COMMIT")
                else:
                    db.execute("ROLLBACK")
            except BaseException:
                if db.conn.in_transaction:
                    db.execute("ROLLBACK")
                raise
        if not dry_run:
            with self._errors():
                db.enable_wal()
            self._refresh_schema()
        return InitResult(action, before, SCHEMA_VERSION, dry_run)

    # -- request path: claim, lookup, takeover, complete, record_fenced and release
    # come from SqlSteps, each one of the statements above.
    SQL_CLAIM = SQL_CLAIM
    SQL_LOOKUP = SQL_LOOKUP
    SQL_TAKEOVER = SQL_TAKEOVER
    SQL_COMPLETE = SQL_COMPLETE
    SQL_RECORD_FENCED = SQL_RECORD_FENCED
    SQL_RELEASE = SQL_RELEASE
    SQL_COUNT_EXPIRED = SQL_COUNT_EXPIRED
    _row = staticmethod(_row)

    def sweep(self, cutoff: int, limit: int) -> SweepResult:
        # Both statements in one turn of the writer queue: every request runs a
        # sweep, and each extra turn is one more hand-over between processes.
        with self._errors():
            conn = self._conn()
            # Not check-then-act: the DELETEs below still decide on their own;
            # the probe only skips statements that would delete nothing.
            if self.has_fenced_log:
                probe = conn.execute(SQL_ANY_EXPIRED_WITH_FENCED, (cutoff, cutoff)).fetchone()
            else:
                probe = conn.execute(SQL_ANY_EXPIRED, (cutoff,)).fetchone()
            if not probe[0]:
                return SweepResult(0, 0, cutoff)
            fd, shortened = self._enter_queue(conn)
            try:
                keys = conn.execute(SQL_SWEEP, (cutoff, limit)).rowcount
                fenced = conn.execute(SQL_SWEEP_FENCED, (cutoff, limit)).rowcount if self.has_fenced_log else 0
            finally:
                self._leave_queue(conn, fd, shortened)
        return SweepResult(keys, fenced, cutoff)

    # -- operator side ---------------------------------------------------------------
    def iter_pending(self, stale_before: int | None, principal: str | None, limit: int | None) -> Iterator[StoredRow]:
        sql = f"SELECT {_ROW_COLUMNS} FROM idempotency_keys WHERE status = 'pending'"
        params: list[object] = []
        if stale_before is not None:
            sql += " AND updated_at < ?"
            params.append(stale_before)
        if principal is not None:
            sql += " AND principal = ?"
            params.append(principal)
        sql += " ORDER BY updated_at, principal, key"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        # Streamed from the cursor on a private connection: a million pending
        # rows never sit in memory at once, and the request-path connection of
        # this thread stays free.
        with self._errors():
            conn = self._connect()
        try:
            with self._errors():
                for values in conn.execute(sql, params):
                    yield _row(values)
        finally:
            conn.close()

    def iter_fenced(
        self, principal: str | None, key: str | None, since: int | None, limit: int | None
    ) -> Iterator[FencedEvent]:
        if not self.has_fenced_log:
            return
        sql = (
            "SELECT id, principal, key, superseded_generation, current_generation, computed_status, fenced_at "
            "FROM idemctl_fenced_out WHERE 1 = 1"
        )
        params: list[object] = []
        for clause, value in (("principal = ?", principal), ("key = ?", key), ("fenced_at >= ?", since)):
            if value is not None:
                sql += f" AND {clause}"
                params.append(value)
        sql += " ORDER BY fenced_at DESC, id DESC"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        for values in self._all(sql, tuple(params)):
            yield event_from(values)

    def stats(self, now: int, stale_before: int, expired_before: int) -> Stats:
        counts = self._all(SQL_STATS, {"stale": stale_before, "expired": expired_before})[0]
        fenced = int(self._all(SQL_COUNT_FENCED)[0][0]) if self.has_fenced_log else 0
        return stats_from(now, counts, fenced, self.storage_bytes(), self.schema_version())

    def storage_bytes(self) -> int | None:
        if self.path == ":memory:":
            return None
        return sum(os.path.getsize(p) for p in (self.path, self.path + "-wal") if os.path.exists(p))

    def purge(self, principal: str, key: str, stale_before: int | None) -> PurgeResult:
        rows = self._write_all(SQL_PURGE, (principal, key, stale_before, stale_before))
        return self._purge_result(principal, key, rows)
