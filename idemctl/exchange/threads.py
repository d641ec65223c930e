"""Blocking work handed from an event loop to a worker thread, and its
result handed straight back to the loop (the ASGI middleware's and FastAPI's
SQLite statements, which must never block the loop)."""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

T = TypeVar("T")


def hand_off(executor: Executor | None, fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
    """`fn(*args, **kwargs)` in a thread of `executor` (None: the running
    loop's default executor), awaitable on the loop; it runs in a copy of the
    caller's context, as with asyncio.to_thread (the ledger's event listeners
    there see the request's current span), and runs to its end even if its
    awaiter is cancelled.

    >>> import asyncio
    >>> async def main():
    ...     return await hand_off(None, sum, [1, 2, 3])
    >>> asyncio.run(main())
    6
    """
    loop, run = asyncio.get_running_loop(), contextvars.copy_context().run
    if executor is None:
        executor = getattr(loop, "_default_executor", None)
        if executor is None:  # the loop makes its default executor on first use
            return loop.run_in_executor(None, functools.partial(run, fn, *args, **kwargs))
    # The worker hands the result straight back to the loop: no concurrent
    # future chained to an asyncio one (run_in_executor's wrap_future), a
    # third of a hand-off's cost.
    future: asyncio.Future[T] = loop.create_future()
    executor.submit(_hand_back, loop, future, run, fn, args, kwargs)
    return future


def _hand_back(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    run: Callable[..., Any],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """In the worker thread: `fn`, its result or exception then set on
    `future` by the loop."""
    try:
        result = run(fn, *args, **kwargs)
    except BaseException as exc:  # the awaiter raises it, as run_in_executor's would
        loop.call_soon_threadsafe(_settle, future, None, exc)
    else:
        loop.call_soon_threadsafe(_settle, future, result, None)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


__all__ = ["hand_off"]
