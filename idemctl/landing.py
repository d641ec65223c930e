"""A store's write awaited in the calling task, without a task of its own,
and still never cut off half-way by a cancelled request.

A claim cut off by a cancelled request would leave its outcome unknown: it
may have committed, and nobody could release it. Running every write as a
task of its own behind ``asyncio.shield`` keeps it whole, but costs a task,
a shield and three more turns of the event loop on every request, though
almost none is ever cancelled. :class:`Landing` drives the write's
coroutine itself instead. For each future the write waits on, the task is
handed a stand-in (asyncio's protocol for a future-like object) that puts
the task's wake-up on that very future, so a request costs no more turns of
the loop than a plain await, and takes the task's cancellation, which
therefore never reaches the driver's own future unasked (asyncpg would send
the server a cancel request). While the engine says a statement is on the
wire (deadlines.ON_THE_WIRE), the task is woken at once instead and the
rest of the write is handed to a new task (`rest`), the request's
cancellation is raised at once, as a shield raises it, and the caller
settles what lands. Before that (a pool checkout, a connect, their own
timeouts) a cancellation goes through to the work as it would in a task:
nothing is sent yet, nothing to settle. A statement's own bound
(storage/deadlines.py) follows the write into that task; one that expires
while the request still waits goes through as it would have: the write
fails with its timeout. Only an engine that marks its statements so
(`lands_in_place`) is awaited this way; the others keep a task and a
shield per write.

>>> import asyncio
>>> from idemctl.storage.deadlines import ON_THE_WIRE
>>> async def write():
...     ON_THE_WIRE.set(True)  # as an engine does around a statement
...     await asyncio.sleep(0.05)
...     return "landed"
>>> async def cancel_mid_write():
...     landing = Landing(write())
...     request = asyncio.ensure_future(landing.wait())
...     await asyncio.sleep(0.01)
...     request.cancel()
...     try:
...         await request
...     except asyncio.CancelledError:
...         return await landing.rest
>>> asyncio.run(cancel_mid_write())
'landed'
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Generator
from typing import Any, Generic, TypeVar

from .storage.deadlines import DEADLINE, ON_THE_WIRE, hand_over

T = TypeVar("T")


class Landing(Generic[T]):
    """`work` driven by whichever task awaits this (see the module); once
    that task is cancelled mid-way, `rest` is the task that finishes it."""

    __slots__ = ("rest", "work")

    def __init__(self, work: Coroutine[Any, Any, T]) -> None:
        self.work = work
        self.rest: asyncio.Future[T] | None = None

    async def wait(self) -> T:
        """The work's result (the same as awaiting the Landing)."""
        return await self

    def __await__(self) -> Generator[Any, None, T]:
        work = self.work
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                waited = work.send(value) if error is None else work.throw(error)
            except StopIteration as done:
                result: T = done.value
                return result
            value = error = None
            if waited is None:  # a bare yield: one turn of the loop
                try:
                    yield None
                except asyncio.CancelledError as exc:
                    if exc.args[:1] != (DEADLINE,) and ON_THE_WIRE.get():
                        self._hand_over(None)
                        raise
                    error = exc  # as a Task would: into the work
                continue
            # The task waits on the work's own future, through a stand-in
            # that takes the task's cancellation (see _Waiting). As a Task
            # would, the future is marked taken (so it can be awaited again).
            waited._asyncio_future_blocking = False
            waiting = _Waiting(waited, ON_THE_WIRE.get())
            try:
                yield waiting
            except BaseException as exc:
                if waiting.intercepted:
                    self._hand_over(waited)
                    raise
                # The future's own error (the task throws what it ended with),
                # or a cancellation that reached it: into the work, as a Task would.
                error = exc

    def _hand_over(self, waited: asyncio.Future[Any] | None) -> None:
        rest: asyncio.Task[T] = asyncio.ensure_future(_Resumed(self.work, waited).wait())
        hand_over(rest)
        self.rest = rest


class _Waiting:
    """What the task waits on while the work waits on `waited`: the task
    registers its wake-up on `waited` itself (no extra turn of the loop),
    and its cancellation comes here. The statement's bound, or any
    cancellation while nothing is on the wire (an inner timeout, a request
    cancelled while waiting for a connection), goes on to `waited`, as in
    any task. A request's cancellation while the statement is on the wire
    is kept from it: the task is woken with a cancelled future of its own
    instead, and `intercepted` tells the Landing to hand the rest over."""

    __slots__ = ("_asyncio_future_blocking", "context", "intercepted", "on_the_wire", "waited", "wakeup")

    def __init__(self, waited: asyncio.Future[Any], on_the_wire: bool) -> None:
        self.waited = waited
        self.on_the_wire = on_the_wire
        self.intercepted = False
        self.wakeup: Any = None
        self.context: Any = None
        self._asyncio_future_blocking = True  # a future to wait on, for the task (asyncio.isfuture's mark)

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self.waited.get_loop()

    def add_done_callback(self, fn: Any, *, context: Any = None) -> None:
        self.wakeup, self.context = fn, context
        self.waited.add_done_callback(fn, context=context)

    def cancel(self, msg: Any = None) -> bool:
        waited = self.waited
        if msg == DEADLINE or not self.on_the_wire:
            # Even once intercepted: a bound that expires before the rest is
            # handed over must still reach the statement.
            return waited.cancel(msg)
        return self.intercept(msg)

    def intercept(self, msg: Any) -> bool:
        """Wake the task with a cancelled future of its own; `waited` runs on."""
        if self.intercepted:
            return True  # delivered again (anyio's cancel scopes): the task is woken already
        self.intercepted = True
        waited = self.waited
        if waited.done():
            return False  # its wake-up is under way: the task raises the cancellation there
        waited.remove_done_callback(self.wakeup)
        woken: asyncio.Future[None] = waited.get_loop().create_future()
        woken.cancel(msg)
        waited.get_loop().call_soon(self.wakeup, woken, context=self.context)
        return True


class Outlasting(Generic[T]):
    """A task awaited as ``asyncio.shield`` awaits it: a cancellation of the
    awaiting task raises there at once and never reaches `task`, which runs
    on. The awaiting task's wake-up goes on `task` itself (the stand-in
    below), so this costs no outer future and no extra turn of the loop.

    >>> async def cancelled_while_waiting():
    ...     work = asyncio.ensure_future(asyncio.sleep(0.02, "done"))
    ...     waiter = asyncio.ensure_future(Outlasting(work).wait())
    ...     await asyncio.sleep(0.01)
    ...     waiter.cancel()
    ...     try:
    ...         await waiter
    ...     except asyncio.CancelledError:
    ...         return await work
    >>> asyncio.run(cancelled_while_waiting())
    'done'
    """

    __slots__ = ("task",)

    def __init__(self, task: asyncio.Future[T]) -> None:
        self.task = task

    async def wait(self) -> T:
        return await self

    def __await__(self) -> Generator[Any, None, T]:
        task = self.task
        if not task.done():
            yield _Kept(task, True)  # woken once it is done, or cancelled (raised here)
        return task.result()


class _Kept(_Waiting):
    """A stand-in that keeps every cancellation from the task it waits on."""

    __slots__ = ()

    def cancel(self, msg: Any = None) -> bool:
        return self.intercept(msg)


class _Resumed(Generic[T]):
    """The rest of a work suspended on `waited` (None: on a bare yield)."""

    __slots__ = ("waited", "work")

    def __init__(self, work: Coroutine[Any, Any, T], waited: asyncio.Future[Any] | None) -> None:
        self.work, self.waited = work, waited

    async def wait(self) -> T:
        return await self

    def __await__(self) -> Generator[Any, None, T]:
        waited = self.waited
        if waited is not None and not waited.done():
            # This task's cancellation (the bound) cancels `waited` itself now;
            # whatever `waited` ends with, the work reads it.
            with contextlib.suppress(BaseException):
                yield from waited.__await__()
        return (yield from self.work.__await__())


__all__ = ["Landing", "Outlasting"]
