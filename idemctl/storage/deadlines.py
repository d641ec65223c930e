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
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

TICK_S = 0.05


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
        self._due: dict[asyncio.Task[object], float] = {}
        self._expired: set[asyncio.Task[object]] = set()
        self._watcher: asyncio.Task[None] | None = None

    async def within(self, seconds: float, work: Awaitable[T]) -> T:
        """`work`, awaited in the current task; TimeoutError once it has run
        `seconds` (a tick more at most). Another cancellation of the task
        is a cancellation still."""
        task = asyncio.current_task()
        if task is None:  # not in a task: nothing to cancel, so no bound
            return await work
        loop = task.get_loop()
        outer = self._due.get(task)
        self._due[task] = loop.time() + seconds
        if self._watcher is None:
            self._watcher = loop.create_task(self._watch(loop))
        entered = task.cancelling()
        try:
            return await work
        except asyncio.CancelledError:
            if task in self._expired:
                self._expired.discard(task)
                if task.uncancel() <= entered:
                    raise TimeoutError(f"no answer within {seconds:g} s") from None
            raise
        finally:
            if outer is None:
                self._due.pop(task, None)
            else:
                self._due[task] = outer

    async def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            while self._due:
                await asyncio.sleep(self.tick_s)
                now = loop.time()
                for task, due in list(self._due.items()):
                    if due <= now and task not in self._expired:
                        self._expired.add(task)
                        task.cancel()
        finally:
            self._watcher = None
