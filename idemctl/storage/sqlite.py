"""SQLite engine: per-thread connections, the writer queue, SQLite's errors.

Request-path statements run on auto-commit connections (isolation_level=None):
each is its own transaction, and RETURNING rows are fetched in full before the
statement is finished, so nothing is left holding the write lock.
Connections are per thread and per process: SQLite connections must not
cross threads, and must never be used on the far side of a fork. A thread's
connection is closed when the thread ends, so servers that start a thread
per request do not pile up connections."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar
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
    SchemaOutdatedError,
    StorageError,
)
from .dialect import SQLITE
from .engine import Params, Rows, SchemaTx

T = TypeVar("T")

# What a reader of a WAL ledger gets when the -shm file beside it cannot be
# created or written: the directory, not the database, is the problem.
_SHM_UNUSABLE = frozenset(
    {"SQLITE_READONLY_CANTINIT", "SQLITE_READONLY_CANTLOCK", "SQLITE_READONLY_RECOVERY", "SQLITE_READONLY_DIRECTORY"}
)
# The writer queue's lock file sits next to the ledger: `<db>-idemctl.lock`.
WRITE_QUEUE_SUFFIX = "-idemctl.lock"
# A new ledger is readable by its owner only: it holds every stored answer.
DEFAULT_FILE_MODE = 0o600
SYNCHRONOUS_LEVELS = ("OFF", "NORMAL", "FULL", "EXTRA")

_UNOPENED = object()  # a thread's queue descriptor before its first write

# Connections a forked child inherited: never closed there (closing could
# checkpoint or unlock on behalf of the parent) and never freed, which would
# close them too.
_INHERITED: list[object] = []


class _Slot:
    """One thread's connection and writer-queue descriptor. When the thread
    ends, its thread-local storage drops the slot and the finalizer closes
    both."""

    __slots__ = ("__weakref__", "conn", "fds", "pid", "queue_fd")

    def __init__(self, conn: sqlite3.Connection, pid: int) -> None:
        self.conn = conn
        self.pid = pid
        self.queue_fd: int | object | None = _UNOPENED
        self.fds: list[int] = []  # shared with the finalizer: the queue fd once opened


def _release(conn: sqlite3.Connection, fds: list[int], pid: int) -> None:
    if os.getpid() != pid:
        _INHERITED.append(conn)
        return
    with contextlib.suppress(sqlite3.Error):
        conn.close()
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


class _ForkGate:
    """Statements in flight on one engine, so that a fork() can wait for
    them: a child must never inherit SQLite mid-statement (its locks, its
    mutexes) nor any of this file's connections. Each statement passes
    through it (two uncontended lock operations); `hold` waits until none is
    in flight and keeps new ones out until `reopen`."""

    __slots__ = ("busy", "forking", "idle", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.busy = 0
        self.forking = False

    def enter(self) -> None:
        with self.lock:
            while self.forking:
                self.idle.wait()
            self.busy += 1

    def leave(self) -> None:
        with self.lock:
            self.busy -= 1
            if self.forking and not self.busy:
                self.idle.notify_all()

    def hold(self, timeout_s: float) -> bool:
        """Keep new statements out; True once none is in flight, False if
        some still are after `timeout_s` (a statement stuck behind another
        process's writer)."""
        self.lock.acquire()
        self.forking = True
        deadline = time.monotonic() + timeout_s
        while self.busy:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.idle.wait(left)
        return True

    def reopen(self) -> None:
        self.forking = False
        self.idle.notify_all()
        self.lock.release()


# Every file-backed engine of this process, for the fork hooks below.
_ENGINES: weakref.WeakSet[SqliteEngine] = weakref.WeakSet()
# Ledger files this process must not use, and why: it was forked while the
# parent was inside SQLite for them, so SQLite's per-process state for the
# file was copied mid-statement (a new connection here would share it).
# Inherited by this process's own children, who share the same state.
_UNSAFE_FILES: dict[str, str] = {}
_FORKING: list[SqliteEngine] = []


def _before_fork() -> None:
    # Runs in the forking thread just before fork(), in the parent.
    engines = list(_ENGINES)
    for engine in engines:
        engine._quiesce_for_fork()
    _FORKING[:] = engines


def _after_fork_in_parent() -> None:
    engines, _FORKING[:] = list(_FORKING), []
    for engine in engines:
        engine._resume_after_fork()


def _after_fork_in_child() -> None:
    engines, _FORKING[:] = list(_FORKING), []
    for engine in engines:
        engine._start_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
    )


def split_statements(script: str) -> list[str]:
    """A DDL file as single statements, so that a schema change runs inside
    the caller's transaction (executescript would commit it first)."""
    statements, buffer = [], ""
    for line in script.splitlines(keepends=True):
        buffer += line
        if sqlite3.complete_statement(buffer):
            if buffer.strip():
                statements.append(buffer.strip())
            buffer = ""
    if buffer.strip() and not all(
        ln.strip().startswith("--") or not ln.strip() for ln in buffer.splitlines()
    ):
        raise StorageError("a schema file ends inside a statement")
    return statements


# Group commit: at most this many statements share one transaction, so a
# leader's turn (and the queue's other processes) waits a bounded time.
GROUP_COMMIT_MAX_BATCH = 64


class _Pending:
    """One write statement waiting for its batch's commit."""

    __slots__ = ("done", "error", "lead", "params", "rows", "sql", "wake")

    def __init__(self, sql: str, params: Params) -> None:
        self.sql = sql
        self.params = params
        self.rows: Rows = []
        self.error: BaseException | None = None
        self.done = False  # set under the group's lock, before `wake`
        self.lead = False  # leadership was handed to this request's thread
        # Released once: the statement is done, or its thread now leads. A
        # bare lock, not an Event: the cheapest wait there is, paid per statement.
        self.wake = threading.Lock()
        self.wake.acquire()


class _Group:
    """The statements of one process waiting to be committed together. A
    forked child starts a new one: the parent's waiters are not its own."""

    __slots__ = ("batches", "leading", "lock", "pid", "queue", "statements")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.lock = threading.Lock()
        self.queue: deque[_Pending] = deque()
        self.leading = False
        self.batches = 0
        self.statements = 0


class SqliteEngine:
    """One SQLite ledger file, shared safely by threads and processes.

    Writer queue (``write_queue=True``, the default on POSIX): every write
    statement first takes an exclusive ``flock`` on ``<db>-idemctl.lock`` and
    waits for it in the kernel. SQLite's own busy handler polls with growing
    sleeps and grants the lock to whoever happens to poll right after it is
    freed, so under several writer processes one request could wait for
    seconds while others went through; blocked ``flock`` waiters are woken
    the moment the lock is released and take turns. Correctness never
    depends on the queue (the SQLite lock still decides), so
    ``write_queue=False`` opts out and any failure to open the lock file
    falls back to SQLite alone.

    Group commit (``group_commit=True``, off by default): write statements
    that threads of this process issue at the same time are committed
    together, in one transaction and so one fsync of the WAL. A caller that
    finds no commit in progress runs its statement at once, exactly as
    without group commit (so a single thread pays nothing); statements that
    arrive meanwhile queue. When it is done, the first of them leads: it
    takes what is queued (up to GROUP_COMMIT_MAX_BATCH statements), takes
    one turn of the writer queue, runs them in arrival order (a failing
    statement is undone by SQLite alone and fails only its own caller),
    commits, and wakes their callers; a caller returns only once
    the commit that holds its statement is done. A leader whose own
    statement is committed hands leadership to the next waiter rather than
    working on for others. Memory databases have no fsync to share and
    never batch.

    Opening never creates a file: the ledger file (owner-only by default,
    ``file_mode``) appears when the schema is first created.

    >>> engine = SqliteEngine(":memory:")
    >>> engine.read("SELECT 1 + 1", {})
    [(2,)]
    """

    dialect = SQLITE
    # A lone group-commit statement auto-commits as a plain write does; the
    # tests turn this off to drive every statement through the batch path.
    lone_statement_autocommits = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        create: bool = True,
        readonly: bool = False,
        busy_timeout_ms: int = 5000,
        synchronous: str = "FULL",
        write_queue: bool = True,
        file_mode: int = DEFAULT_FILE_MODE,
        group_commit: bool = False,
    ) -> None:
        if not isinstance(synchronous, str) or synchronous.upper() not in SYNCHRONOUS_LEVELS:
            raise StorageError(f"synchronous must be OFF, NORMAL, FULL or EXTRA, got {synchronous!r}")
        if isinstance(file_mode, bool) or not isinstance(file_mode, int) or not 0 <= file_mode <= 0o777:
            raise StorageError(f"file mode must be permission bits such as 0o600, got {file_mode!r}")
        if file_mode & 0o600 != 0o600:
            raise StorageError(f"file mode {file_mode:#o} must let the owner read and write the ledger")
        self.busy_timeout_ms = int(busy_timeout_ms)
        self.synchronous = synchronous.upper()
        self.readonly = readonly
        self.file_mode = file_mode
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
                if readonly or not create:
                    raise LedgerNotFoundError(str(p))
                if not p.parent.is_dir():
                    raise LedgerNotFoundError(
                        str(p), f"cannot create a ledger at {p}: directory {p.parent} does not exist"
                    )
            self._uri = f"file:{quote(str(p.resolve()))}?mode={'ro' if readonly else 'rw'}"
        # Memory databases and read-only opens have no writers to queue.
        self.write_queue_path: str | None = (
            str(Path(self.path).resolve()) + WRITE_QUEUE_SUFFIX
            if write_queue and fcntl is not None and not self.memory and not readonly
            else None
        )
        self._local = threading.local()
        self._lock = threading.Lock()
        self.group_commit = bool(group_commit) and not self.memory and not readonly
        self._group = _Group(os.getpid())
        self._finalizers: list[weakref.finalize] = []  # type: ignore[type-arg]
        self._keepalive: sqlite3.Connection | None = None
        self._gate = _ForkGate()
        self._streams = 0  # listings being read (each on a private connection)
        self._streams_at_fork = 0
        self._drained_at_fork = True
        # Why this engine cannot be used in this process (a child forked
        # while the parent was inside SQLite for this file), or None.
        self._unusable: str | None = None if self.memory else _UNSAFE_FILES.get(os.path.realpath(self.path))
        if self.memory:
            self._keepalive = self._conn()
        else:
            _ENGINES.add(self)
            if self.exists():
                self._gate.enter()
                try:
                    self._conn()  # a file that is not a database fails here, at open
                finally:
                    self._gate.leave()

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
            if not (self.readonly and self._nobody_writes_it()):
                raise
            self._uri += "&immutable=1"
            return self._connect_to(self._uri)

    def _nobody_writes_it(self) -> bool:
        """Whether no process can be changing this ledger file: no -wal holds
        commits the file lacks, and its directory takes no new files from
        anyone (a read-only file system, or one that refuses even root), so
        no writer can start either. Only then is `immutable` safe."""
        wal = self.path + "-wal"
        if os.path.exists(wal) and os.path.getsize(wal) > 0:
            return False
        directory = os.path.dirname(os.path.abspath(self.path))
        if os.access(directory, os.W_OK):
            return False
        try:
            if os.statvfs(directory).f_flag & os.ST_RDONLY:
                return True
        except OSError:
            return False
        return hasattr(os, "geteuid") and os.geteuid() == 0

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

    def _slot(self) -> _Slot:
        local = self._local
        slot: _Slot | None = getattr(local, "slot", None)
        pid = os.getpid()
        if slot is not None and slot.pid == pid:
            return slot
        if self._unusable is not None:
            raise StorageError(self._unusable)
        conn = self._connect()
        slot = _Slot(conn, pid)
        finalizer = weakref.finalize(slot, _release, conn, slot.fds, pid)
        with self._lock:
            if len(self._finalizers) > 64:
                self._finalizers = [f for f in self._finalizers if f.alive]
            self._finalizers.append(finalizer)
        local.slot = slot
        return slot

    def _conn(self) -> sqlite3.Connection:
        return self._slot().conn

    def _open_queue(self, slot: _Slot) -> int | None:
        """This thread's descriptor on the lock file, opened at its first write
        (so read-only use never creates the file). One open file
        description per connection: flock excludes descriptions, so threads
        of one process queue exactly like processes do."""
        if self.write_queue_path is None:
            return None
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
        try:
            try:
                mode = self._companion_mode()
                fd = os.open(self.write_queue_path, flags | os.O_CREAT | os.O_EXCL, mode)
                os.fchmod(fd, mode)  # exactly the ledger's bits, whatever the umask
            except FileExistsError:
                fd = os.open(self.write_queue_path, flags)
        except OSError:
            return None  # e.g. a directory we may not create files in: SQLite's busy handler alone
        slot.fds.append(fd)
        return fd

    def _companion_mode(self) -> int:
        # The lock file gets the ledger's own permission bits, as SQLite gives
        # its -wal and -shm files.
        try:
            return os.stat(self.path).st_mode & 0o777
        except OSError:
            return self.file_mode

    def _enter_queue(self, slot: _Slot) -> tuple[int | None, bool]:
        """Wait for this database's writer queue; returns (fd to unlock, shortened).

        The wait in flock counts against the busy timeout: once the lock is
        ours, SQLite gets only what is left of it, so a queue stuck behind a
        foreign writer fails within about one busy timeout, not one per
        waiter. Waits under a tenth of the timeout (the normal turn-taking
        of a busy ledger) are not deducted: that keeps two PRAGMA statements
        out of every contended turn, at the price of failing up to 10% late."""
        fd = slot.queue_fd
        if fd is _UNOPENED:
            fd = slot.queue_fd = self._open_queue(slot)
        if fd is None:
            return None, False
        assert isinstance(fd, int)
        try:
            # A free queue (the usual case) is taken without timing a wait
            # that did not happen.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd, False
        except BlockingIOError:
            pass
        except OSError:  # e.g. ENOLCK on a file system without flock: SQLite alone decides
            return None, False
        started = time.monotonic()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            return None, False
        waited_ms = int((time.monotonic() - started) * 1000)
        if waited_ms <= 0 or waited_ms * 10 < self.busy_timeout_ms:
            return fd, False
        try:
            slot.conn.execute(f"PRAGMA busy_timeout = {max(0, self.busy_timeout_ms - waited_ms)}")
        except BaseException:
            fcntl.flock(fd, fcntl.LOCK_UN)
            raise
        return fd, True

    def _leave_queue(self, slot: _Slot, fd: int | None, shortened: bool) -> None:
        if fd is None:
            return
        # Unlock first: restoring the timeout is this thread's own business
        # and need not keep the next writer waiting.
        fcntl.flock(fd, fcntl.LOCK_UN)
        if shortened:
            slot.conn.execute(f"PRAGMA busy_timeout = {self.busy_timeout_ms}")

    # -- fork ---------------------------------------------------------------------
    # A child forked at any moment must find no SQLite state for this file:
    # SQLite keeps its locks and its view of the file per process, and a
    # child that inherits a connection mid-statement (or even idle) shares
    # that view with a parent it cannot see, which makes its writes fail as
    # locked, hang on a mutex, or worse. So before fork() the parent waits
    # for the statements in flight, closes every connection of this engine
    # (each thread opens a new one at its next statement) and lets none start
    # until the fork is done; the child starts with no connection at all.
    # A statement can wait (for the writer queue, or in SQLite's busy
    # handler) about one busy timeout: the fork waits that long for it, and
    # no longer, so that fork() never hangs on another process's writer.
    def _quiesce_for_fork(self) -> None:
        drained = self._gate.hold(self.busy_timeout_ms / 1000 + 1)
        self._lock.acquire()
        self._group.lock.acquire()
        if drained:
            for finalizer in self._finalizers:
                found = finalizer.peek()
                if found is not None:
                    found[0].pid = -1  # the thread's slot is stale: it reconnects
                finalizer()  # closes the connection and the writer-queue descriptor
            self._finalizers = []
        self._drained_at_fork = drained
        self._streams_at_fork = self._streams

    def _resume_after_fork(self) -> None:
        self._group.lock.release()
        self._lock.release()
        self._gate.reopen()

    def _start_in_child(self) -> None:
        # Fresh locks: the parent's threads that held or waited on them are not here.
        self._group = _Group(os.getpid())
        self._lock = threading.Lock()
        self._gate = _ForkGate()
        self._streams = 0
        self._finalizers = []  # the parent's, when it could not close them: never ours to close
        why = None
        if not self._drained_at_fork:
            why = "a statement on it had been running for over the busy timeout"
        elif self._streams_at_fork:
            why = "it was being listed (pending rows, a stream)"
        if why is not None:
            self._unusable = _UNSAFE_FILES[os.path.realpath(self.path)] = (
                f"this process was forked while {why} in the parent process, so SQLite's state for "
                f"{self.path} was copied into this one and no connection to it is safe here: fork when no "
                "listing is open and no write is stuck, or open the ledger only after fork (in each child)"
            )

    def open_connections(self) -> int:
        """How many of this engine's connections are open in this process."""
        with self._lock:
            return sum(1 for f in self._finalizers if f.alive)

    def close(self) -> None:
        with self._lock:
            finalizers, self._finalizers = self._finalizers, []
        keep = self._keepalive
        for finalizer in finalizers:
            finalizer()
        self._local = threading.local()
        if keep is not None:
            self._keepalive = None  # a closed memory ledger is gone, as a file's rows would not be

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
                f"database {self.path} is locked: another writer held it past the "
                f"{self.busy_timeout_ms} ms busy timeout"
            )
        if name.startswith("SQLITE_READONLY") or "readonly" in low:
            if name in _SHM_UNUSABLE:  # a reader whose -shm file could not be made or used
                return self._cannot_open()
            return ReadOnlyDatabaseError(f"database {self.path} is read-only")
        if name.startswith(("SQLITE_NOTADB", "SQLITE_CORRUPT")) or "not a database" in low or "malformed" in low:
            return NotADatabaseError(f"{self.path} is not an SQLite database, or it is corrupt")
        if "no such table: idempotency_keys" in low:
            return SchemaMissingError(self.path)
        if "no such column: token" in low or "has no column named token" in low or "no such table: idemctl_" in low:
            return SchemaOutdatedError(self.path)
        if name.startswith("SQLITE_CANTOPEN") or "unable to open" in low:
            return self._cannot_open()
        if name.startswith("SQLITE_FULL"):
            return StorageError(f"disk full while writing {self.path}")
        return StorageError(f"database error on {self.path}: {msg}")

    def _cannot_open(self) -> StorageError:
        """Say why an existing ledger cannot be opened, when we can tell."""
        if self.memory or not os.path.exists(self.path):
            return LedgerNotFoundError(self.path, f"cannot open the ledger at {self.path}")
        if not os.access(self.path, os.R_OK):
            return StorageError(f"cannot open the ledger at {self.path}: the file is not readable by this user")
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.access(directory, os.W_OK):
            # Even a reader of a WAL database needs the -shm index beside it;
            # the 3 a.m. case is an operator who is not the app's user.
            wal = self.path + "-wal"
            pending = os.path.exists(wal) and os.path.getsize(wal) > 0
            return StorageError(
                f"cannot open the ledger at {self.path}: SQLite must create its -shm file beside it in {directory}, "
                "which this user cannot write to"
                + (f" (and {wal} holds commits not yet in the file)" if pending else "")
                + "; run idemctl as a user who may write there (the application's), or make the directory "
                "writable for this user"
            )
        return StorageError(f"cannot open the ledger at {self.path}")

    # -- statements ---------------------------------------------------------------
    def read(self, sql: str, params: Params) -> Rows:
        # fetchall() is what finishes (and so commits) a RETURNING statement on
        # an auto-commit connection; a half-read cursor would hold the lock.
        gate = self._gate
        gate.enter()
        try:
            return self._slot().conn.execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc
        finally:
            gate.leave()

    # Writes go through the writer queue; reads never wait in it (WAL readers
    # do not block writers, nor writers readers). Plain try/except rather than
    # context managers: this runs twice per request.
    def write(self, sql: str, params: Params) -> Rows:
        if self.group_commit:
            return self._group_write(sql, params)
        return self._write_alone(sql, params)

    # -- group commit ----------------------------------------------------------------
    @property
    def batches_committed(self) -> int:
        """Commits made by group commit in this process (a lone statement counts as one)."""
        return self._group.batches

    @property
    def statements_committed(self) -> int:
        """Statements those commits made durable (failed statements not counted)."""
        return self._group.statements

    def _this_group(self) -> _Group:
        group = self._group
        pid = os.getpid()
        if group.pid != pid:
            with self._lock:
                if self._group.pid != pid:
                    self._group = _Group(pid)
                group = self._group
        return group

    def _group_write(self, sql: str, params: Params) -> Rows:
        group = self._this_group()
        with group.lock:
            # No leader means nothing is queued: this statement is a batch of
            # one, and its caller leads without queueing anything.
            alone = not group.leading
            group.leading = True
            if not alone or not self.lone_statement_autocommits:
                mine = _Pending(sql, params)
                group.queue.append(mine)
        if alone and self.lone_statement_autocommits:
            try:
                rows = self._write_alone(sql, params)
                group.batches += 1
                group.statements += 1
                return rows
            finally:
                self._pass_on(group)
        if not alone:
            # Woken either because a leader committed our statement, or
            # because leadership was handed to us.
            try:
                mine.wake.acquire()
            except BaseException:
                self._abandon(group, mine, leading=False)
                raise
        while not mine.done:
            with group.lock:
                mine.lead = False
                batch = [group.queue.popleft() for _ in range(min(len(group.queue), GROUP_COMMIT_MAX_BATCH))]
            try:
                self._commit_batch(batch)
            except BaseException as exc:
                # The leader itself was interrupted (not a statement's error):
                # its batch-mates hear so rather than wait forever.
                for p in batch:
                    if p.error is None:
                        p.error = StorageError(f"a group commit on {self.path} was interrupted: {exc!r}")
                self._finish(group, batch, mine)
                self._abandon(group, mine, leading=True)
                raise
            self._finish(group, batch, mine)
        if mine.error is not None:
            if isinstance(mine.error, sqlite3.Error):
                raise self._translate(mine.error) from mine.error
            raise mine.error
        return mine.rows

    def _write_alone(self, sql: str, params: Params) -> Rows:
        """One auto-committed statement in the writer queue: a plain write."""
        gate = self._gate
        gate.enter()
        try:
            slot = self._slot()
            fd, shortened = self._enter_queue(slot)
            try:
                return slot.conn.execute(sql, params).fetchall()
            finally:
                self._leave_queue(slot, fd, shortened)
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc
        finally:
            gate.leave()

    def _pass_on(self, group: _Group) -> None:
        """A leader done with its own statement: the first waiter leads next."""
        with group.lock:
            if not group.queue:
                group.leading = False
                return
            successor = group.queue[0]
            successor.lead = True
        successor.wake.release()

    def _finish(self, group: _Group, batch: list[_Pending], mine: _Pending) -> None:
        """Wake the batch's callers; if statements are still queued, the
        leader goes on only for its own, else the next waiter leads."""
        successor: _Pending | None = None
        with group.lock:
            for p in batch:
                p.done = True
            if not group.queue:
                group.leading = False
            elif mine.done:
                successor = group.queue[0]  # `leading` stays set: it is handed over
                successor.lead = True
        # The next leader first: its batch gets going while the others wake.
        if successor is not None:
            successor.wake.release()
        for p in batch:
            if p is not mine:
                p.wake.release()

    def _abandon(self, group: _Group, mine: _Pending, *, leading: bool) -> None:
        """A caller interrupted while waiting or leading: its statement
        leaves the queue if no batch has it yet, and leadership it holds (or
        was just handed) passes on, so the others never wait for a leader
        that left."""
        successor: _Pending | None = None
        with group.lock:
            if mine.done:
                return
            if mine in group.queue:
                group.queue.remove(mine)
            if leading or mine.lead:
                if group.queue:
                    successor = group.queue[0]
                    successor.lead = True
                else:
                    group.leading = False
        if successor is not None:
            successor.wake.release()

    def _commit_batch(self, batch: list[_Pending]) -> None:
        """Run `batch` in one transaction; each request's rows or error.
        sqlite3 errors are left untranslated on the requests: each caller
        translates its own, in its own thread."""
        gate = self._gate
        gate.enter()
        try:
            self._run_batch(batch)
        finally:
            gate.leave()

    def _run_batch(self, batch: list[_Pending]) -> None:
        slot = self._slot()
        conn = slot.conn
        try:
            fd, shortened = self._enter_queue(slot)
        except sqlite3.Error as exc:
            for p in batch:
                p.error = exc
            return
        try:
            if len(batch) == 1 and self.lone_statement_autocommits:
                # Alone: exactly the auto-committed statement of a plain write.
                p = batch[0]
                try:
                    p.rows = conn.execute(p.sql, p.params).fetchall()
                except Exception as exc:  # e.g. OverflowError binding a parameter: its caller's alone
                    p.error = exc
                else:
                    self._group.batches += 1
                    self._group.statements += 1
                return
            try:
                conn.execute("BEGIN IMMEDIATE")
                for p in batch:
                    try:
                        p.rows = conn.execute(p.sql, p.params).fetchall()
                    except Exception as exc:
                        # A failing statement is undone by SQLite itself (its
                        # statement journal) and the transaction goes on, so
                        # no savepoint per statement is needed; when SQLite
                        # had to roll back the whole transaction instead
                        # (disk full, I/O error), every statement fails.
                        if not conn.in_transaction:
                            raise
                        p.rows, p.error = [], exc
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                # Nothing of this batch is durable: every caller hears why.
                if conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                for p in batch:
                    p.rows, p.error = [], exc
                return
            except BaseException:
                if conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                raise
            self._group.batches += 1
            self._group.statements += sum(1 for p in batch if p.error is None)
        finally:
            self._leave_queue(slot, fd, shortened)

    def write_turn(self, statements: Sequence[tuple[str, Params]]) -> list[Rows]:
        # The sweep's DELETEs share one turn of the writer queue: each extra
        # turn is one more hand-over between processes.
        gate = self._gate
        gate.enter()
        try:
            slot = self._slot()
            fd, shortened = self._enter_queue(slot)
            try:
                return [slot.conn.execute(sql, params).fetchall() for sql, params in statements]
            finally:
                self._leave_queue(slot, fd, shortened)
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc
        finally:
            gate.leave()

    def stream(self, sql: str, params: Params) -> Iterator[tuple[Any, ...]]:
        # A private connection: a million rows never sit in memory at once,
        # and this thread's request-path connection stays free. It stays open
        # between rows, so a fork cannot wait for it: it is counted instead.
        if self._unusable is not None:
            raise StorageError(self._unusable)
        with self._lock:
            self._streams += 1
        try:
            conn = self._connect()
            try:
                yield from conn.execute(sql, params)
            except sqlite3.Error as exc:
                raise self._translate(exc) from exc
            finally:
                conn.close()
        finally:
            with self._lock:
                self._streams -= 1

    def table_names(self, names: Iterable[str]) -> set[str]:
        if not self.exists():
            return set()
        gate = self._gate
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
    def _create_file(self) -> None:
        """Create the ledger file, already in WAL mode, under its final name
        in one step: it is prepared under a private name and hard-linked into
        place, which fails if another process got there first. So no process
        ever opens a half-made file, and no two first connections race to
        switch it to WAL (that race can deadlock two inits). Its permission
        bits are exactly `file_mode`, whatever the umask; SQLite gives the
        -wal and -shm files the same bits."""
        directory = os.path.dirname(os.path.abspath(self.path))
        staging = os.path.join(directory, f".{os.path.basename(self.path)}.{os.getpid()}.{threading.get_ident()}.new")
        try:
            fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), self.file_mode)
        except OSError as exc:
            raise StorageError(f"cannot create a ledger at {self.path}: {exc.strerror}") from exc
        try:
            os.fchmod(fd, self.file_mode)
            os.close(fd)
            conn = sqlite3.connect(staging, isolation_level=None)
            try:
                conn.execute("PRAGMA journal_mode=WAL").fetchall()
            finally:
                conn.close()
            with contextlib.suppress(FileExistsError):  # another process got there first: theirs is the ledger
                os.link(staging, self.path)
        except (OSError, sqlite3.Error) as exc:
            raise StorageError(f"cannot create a ledger at {self.path}: {exc}") from exc
        finally:
            for leftover in (staging, staging + "-wal", staging + "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(leftover)

    def migrate(self, body: Callable[[SchemaTx], T], *, write: bool) -> T:
        gate = self._gate
        gate.enter()
        try:
            return self._migrate(body, write)
        finally:
            gate.leave()

    def _migrate(self, body: Callable[[SchemaTx], T], write: bool) -> T:
        if write and not self.readonly and not self.exists():
            self._create_file()
        if not self.exists():
            return body(_AbsentTx())
        conn = self._conn()
        try:
            # IMMEDIATE: two concurrent inits serialise instead of both
            # deciding from the same stale version.
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                result = body(_SqliteTx(self, conn))
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


class _SqliteTx:
    def __init__(self, engine: SqliteEngine, conn: sqlite3.Connection) -> None:
        self.engine = engine
        self.conn = conn

    def execute(self, sql: str, params: Params) -> Rows:
        return self.conn.execute(sql, params).fetchall()

    def script(self, sql: str) -> None:
        for statement in split_statements(sql):
            self.conn.execute(statement)

    def table_names(self, names: Iterable[str]) -> set[str]:
        db = sqlite_utils.Database(self.conn, recursive_triggers=False, execute_plugins=False)
        return set(names) & set(db.table_names())

    def check_recipe_table(self) -> None:
        return None


class _AbsentTx:
    """A dry run (or a read-only open) of a ledger file that does not exist yet."""

    def execute(self, sql: str, params: Params) -> Rows:
        raise AssertionError("no statement runs against a ledger file that does not exist")

    def script(self, sql: str) -> None:
        raise AssertionError("no statement runs against a ledger file that does not exist")

    def table_names(self, names: Iterable[str]) -> set[str]:
        return set()

    def check_recipe_table(self) -> None:
        return None
