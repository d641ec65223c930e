"""One engine's SQLite connections: one per thread and per process, closed
when their thread ends, and never carried across a fork.

SQLite connections must not cross threads, and must never be used on the
far side of a fork. A thread's connection is closed when the thread ends, so
servers that start a thread per request do not pile up connections.

A child forked at any moment must find no SQLite state for the file: SQLite
keeps its locks and its view of the file per process, and a child that
inherits a connection mid-statement (or even idle) shares that view with a
parent it cannot see, which makes its writes fail as locked, hang on a
mutex, or worse. So before fork() the parent waits for the statements in
flight, closes every connection of each engine (each thread opens a new one
at its next statement) and lets none start until the fork is done; the
child starts with no connection at all. A statement can wait (for the
writer queue, or in SQLite's busy handler) about one busy timeout: the fork
waits that long for it, and no longer, so that fork() never hangs on
another process's writer."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable
from typing import Protocol

from ...errors import StorageError

UNOPENED = -1  # a thread's queue descriptor before its first write (no descriptor is negative)

# Connections a forked child inherited: never closed there (closing could
# checkpoint or unlock on behalf of the parent) and never freed, which would
# close them too.
_INHERITED: list[object] = []


class Slot:
    """One thread's connection and writer-queue descriptor. When the thread
    ends, its thread-local storage drops the slot and the finalizer closes
    both."""

    __slots__ = ("__weakref__", "conn", "fds", "pid", "queue_fd")

    def __init__(self, conn: sqlite3.Connection, pid: int) -> None:
        self.conn = conn
        self.pid = pid
        self.queue_fd: int | None = UNOPENED  # None: no queue for this thread
        self.fds: list[int] = []  # shared with the finalizer: the queue fd once opened


def _release(
    conn: sqlite3.Connection, fds: list[int], pid: int, gate: ForkGate | None, opened: set[sqlite3.Connection]
) -> None:
    """Close a thread's connection and queue descriptor. Closing is a call
    into SQLite like any statement, so it passes through the fork `gate`: a
    thread that ends while another forks must not be inside SQLite (holding
    its mutexes) when the fork copies it, and its connection, still in
    `opened`, is closed by the fork itself. None: the forking thread, which
    holds the gate."""
    if os.getpid() != pid:
        _INHERITED.append(conn)
        return
    if gate is not None:
        gate.enter()
    try:
        with contextlib.suppress(sqlite3.Error):
            conn.close()
        opened.discard(conn)
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        fds.clear()
    finally:
        if gate is not None:
            gate.leave()


class ForkGate:
    """Statements in flight on one engine, so that a fork() can wait for
    them: a child must never inherit SQLite mid-statement (its locks, its
    mutexes) nor any of this file's connections. `hold` waits until none is
    in flight and keeps new ones out until `reopen`.

    Each statement passes through it twice a request, so the way through
    takes no lock: a statement in flight is one item of `inflight` (list
    append and pop are atomic), added before `forking` is read and removed
    before it is read again. A `hold` that sets `forking` under the lock
    then either sees the item or is told, under the lock, when it goes.

    >>> gate = ForkGate()
    >>> gate.enter(); len(gate.inflight)
    1
    >>> gate.leave(); gate.hold(0.1)
    True
    >>> gate.reopen()
    """

    __slots__ = ("forking", "idle", "inflight", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.inflight: list[None] = []
        self.forking = False

    def enter(self) -> None:
        self.inflight.append(None)
        if self.forking:
            self._wait_out_the_fork()

    def _wait_out_the_fork(self) -> None:
        # A fork is waiting or under way: step out, and come back in once it is done.
        self.leave()
        with self.lock:
            while self.forking:
                self.idle.wait()
            self.inflight.append(None)

    def leave(self) -> None:
        self.inflight.pop()
        if self.forking:
            with self.lock:
                self.idle.notify_all()

    def hold(self, timeout_s: float) -> bool:
        """Keep new statements out; True once none is in flight, False if
        some still are after `timeout_s` (a statement stuck behind another
        process's writer)."""
        self.lock.acquire()
        self.forking = True
        deadline = time.monotonic() + timeout_s
        while self.inflight:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.idle.wait(left)
        return True

    def reopen(self) -> None:
        self.forking = False
        self.idle.notify_all()
        self.lock.release()


class ForkCompanion(Protocol):
    """Per-process state beside the connections (group commit's queue) that
    a fork must find at rest, and that a child starts afresh."""

    def hold_for_fork(self) -> None: ...

    def release_after_fork(self) -> None: ...

    def restart_in_child(self) -> None: ...


# Every file-backed engine's connections in this process, for the fork hooks below.
_ALL: weakref.WeakSet[Connections] = weakref.WeakSet()
# Ledger files this process must not use, and why: it was forked while the
# parent was inside SQLite for them, so SQLite's per-process state for the
# file was copied mid-statement (a new connection here would share it).
# Inherited by this process's own children, who share the same state.
_UNSAFE_FILES: dict[str, str] = {}
_FORKING: list[Connections] = []


def _before_fork() -> None:
    # Runs in the forking thread just before fork(), in the parent.
    every = list(_ALL)
    for connections in every:
        connections.quiesce_for_fork()
    _FORKING[:] = every


def _after_fork_in_parent() -> None:
    every, _FORKING[:] = list(_FORKING), []
    for connections in every:
        connections.resume_after_fork()


def _after_fork_in_child() -> None:
    every, _FORKING[:] = list(_FORKING), []
    for connections in every:
        connections.start_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


class Connections:
    """The connections of one engine in this process: `slot` is the calling
    thread's, opened by `connect` on first use. Every statement runs between
    `gate.enter()` and `gate.leave()`; a listing open on a private
    connection is counted between `stream_opened` and `stream_closed`."""

    def __init__(
        self,
        path: str,
        connect: Callable[[], sqlite3.Connection],
        busy_timeout_ms: int,
        *,
        memory: bool,
        companion: ForkCompanion,
    ) -> None:
        self.path = path
        self._connect = connect
        self._busy_timeout_ms = busy_timeout_ms
        self._companion = companion
        self._local = threading.local()
        self.lock = threading.Lock()
        self.gate = ForkGate()
        self._finalizers: list[weakref.finalize] = []  # type: ignore[type-arg]
        # Every thread's connection until it is closed, including one whose
        # thread is ending (its finalizer gone from `_finalizers`).
        self._opened: set[sqlite3.Connection] = set()
        self._streams = 0  # listings being read (each on a private connection)
        self._streams_at_fork = 0
        self._drained_at_fork = True
        # Why these connections cannot be used in this process (a child
        # forked while the parent was inside SQLite for this file), or None.
        self.unusable: str | None = None if memory else _UNSAFE_FILES.get(os.path.realpath(path))
        if not memory:
            _ALL.add(self)

    def slot(self) -> Slot:
        local = self._local
        slot: Slot | None = getattr(local, "slot", None)
        pid = os.getpid()
        if slot is not None and slot.pid == pid:
            return slot
        if self.unusable is not None:
            raise StorageError(self.unusable)
        conn = self._connect()
        self._opened.add(conn)
        slot = Slot(conn, pid)
        finalizer = weakref.finalize(slot, _release, conn, slot.fds, pid, self.gate, self._opened)
        with self.lock:
            if len(self._finalizers) > 64:
                self._finalizers = [f for f in self._finalizers if f.alive]
            self._finalizers.append(finalizer)
        local.slot = slot
        return slot

    def stream_opened(self) -> None:
        with self.lock:
            self._streams += 1

    def stream_closed(self) -> None:
        with self.lock:
            self._streams -= 1

    def close(self) -> None:
        """Close every thread's connection; each opens a new one at its next statement."""
        with self.lock:
            finalizers, self._finalizers = self._finalizers, []
        for finalizer in finalizers:
            finalizer()
        self._local = threading.local()

    # -- fork -----------------------------------------------------------------------
    def quiesce_for_fork(self) -> None:
        drained = self.gate.hold(self._busy_timeout_ms / 1000 + 1)
        self.lock.acquire()
        self._companion.hold_for_fork()
        if drained:
            for finalizer in self._finalizers:
                found = finalizer.detach()
                if found is not None:
                    stale, _, (conn, fds, pid, _gate, opened), _ = found
                    stale.pid = -1  # the thread's slot is stale: it reconnects
                    _release(conn, fds, pid, None, opened)  # this thread holds the gate
            self._finalizers = []
            # A thread ending right now: its finalizer has run, and its close
            # waits for this fork at the gate. A connection left open here
            # would be copied into the child, where SQLite would take the
            # parent's locks for its own and let both write at once.
            for conn in list(self._opened):
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
            self._opened.clear()
        self._drained_at_fork = drained
        self._streams_at_fork = self._streams

    def resume_after_fork(self) -> None:
        self._companion.release_after_fork()
        self.lock.release()
        self.gate.reopen()

    def start_in_child(self) -> None:
        # Fresh locks: the parent's threads that held or waited on them are not here.
        self._companion.restart_in_child()
        self.lock = threading.Lock()
        self.gate = ForkGate()
        self._streams = 0
        self._finalizers = []  # the parent's, when it could not close them: never ours to close
        self._opened = set()
        why = None
        if not self._drained_at_fork:
            why = "a statement on it had been running for over the busy timeout"
        elif self._streams_at_fork:
            why = "it was being listed (pending rows, a stream)"
        if why is not None:
            self.unusable = _UNSAFE_FILES[os.path.realpath(self.path)] = (
                f"this process was forked while {why} in the parent process, so SQLite's state for "
                f"{self.path} was copied into this one and no connection to it is safe here: fork when no "
                "listing is open and no write is stuck, or open the ledger only after fork (in each child)"
            )
