"""Bounds on awaited store operations, kept by one watcher task per event
loop instead of a timer each.

A timer per operation (``asyncio.timeout``, ``asyncio.wait_for``) is a
heap entry that stays until it would have fired, seconds after the
operation ended, so at thousands of operations a second the loop's timer
heap holds thousands of them; ``wait_for`` also runs its operation as a
task of its own. Here an operation costs two dictionary writes, and a
watcher that runs only while operations are in flight cancels the ones
past their deadline, which then raise TimeoutError where they were
awaited, at most one tick late."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from contextvars import ContextVar
from typing import TypeVar

T = TypeVar("T")

TICK_S = 0.05
# The message of the cancellations the watcher sends: a write that outlives
# its request's cancellation (landing.py) lets this one through.
DEADLINE = "idemctl: past its deadline"


class Bound:
    """One awaited operation's deadline, and the task it cancels: the task
    that awaits it, or the one it was handed to (`hand_over`)."""

    __slots__ = ("due", "entered", "outer", "task")

    def __init__(self, task: asyncio.Task[object], due: float, outer: Bound | None) -> None:
        self.task, self.due, self.outer = task, due, outer
        self.entered = task.cancelling()


# The innermost bound of the operation this context awaits (None: none).
_ACTIVE: ContextVar[Bound | None] = ContextVar("idemctl_deadline", default=None)

# Whether this context awaits a statement already sent (or being sent): a
# cancellation now would leave its outcome unknown. Set by an engine around
# the statement alone (its pool checkout and connect are cut off safely),
# set back rather than reset by token, as _ACTIVE.
ON_THE_WIRE: ContextVar[bool] = ContextVar("idemctl_on_the_wire", default=False)


def hand_over(to: asyncio.Task[object]) -> None:
    """The operations the current task awaits are finished by `to` from now
    on (landing.py): their bounds cancel `to` when they expire."""
    current = asyncio.current_task()
    bound = _ACTIVE.get()
    while bound is not None:
        if bound.task is current:
            bound.task, bound.entered = to, 0
        bound = bound.outer


class Deadlines:
    """Deadlines of the operations awaited on one event loop.

    >>> async def slow_then_fast(deadlines):
    ...     try:
    ...         await deadlines.within(0.01, asyncio.sleep(5))
    ...     except TimeoutError:
    ...         late = "timed out"
    ...     return late, await deadlines.within(1.0, asyncio.sleep(0, "in time"))
    >>> asyncio.run(slow_then_fast(Deadlines()))
    ('timed out', 'in time')
    """

    def __init__(self, tick_s: float = TICK_S) -> None:
        self.tick_s = tick_s
        self._due: set[Bound] = set()
        self._expired: set[Bound] = set()
        self._watcher: asyncio.Task[None] | None = None

    async def within(self, seconds: float, work: Awaitable[T]) -> T:
        """`work`, awaited in the current task; TimeoutError once it has run
        `seconds` (a tick more at most). Another cancellation of the task
        is a cancellation still."""
        bound = self.enter(seconds)
        if bound is None:  # not in a task: nothing to cancel, so no bound
            return await work
        try:
            return await work
        except asyncio.CancelledError:
            if self.expired(bound):
                raise TimeoutError(f"no answer within {seconds:g} s") from None
            raise
        finally:
            self.leave(bound)

    # `within` in three calls, for an engine that awaits its statement in a
    # coroutine of its own anyway (one coroutine fewer a statement):
    # enter, then `expired` where the await raised CancelledError, and
    # `leave` once it is over (again is harmless).
    def enter(self, seconds: float) -> Bound | None:
        """Bound what the current task awaits next; None outside a task."""
        task = asyncio.current_task()
        if task is None:
            return None
        outer = _ACTIVE.get()
        # The monotonic clock, read here and by the watcher: what the default
        # loop's time() reads, without a Python call per statement.
        bound = Bound(task, time.monotonic() + seconds, outer)
        self._due.add(bound)
        # Set and set back, never reset by token: the operation may end in
        # another task (hand_over), whose context is a copy.
        _ACTIVE.set(bound)
        if self._watcher is None:
            self._watcher = task.get_loop().create_task(self._watch())
        return bound

    def expired(self, bound: Bound) -> bool:
        """Whether the CancelledError being handled is `bound`'s own (its
        deadline passed), not a cancellation of the task besides."""
        if bound in self._expired:
            self._expired.discard(bound)
            return bound.task.uncancel() <= bound.entered
        return False

    def leave(self, bound: Bound) -> None:
        self._due.discard(bound)
        self._expired.discard(bound)
        _ACTIVE.set(bound.outer)

    async def _watch(self) -> None:
        try:
            while self._due:
                await asyncio.sleep(self.tick_s)
                now = time.monotonic()
                for bound in list(self._due):
                    if bound.due <= now and bound not in self._expired:
                        self._expired.add(bound)
                        bound.task.cancel(DEADLINE)
        finally:
            self._watcher = None
