"""The writer queue: an exclusive ``flock`` on ``<db>-idemctl.lock`` around
every write, so that writers of every process take turns in the kernel.

SQLite's own busy handler polls with growing sleeps and grants the lock to
whoever happens to poll right after it is freed, so under several writer
processes one request could wait for seconds while others went through;
blocked ``flock`` waiters are woken the moment the lock is released and take
turns. Correctness never depends on the queue (the SQLite lock still
decides), so any failure to open or lock the file falls back to SQLite
alone."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; SQLite's own busy handler is all there is
    fcntl = None  # type: ignore[assignment]

from .connections import UNOPENED, Slot

# Combined once: every write takes and gives back the lock.
if fcntl is not None:
    _TAKE_IF_FREE, _TAKE, _GIVE_BACK = fcntl.LOCK_EX | fcntl.LOCK_NB, fcntl.LOCK_EX, fcntl.LOCK_UN

# The writer queue's lock file sits next to the ledger: `<db>-idemctl.lock`.
WRITE_QUEUE_SUFFIX = "-idemctl.lock"


def queue_path(path: str, wanted: bool) -> str | None:
    """The lock file of the ledger at `path`, or None where there is no queue
    (not `wanted`, or no flock on this platform)."""
    return str(Path(path).resolve()) + WRITE_QUEUE_SUFFIX if wanted and fcntl is not None else None


class WriterQueue:
    """One ledger's writer queue, entered through a thread's `Slot` (each
    thread's descriptor is its own open file description: flock excludes
    descriptions, so threads of one process queue exactly like processes do)."""

    __slots__ = ("busy_timeout_ms", "mode", "path")

    def __init__(self, path: str | None, busy_timeout_ms: int, mode: Callable[[], int]) -> None:
        self.path = path  # None: no queue, SQLite alone decides
        self.busy_timeout_ms = busy_timeout_ms
        self.mode = mode  # the lock file's permission bits, asked when it is created

    def _open(self, slot: Slot) -> int | None:
        """This thread's descriptor on the lock file, opened at its first write
        (so read-only use never creates the file)."""
        if self.path is None:
            return None
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
        try:
            try:
                mode = self.mode()
                fd = os.open(self.path, flags | os.O_CREAT | os.O_EXCL, mode)
                os.fchmod(fd, mode)  # exactly the ledger's bits, whatever the umask
            except FileExistsError:
                fd = os.open(self.path, flags)
        except OSError:
            return None  # e.g. a directory we may not create files in: SQLite's busy handler alone
        slot.fds.append(fd)
        return fd

    def enter(self, slot: Slot) -> tuple[int | None, bool]:
        """Wait for this database's writer queue; returns (fd to unlock, shortened).

        The wait in flock counts against the busy timeout: once the lock is
        ours, SQLite gets only what is left of it, so a queue stuck behind a
        foreign writer fails within about one busy timeout, not one per
        waiter. Waits under a tenth of the timeout (the normal turn-taking
        of a busy ledger) are not deducted: that keeps two PRAGMA statements
        out of every contended turn, at the price of failing up to 10% late."""
        fd = slot.queue_fd
        if fd == UNOPENED:
            fd = slot.queue_fd = self._open(slot)
        if fd is None:
            return None, False
        try:
            # A free queue (the usual case) is taken without timing a wait
            # that did not happen.
            fcntl.flock(fd, _TAKE_IF_FREE)
            return fd, False
        except BlockingIOError:
            pass
        except OSError:  # e.g. ENOLCK on a file system without flock: SQLite alone decides
            return None, False
        started = time.monotonic()
        try:
            fcntl.flock(fd, _TAKE)
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

    def leave(self, slot: Slot, fd: int | None, shortened: bool) -> None:
        if fd is None:
            return
        # Unlock first: restoring the timeout is this thread's own business
        # and need not keep the next writer waiting.
        fcntl.flock(fd, _GIVE_BACK)
        if shortened:
            slot.conn.execute(f"PRAGMA busy_timeout = {self.busy_timeout_ms}")
