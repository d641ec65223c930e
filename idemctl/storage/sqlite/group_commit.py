"""Group commit: write statements that threads of one process issue at the
same time are committed together, in one transaction and so one fsync of
the WAL.

A caller that finds no commit in progress runs its statement at once,
exactly as without group commit (so a single thread pays nothing);
statements that arrive meanwhile queue. When it is done, the first of them
leads: it takes what is queued (up to GROUP_COMMIT_MAX_BATCH statements),
takes one turn of the writer queue, runs them in arrival order (a failing
statement is undone by SQLite alone and fails only its own caller), commits,
and wakes their callers; a caller returns only once the commit that holds
its statement is done. A leader whose own statement is committed hands
leadership to the next waiter rather than working on for others."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections import deque
from collections.abc import Callable, Sequence

from ...errors import StorageError
from ..engine import Params, Rows

# At most this many statements share one transaction, so a leader's turn
# (and the queue's other processes) waits a bounded time.
GROUP_COMMIT_MAX_BATCH = 64


class Pending:
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


class GroupCommit:
    """The statements of one process waiting to be committed together, and
    what its commits made durable. A forked child starts afresh: the
    parent's waiters are not its own."""

    def __init__(
        self,
        path: str,
        lock: Callable[[], threading.Lock],
        write_alone: Callable[[str, Params], Rows],
        write_batch: Callable[[Sequence[tuple[str, Params]]], list[Rows | Exception]],
    ) -> None:
        self.path = path
        self._engine_lock = lock
        self._write_alone = write_alone
        self._write_batch = write_batch
        self._restart(os.getpid())

    def _restart(self, pid: int) -> None:
        self.pid = pid
        self.lock = threading.Lock()
        self.queue: deque[Pending] = deque()
        self.leading = False
        self.batches = 0  # commits made in this process (a lone statement counts as one)
        self.statements = 0  # statements those commits made durable

    def committed(self, statements: int) -> None:
        """One commit made `statements` statements durable."""
        self.batches += 1
        self.statements += statements

    # -- fork (see connections.py) ------------------------------------------------------
    def hold_for_fork(self) -> None:
        self.lock.acquire()

    def release_after_fork(self) -> None:
        self.lock.release()

    def restart_in_child(self) -> None:
        self._restart(os.getpid())

    def _this_process(self) -> None:
        if self.pid != os.getpid():
            # Forked without the fork hooks: the parent's waiters are not ours.
            with self._engine_lock():
                if self.pid != os.getpid():
                    self._restart(os.getpid())

    # -- writing ----------------------------------------------------------------------------
    def write(self, sql: str, params: Params) -> Rows:
        self._this_process()
        with self.lock:
            # No leader means nothing is queued: this statement is a batch of
            # one, and its caller leads without queueing anything.
            alone = not self.leading
            self.leading = True
            if not alone:
                mine = Pending(sql, params)
                self.queue.append(mine)
        if alone:
            try:
                rows = self._write_alone(sql, params)
                self.committed(1)
                return rows
            finally:
                self._pass_on()
        # Woken either because a leader committed our statement, or
        # because leadership was handed to us.
        try:
            mine.wake.acquire()
        except BaseException:
            self._abandon(mine, leading=False)
            raise
        while not mine.done:
            with self.lock:
                mine.lead = False
                batch = [self.queue.popleft() for _ in range(min(len(self.queue), GROUP_COMMIT_MAX_BATCH))]
            try:
                self._commit_batch(batch)
            except BaseException as exc:
                # The leader itself was interrupted (not a statement's error):
                # its batch-mates hear so rather than wait forever.
                for p in batch:
                    if p.error is None:
                        p.error = StorageError(f"a group commit on {self.path} was interrupted: {exc!r}")
                self._finish(batch, mine)
                self._abandon(mine, leading=True)
                raise
            self._finish(batch, mine)
        if mine.error is not None:
            raise mine.error
        return mine.rows

    def _pass_on(self) -> None:
        """A leader done with its own statement: the first waiter leads next."""
        with self.lock:
            if not self.queue:
                self.leading = False
                return
            successor = self.queue[0]
            successor.lead = True
        successor.wake.release()

    def _finish(self, batch: list[Pending], mine: Pending) -> None:
        """Wake the batch's callers; if statements are still queued, the
        leader goes on only for its own, else the next waiter leads."""
        successor: Pending | None = None
        with self.lock:
            for p in batch:
                p.done = True
            if not self.queue:
                self.leading = False
            elif mine.done:
                successor = self.queue[0]  # `leading` stays set: it is handed over
                successor.lead = True
        # The next leader first: its batch gets going while the others wake.
        if successor is not None:
            successor.wake.release()
        for p in batch:
            if p is not mine:
                p.wake.release()

    def _abandon(self, mine: Pending, *, leading: bool) -> None:
        """A caller interrupted while waiting or leading: its statement
        leaves the queue if no batch has it yet, and leadership it holds (or
        was just handed) passes on, so the others never wait for a leader
        that left."""
        successor: Pending | None = None
        with self.lock:
            if mine.done:
                return
            if mine in self.queue:
                self.queue.remove(mine)
            if leading or mine.lead:
                if self.queue:
                    successor = self.queue[0]
                    successor.lead = True
                else:
                    self.leading = False
        if successor is not None:
            successor.wake.release()

    def _commit_batch(self, batch: list[Pending]) -> None:
        """Run `batch` in one commit; each request's rows or error. Alone, a
        statement is exactly the auto-committed statement of a plain write."""
        if len(batch) == 1:
            p = batch[0]
            try:
                p.rows = self._write_alone(p.sql, p.params)
            except Exception as exc:  # e.g. OverflowError binding a parameter: its caller's alone
                p.error = exc
            else:
                self.committed(1)
            return
        outcomes = self._write_batch([(p.sql, p.params) for p in batch])
        for p, outcome in zip(batch, outcomes, strict=True):
            if isinstance(outcome, Exception):
                p.error = outcome
            else:
                p.rows = outcome


def write_together(conn: sqlite3.Connection, statements: Sequence[tuple[str, Params]]) -> list[Rows | Exception]:
    """Run `statements` in one transaction on `conn`: each one's rows, or the
    error it alone failed with. A failing statement is undone by SQLite itself
    (its statement journal) and the transaction goes on, so no savepoint per
    statement is needed. When the transaction as a whole fails (it cannot
    begin, or SQLite had to roll it back: disk full, I/O error), nothing is
    durable and that sqlite3.Error is raised."""
    try:
        conn.execute("BEGIN IMMEDIATE")
        outcomes: list[Rows | Exception] = []
        for sql, params in statements:
            try:
                outcomes.append(conn.execute(sql, params).fetchall())
            except Exception as exc:
                if not conn.in_transaction:
                    raise
                outcomes.append(exc)
        conn.execute("COMMIT")
        return outcomes
    except BaseException:
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        raise
