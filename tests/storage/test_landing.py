"""A store's write awaited without a task of its own (idemctl/landing.py):
it runs in the request's task; a request cancelled while its statement is
on the wire raises at once while the write lands in a task of its own; a
cancellation before that reaches the write as in any task; and the
statement's bound (storage/deadlines.py) holds in either task. And a task
awaited as asyncio.shield awaits it (`Outlasting`), with no outer future."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from idemctl.landing import Landing, Outlasting
from idemctl.storage.deadlines import DEADLINE, ON_THE_WIRE, Deadlines


async def sent(server: asyncio.Future[str], seen: list[Any] | None = None) -> str:
    """A statement on the wire until `server` answers, as an engine awaits one
    (`seen` gets the task that finished it)."""
    ON_THE_WIRE.set(True)
    answer = await server
    if seen is not None:
        seen.append(asyncio.current_task())
    return answer


async def cancelled_mid_write(
    landing: Landing[Any], *, before: Callable[[], object] = lambda: None, messages: tuple[str | None, ...] = (None,)
) -> Any:
    """The request awaiting `landing`, cancelled (after `before`, once per
    message) once its write is under way: it raises at once; returns the
    task finishing the write."""
    request = asyncio.ensure_future(landing.wait())
    await asyncio.sleep(0.01)
    before()
    for message in messages:
        request.cancel(message)
    with pytest.raises(asyncio.CancelledError):
        await request
    assert landing.rest is not None
    return landing.rest


def test_a_write_runs_in_the_task_that_awaits_it_and_returns_its_result() -> None:
    async def scenario() -> tuple[bool, str, int]:
        tasks: list[asyncio.Task[Any] | None] = []

        async def write() -> str:
            tasks.append(asyncio.current_task())
            await asyncio.sleep(0)  # a bare yield
            await asyncio.sleep(0.01)  # a future
            tasks.append(asyncio.current_task())
            return "landed"

        result = await Landing(write())
        return all(t is asyncio.current_task() for t in tasks), result, len(asyncio.all_tasks())

    assert asyncio.run(scenario()) == (True, "landed", 1)


def test_a_write_that_fails_raises_its_own_error_where_it_is_awaited() -> None:
    async def write() -> None:
        await asyncio.sleep(0.01)
        raise ValueError("refused by the server")

    async def scenario() -> None:
        await Landing(write())

    with pytest.raises(ValueError, match="refused by the server"):
        asyncio.run(scenario())


def test_a_request_cancelled_mid_write_raises_at_once_and_the_write_lands_in_a_task_of_its_own() -> None:
    async def scenario() -> tuple[float, bool, str, bool]:
        loop = asyncio.get_running_loop()
        server: asyncio.Future[str] = loop.create_future()  # what the driver waits on (asyncpg's waiter)
        finished_in: list[Any] = []
        landing = Landing(sent(server, finished_in))
        started = time.monotonic()
        rest = await cancelled_mid_write(landing)
        waited = time.monotonic() - started
        untouched = not server.done()  # the cancellation never reached the driver's future
        loop.call_later(0.02, server.set_result, "committed")
        return waited, untouched, await rest, finished_in == [rest]

    waited, untouched, landed, in_rest = asyncio.run(scenario())
    assert waited < 0.5 and untouched and landed == "committed" and in_rest


def test_a_statement_past_its_bound_fails_with_its_timeout_where_the_request_waits() -> None:
    async def scenario() -> tuple[bool, bool]:
        loop = asyncio.get_running_loop()
        deadlines = Deadlines(tick_s=0.01)
        server: asyncio.Future[str] = loop.create_future()
        try:
            await Landing(deadlines.within(0.05, server))
        except TimeoutError:
            timed_out = True
        else:
            timed_out = False
        current = asyncio.current_task()
        assert current is not None
        return timed_out, server.cancelled() and current.cancelling() == 0

    assert asyncio.run(scenario()) == (True, True)


def test_a_statement_bound_follows_the_write_into_the_task_that_finishes_it() -> None:
    async def scenario() -> tuple[bool, bool, float]:
        loop = asyncio.get_running_loop()
        deadlines = Deadlines(tick_s=0.01)
        server: asyncio.Future[str] = loop.create_future()  # a frozen server: never answers
        rest = await cancelled_mid_write(Landing(deadlines.within(0.2, sent(server))))
        started = time.monotonic()
        try:
            await rest
        except TimeoutError:
            timed_out = True
        else:
            timed_out = False
        return timed_out, server.cancelled(), time.monotonic() - started

    timed_out, cancelled, waited = asyncio.run(scenario())
    # The bound cancels the driver's future (asyncpg's cancel request) and the write fails with its timeout.
    assert timed_out and cancelled and waited < 1.0


def test_a_request_cancelled_on_a_bare_yield_hands_the_rest_over_too() -> None:
    async def scenario() -> str:
        async def write() -> str:
            ON_THE_WIRE.set(True)
            for _ in range(50):
                await asyncio.sleep(0)
            return "landed"

        landing = Landing(write())
        request = asyncio.ensure_future(landing.wait())
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        assert landing.rest is not None
        return await landing.rest

    assert asyncio.run(scenario()) == "landed"


def test_a_cancellation_before_the_statement_is_on_the_wire_reaches_the_write_as_in_any_task() -> None:
    async def scenario() -> tuple[bool, bool, bool]:
        loop = asyncio.get_running_loop()
        pool: asyncio.Future[str] = loop.create_future()  # waiting for a connection: nothing sent yet
        seen: list[str] = []

        async def write() -> str:
            try:
                return await pool
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise

        landing = Landing(write())
        request = asyncio.ensure_future(landing.wait())
        await asyncio.sleep(0.01)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        return pool.cancelled(), seen == ["cancelled"], landing.rest is None

    # The future it waited on is cancelled, the write saw it, and nothing is left to land.
    assert asyncio.run(scenario()) == (True, True, True)


def test_an_inner_timeout_before_the_statement_fires_as_it_would_in_a_task() -> None:
    async def scenario() -> str:
        loop = asyncio.get_running_loop()
        never: asyncio.Future[str] = loop.create_future()

        async def write() -> str:
            try:
                async with asyncio.timeout(0.02):  # how libraries bound a pool's wait on Python 3.12+
                    return await never
            except TimeoutError:
                return "timed out where it waited"

        return await Landing(write())

    assert asyncio.run(scenario()) == "timed out where it waited"


def test_a_request_cancelled_as_its_result_comes_in_still_hands_the_landed_write_over() -> None:
    async def scenario() -> str:
        server: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        # The request's wake-up is under way when the cancellation comes.
        rest = await cancelled_mid_write(Landing(sent(server)), before=lambda: server.set_result("committed"))
        return await rest

    assert asyncio.run(scenario()) == "committed"


def test_a_cancellation_delivered_again_and_again_hands_the_write_over_once() -> None:
    async def scenario() -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        server: asyncio.Future[str] = loop.create_future()
        # Three times, as anyio's cancel scopes deliver it until the task leaves.
        rest = await cancelled_mid_write(Landing(sent(server)), messages=(None, None, None))
        loop.call_later(0.01, server.set_result, "committed")
        tasks_left = len(asyncio.all_tasks())  # this one and the rest
        return await rest, tasks_left

    assert asyncio.run(scenario()) == ("committed", 2)


def test_an_error_the_awaited_future_ends_with_reaches_the_write_where_it_waits() -> None:
    async def scenario() -> str:
        loop = asyncio.get_running_loop()
        server: asyncio.Future[str] = loop.create_future()

        async def write() -> str:
            try:
                return await sent(server)
            except LookupError as exc:  # as a driver turns its protocol's error into its own
                return f"translated: {exc}"

        loop.call_later(0.01, server.set_exception, LookupError("lock timeout"))
        return await Landing(write())

    assert asyncio.run(scenario()) == "translated: lock timeout"


def test_a_bound_that_expires_before_the_rest_is_handed_over_still_reaches_the_statement() -> None:
    async def scenario() -> bool:
        server: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        # The request's own cancellation (kept from the statement), then the
        # statement's bound in the same turn of the loop.
        rest = await cancelled_mid_write(Landing(sent(server)), messages=(None, DEADLINE))
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(rest, 1.0)  # ended by the bound, not left waiting
        return server.cancelled()

    assert asyncio.run(scenario()) is True


def test_an_outlasted_task_gives_its_result_or_its_error_to_the_task_that_awaits_it() -> None:
    async def scenario() -> tuple[str, str, int]:
        async def fails() -> str:
            await asyncio.sleep(0.01)
            raise LookupError("the app failed")

        done = await Outlasting(asyncio.ensure_future(asyncio.sleep(0.01, "answered")))
        with pytest.raises(LookupError) as raised:
            await Outlasting(asyncio.ensure_future(fails()))
        finished = asyncio.ensure_future(asyncio.sleep(0, "already"))
        await asyncio.sleep(0.01)
        return done, str(raised.value), len(asyncio.all_tasks()) if await Outlasting(finished) == "already" else -1

    assert asyncio.run(scenario()) == ("answered", "the app failed", 1)


@pytest.mark.parametrize("deliveries", [1, 3], ids=["once", "again-and-again"])
def test_a_cancelled_waiter_raises_at_once_and_the_outlasted_task_runs_to_its_end(deliveries: int) -> None:
    async def scenario() -> tuple[float, bool, str]:
        work = asyncio.ensure_future(asyncio.sleep(0.2, "stored"))
        waiter = asyncio.ensure_future(Outlasting(work).wait())
        await asyncio.sleep(0.01)
        started = time.monotonic()
        for _ in range(deliveries):  # anyio's cancel scopes deliver it until the task leaves
            waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        raised_after = time.monotonic() - started
        return raised_after, work.cancelled(), await work

    raised_after, work_cancelled, result = asyncio.run(scenario())
    assert raised_after < 0.1
    assert (work_cancelled, result) == (False, "stored")


def test_a_waiter_cancelled_as_the_outlasted_task_ends_is_cancelled_and_the_task_keeps_its_result() -> None:
    async def scenario() -> tuple[bool, str]:
        loop = asyncio.get_running_loop()
        gate: asyncio.Future[str] = loop.create_future()

        async def app() -> str:
            return await gate

        work = asyncio.ensure_future(app())
        waiter = asyncio.ensure_future(Outlasting(work).wait())
        await asyncio.sleep(0.01)
        gate.set_result("stored")
        await asyncio.sleep(0)  # the work is done; the waiter's wake-up is under way
        assert work.done()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return waiter.cancelled(), work.result()

    assert asyncio.run(scenario()) == (True, "stored")
