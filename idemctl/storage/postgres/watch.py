"""The commit timeout: no statement waits without bound for its commit.

With synchronous replication PostgreSQL commits a write locally, then waits
inside the commit for a synchronous standby to acknowledge it, after the
statement itself: `statement_timeout` does not end that wait, and a cancel
request ends it by reporting success (with a WARNING that the transaction
"has already committed locally, but might not have been replicated"). With
the standby gone, every write would wait for as long as it stays gone.

So the engine bounds each statement itself, its commit included: a statement
still running `timeout_s` after it started is cancelled, and whatever it
returns afterwards (an error, or that success) is thrown away: its
connection is closed and its caller gets CommitTimeoutError, a 503 from the
adapters. A commit whose wait was cancelled is never reported done. If the
statement has not ended `grace_s` after the cancel request (a cancel that
cannot reach the server), the connection's socket is shut down, which ends
the wait in the client: a caller has its answer within `timeout_s +
grace_s` (plus the scheduling of a busy machine).

One watcher per engine: a thread for the synchronous pool (started with the
first statement, gone after a minute without any), timer callbacks on the
event loop for the asynchronous one. A statement costs a clock read, a dict
entry and (threads) an uncontended lock, never a thread or a timer of its
own; a cancel request is sent
from a short-lived thread (or task) only when a statement is overdue."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
from time import monotonic
from typing import Any

import psycopg

from ...errors import CommitTimeoutError

log = logging.getLogger("idemctl")

# How long a cancelled statement has to end before its socket is shut down.
CANCEL_GRACE_S = 1.0
# A watcher thread with nothing to watch for this long ends (the next
# statement starts another).
IDLE_EXIT_S = 60.0


def _cut(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """Shut down the connection's socket: a client blocked on it wakes with
    an error. Only the socket is shut down; its descriptor stays the
    connection's until the connection is closed."""
    try:
        dup = os.dup(conn.pgconn.socket)
    except Exception:
        return  # closed meanwhile: nothing left to wake
    # The duplicate descriptor is the socket object's to close; shutting it
    # down shuts down the one socket both descriptors refer to.
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return
    with sock, contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class Overdue:
    """A statement the watcher cancelled: when its socket is cut if it has
    not ended, and whether its cancel request is over."""

    __slots__ = ("cut", "cut_at", "settled", "task")

    def __init__(self, cut_at: float) -> None:
        self.cut_at = cut_at
        self.cut = False
        self.settled = threading.Event()
        self.task: asyncio.Task[None] | None = None


class _Watch:
    def __init__(self, timeout_s: float, where: str) -> None:
        self.timeout_s = timeout_s
        self.where = where
        # A cancelled statement gets at most as long again to end: a watcher
        # that sleeps until the next deadline then never oversleeps one.
        self.grace_s = min(CANCEL_GRACE_S, timeout_s)
        self.running: dict[Any, float] = {}  # connection -> when its statement started
        self.overdue: dict[Any, Overdue] = {}  # connection -> its cancelled statement

    def error(self) -> CommitTimeoutError:
        return CommitTimeoutError(self.where, self.timeout_s)

    def _scan(self, now: float) -> tuple[list[tuple[Any, Overdue]], float | None]:
        """Claims the statements past their deadline (they leave `running`)
        and cuts the sockets of those cancelled past their grace; the newly
        overdue, and when to look again (None: nothing to watch)."""
        wake: float | None = None
        late: list[tuple[Any, Overdue]] = []
        timeout = self.timeout_s
        for conn, started in list(self.running.items()):
            due = started + timeout
            if due <= now:
                del self.running[conn]
                claim = self.overdue[conn] = Overdue(now + self.grace_s)
                late.append((conn, claim))
                due = claim.cut_at
            wake = due if wake is None or due < wake else wake
        for conn, claim in self.overdue.items():
            if claim.cut:
                continue
            if claim.cut_at <= now:
                claim.cut = True
                log.warning("a cancelled statement on %s did not end; cutting its connection", self.where)
                _cut(conn)
            elif wake is None or claim.cut_at < wake:
                wake = claim.cut_at
        return late, wake


class CommitWatch(_Watch):
    """The watcher of a synchronous engine's statements, shared by its threads.

    >>> watch = CommitWatch(2.0, "postgresql://app@db/payments")
    >>> conn = object(); watch.watch(conn); watch.release(conn) is None
    True
    >>> watch.close()
    """

    def __init__(self, timeout_s: float, where: str) -> None:
        super().__init__(timeout_s, where)
        # Taken to claim a statement and to end one, so the watcher never
        # cancels a statement that has ended (its connection may run
        # another by then).
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._wake = threading.Event()

    def watch(self, conn: Any) -> None:
        """`conn` starts a statement."""
        self.running[conn] = monotonic()
        if self._thread is None:
            self._start()

    def release(self, conn: Any) -> Overdue | None:
        """`conn`'s statement ended: None if in time; else it was cancelled
        and, whatever it returned, counts as failed (see `retire`)."""
        with self._lock:
            if self.running.pop(conn, None) is not None:
                return None
            return self.overdue.pop(conn, None)

    def retire(self, conn: psycopg.Connection[Any], claim: Overdue) -> None:
        """Close the connection of a cancelled statement, once its cancel
        request is over (it is made from the connection): a late cancel must
        not reach whatever the connection would run next."""
        claim.settled.wait(self.grace_s)
        with contextlib.suppress(Exception):
            conn.close()

    def close(self) -> None:
        """The thread ends once nothing is left to watch."""
        self._closing = True
        self._wake.set()

    def forked(self) -> CommitWatch:
        """A watcher for a forked child: the parent's thread is not in it."""
        return CommitWatch(self.timeout_s, self.where)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._closing = False
                thread = threading.Thread(target=self._loop, name="idemctl-commit-watch", daemon=True)
                self._thread = thread
                thread.start()

    def _loop(self) -> None:
        me = threading.current_thread()
        idle_since = monotonic()
        while True:
            now = monotonic()
            with self._lock:
                late, wake = self._scan(now)
            for conn, claim in late:
                cancel = threading.Thread(target=_cancel, args=(conn, claim, self.grace_s), name="idemctl-cancel")
                cancel.daemon = True
                cancel.start()
            if wake is not None:
                idle_since = now
            elif self._closing or now - idle_since >= IDLE_EXIT_S:
                # Leave, unless a statement started meanwhile: it saw this
                # thread and started none (see watch()).
                self._thread = None
                if not self.running:
                    return
                with self._lock:
                    if self._thread is not None:
                        return
                    self._thread = me
                continue
            # A statement that starts while this one sleeps is due after a
            # whole timeout, never before `wake`.
            self._wake.wait((wake if wake is not None else now + min(self.timeout_s, IDLE_EXIT_S)) - now)
            self._wake.clear()


def _cancel(conn: psycopg.Connection[Any], claim: Overdue, timeout_s: float) -> None:
    try:
        conn.cancel_safe(timeout=timeout_s)
    except Exception as exc:
        log.debug("cancelling an overdue statement failed: %s", exc)
    finally:
        claim.settled.set()


class AsyncCommitWatch(_Watch):
    """The watcher of an asynchronous engine's statements, on its event loop:
    one timer for all of them, armed while any runs."""

    def __init__(self, timeout_s: float, where: str) -> None:
        super().__init__(timeout_s, where)
        self._timer: asyncio.TimerHandle | None = None

    def watch(self, conn: Any) -> None:
        self.running[conn] = monotonic()
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.timeout_s, self._check)

    def release(self, conn: Any) -> Overdue | None:
        if self.running.pop(conn, None) is not None:
            return None
        return self.overdue.pop(conn, None)

    async def retire(self, conn: psycopg.AsyncConnection[Any], claim: Overdue) -> None:
        if claim.task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(claim.task), self.grace_s)
        with contextlib.suppress(Exception):
            await conn.close()

    def _check(self) -> None:
        self._timer = None
        now = monotonic()
        late, wake = self._scan(now)
        loop = asyncio.get_running_loop()
        for conn, claim in late:
            claim.task = loop.create_task(_cancel_async(conn, claim, self.grace_s))
        if wake is not None:
            self._timer = loop.call_later(max(wake - now, 0.0), self._check)

    def close(self) -> None:
        """Stop watching (the engine's pool is closed or its loop gone)."""
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        self.running.clear()
        self.overdue.clear()


async def _cancel_async(conn: psycopg.AsyncConnection[Any], claim: Overdue, timeout_s: float) -> None:
    try:
        await conn.cancel_safe(timeout=timeout_s)
    except Exception as exc:
        log.debug("cancelling an overdue statement failed: %s", exc)
    finally:
        claim.settled.set()
