"""The asynchronous path on PostgreSQL: the ASGI middleware, the FastAPI
route class and async idempotent functions run every ledger statement as a
coroutine on the loop (on asyncpg, and on psycopg's AsyncConnection), never
in a worker thread, and every contract behaviour holds there: fencing,
takeover, waiting duplicates, 503 when the pool cannot connect, the
not-stored fallback, events, and cancellation. Each test makes any hand-off to a thread fail."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

import pytest
from fastapi import APIRouter, FastAPI, Request
from fastapi.testclient import TestClient

import idemctl.fastapi
from idemctl import Ledger, Outcome, Policy, decision
from idemctl.asgi import IdempotencyMiddleware
from idemctl.errors import StorageError
from idemctl.fastapi import idempotent_route
from idemctl.outcomes import Answer, Ticket
from idemctl.storage.aio import AsyncStore
from idemctl.storage.deadlines import ON_THE_WIRE
from tests.adapters.test_gate import ORDER, call, scope_for
from tests.conftest import pgbouncer_params
from tests.helpers import step_of

# PostgreSQL itself, and through PgBouncer (session and transaction pooling).
pytestmark = pytest.mark.parametrize("backend_name", pgbouncer_params(["postgres"]))


@pytest.fixture(autouse=True, params=["asyncpg", "psycopg"])
def async_driver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test on both asynchronous engines: asyncpg's (chosen when it is
    installed) and psycopg's (as where it is not)."""
    if request.param == "asyncpg":
        pytest.importorskip("asyncpg")
    else:
        from idemctl.storage.postgres import engine

        monkeypatch.setattr(engine, "_asyncpg_installed", lambda: False)
    return str(request.param)


class NoThreads(concurrent.futures.Executor):
    """An executor that fails the test if anything is handed to it."""

    def __init__(self) -> None:
        self.handed: list[object] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        self.handed.append(fn)
        raise AssertionError(f"a ledger step was handed to a thread: {fn!r}")


async def no_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    raise AssertionError(f"a ledger step was handed to a thread: {fn!r}")


async def begin_on_the_loop(ledger: Ledger) -> Ticket | Answer:
    """The ledger's decision, every statement awaited on the loop."""
    steps = ledger.begin_steps("acct_A", "k1", "POST", "/orders", [], ORDER)
    return await decision.run_async(steps, no_thread, store=ledger.async_store())


async def finish_on_the_loop(ledger: Ledger, ticket: Ticket, body: bytes) -> Answer:
    """The app's answer stored, every statement awaited on the loop."""
    steps = ledger.finish_steps(ticket, 201, [("content-type", "text/plain")], body)
    return await decision.run_async(steps, no_thread, store=ledger.async_store())


def orders_app(runs: list[bytes], status: int = 201) -> Callable[..., Any]:
    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        body = (await receive())["body"]
        runs.append(body)
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"made " + body})

    return app


def middleware(ledger: Ledger, runs: list[bytes]) -> tuple[IdempotencyMiddleware, NoThreads]:
    executor = NoThreads()
    app = IdempotencyMiddleware(orders_app(runs), ledger, principal=lambda scope: scope["user"], executor=executor)
    return app, executor


def test_asgi_first_call_replay_and_reuse_run_every_ledger_statement_on_the_loop(make_ledger):
    ledger = make_ledger()
    runs: list[bytes] = []
    seen: list[Any] = []
    ledger.subscribe(seen.append)
    app, executor = middleware(ledger, runs)

    async def scenario() -> list[tuple[int, bytes]]:
        first = await call(app, scope_for("k1"))
        await app.wait_idle()  # the post-response sweep, on the loop
        again = await call(app, scope_for("k1"))
        other = await call(app, scope_for("k1"), body=b'{"sku":"coffee"}')
        await ledger.aclose()
        return [first, again, other]

    first, again, other = asyncio.run(scenario())
    assert first == (201, b"made " + ORDER) and again == first
    assert other[0] == 409
    assert runs == [ORDER] and executor.handed == []
    assert [(e.outcome, e.status) for e in seen] == [
        (Outcome.EXECUTED, 201),
        (Outcome.REPLAYED, 201),
        (Outcome.REUSED, 409),
    ]
    row = ledger.lookup("acct_A", "k1")
    assert row is not None and (row.status.value, row.generation, row.response_status) == ("completed", 1, 201)
    # The sweep's probe ran and found nothing due: the next answer sweeps nothing.
    assert not ledger.sweep_due(Answer(201, (), b"", Outcome.EXECUTED, 1, ledger.now()))


def test_asgi_with_the_database_clock_asks_the_time_on_the_loop(make_ledger):
    ledger = make_ledger(clock_fn="database")
    runs: list[bytes] = []
    app, executor = middleware(ledger, runs)

    async def scenario() -> tuple[tuple[int, bytes], tuple[int, bytes]]:
        replies = await call(app, scope_for("k1")), await call(app, scope_for("k1"))
        await app.wait_idle()
        await ledger.aclose()
        return replies

    first, again = asyncio.run(scenario())
    assert first == again == (201, b"made " + ORDER)
    assert runs == [ORDER] and executor.handed == []


def test_asgi_fails_closed_with_503_when_the_async_pool_cannot_connect(make_ledger):
    ledger = Ledger.open("postgresql://postgres@127.0.0.1:1/test?connect_timeout=2")
    runs: list[bytes] = []
    seen: list[Any] = []
    ledger.subscribe(seen.append)
    app, executor = middleware(ledger, runs)

    async def scenario() -> tuple[int, bytes]:
        reply = await call(app, scope_for("k1"))
        await ledger.aclose()
        return reply

    status, body = asyncio.run(scenario())
    assert status == 503 and b"idempotency" in body.lower()
    assert runs == [] and executor.handed == []
    assert [e.outcome for e in seen] == [Outcome.UNAVAILABLE]
    ledger.close()


def test_asgi_answer_not_stored_is_still_sent_and_the_row_stays_pending(make_ledger, monkeypatch):
    ledger = make_ledger()
    runs: list[bytes] = []
    app, executor = middleware(ledger, runs)

    real_run = AsyncStore.run

    async def failing_complete(self, op):  # type: ignore[no-untyped-def]
        if step_of(op) == "complete":
            raise StorageError("the disk is full")
        return await real_run(self, op)

    monkeypatch.setattr(AsyncStore, "run", failing_complete)

    async def scenario() -> tuple[int, bytes]:
        reply = await call(app, scope_for("k1"))
        await app.wait_idle()
        await ledger.aclose()
        return reply

    assert asyncio.run(scenario()) == (201, b"made " + ORDER)
    assert runs == [ORDER] and executor.handed == []
    row = ledger.lookup("acct_A", "k1")
    assert row is not None and (row.status.value, row.response_status) == ("pending", None)


def test_a_late_owner_is_fenced_out_after_a_takeover_on_the_async_path(make_ledger, clock):
    ledger = make_ledger()
    seen: list[Any] = []
    ledger.subscribe(seen.append)

    async def scenario() -> tuple[Ticket | Answer, Ticket | Answer, Answer, Answer]:
        late = await begin_on_the_loop(ledger)
        clock.advance(ledger.policy.pending_ttl_ms + 1)
        taker = await begin_on_the_loop(ledger)
        assert isinstance(late, Ticket) and isinstance(taker, Ticket)
        stored = await finish_on_the_loop(ledger, taker, b"B")
        fenced = await finish_on_the_loop(ledger, late, b"A")
        await ledger.aclose()
        return late, taker, stored, fenced

    late, taker, stored, fenced = asyncio.run(scenario())
    assert isinstance(late, Ticket) and isinstance(taker, Ticket)
    assert (late.outcome, late.reservation.generation) == (Outcome.EXECUTED, 1)  # type: ignore[union-attr]
    assert (taker.outcome, taker.reservation.generation) == (Outcome.TAKEN_OVER, 2)  # type: ignore[union-attr]
    assert (stored.outcome, stored.body) == (Outcome.TAKEN_OVER, b"B")
    assert (fenced.outcome, fenced.body) == (Outcome.FENCED_OUT, b"A")
    row = ledger.lookup("acct_A", "k1")
    assert row is not None and (row.generation, row.body_bytes) == (2, b"B")
    [event] = list(ledger.operator.fenced(principal="acct_A"))
    assert (event.superseded_generation, event.current_generation, event.computed_status) == (1, 2, 201)
    # A ticket's event is published when its answer is: the taker's, then the late owner's.
    assert [(e.outcome, e.generation) for e in seen] == [(Outcome.TAKEN_OVER, 2), (Outcome.FENCED_OUT, 1)]


def test_waiting_duplicates_poll_on_the_loop_and_get_the_first_answer(make_ledger):
    ledger = make_ledger(policy=Policy(in_progress_wait_ms=20_000))

    async def scenario() -> list[Ticket | Answer]:
        first = await begin_on_the_loop(ledger)
        assert isinstance(first, Ticket)
        waiting = [asyncio.ensure_future(begin_on_the_loop(ledger)) for _ in range(20)]
        await asyncio.sleep(0.2)
        assert not any(w.done() for w in waiting)
        await finish_on_the_loop(ledger, first, b"made once")
        replies = await asyncio.gather(*waiting)
        await ledger.aclose()
        return list(replies)

    replies = asyncio.run(scenario())
    assert [(r.outcome, r.status, r.body) for r in replies if isinstance(r, Answer)] == [
        (Outcome.REPLAYED, 201, b"made once")
    ] * 20


def test_a_request_cancelled_mid_claim_on_the_async_path_leaves_no_claim(make_ledger, monkeypatch):
    ledger = make_ledger()
    runs: list[bytes] = []
    app, executor = middleware(ledger, runs)
    entered, landed = asyncio.Event(), threading.Event()
    proceed: asyncio.Event | None = None
    real_run = AsyncStore.run

    async def held_claim(self, op):  # type: ignore[no-untyped-def]
        if step_of(op) != "claim_or_read":
            return await real_run(self, op)
        # Held as if the claim were sent already: the cancellation must not cut it off.
        ON_THE_WIRE.set(True)
        entered.set()
        assert proceed is not None
        await proceed.wait()
        try:
            return await real_run(self, op)
        finally:
            landed.set()

    monkeypatch.setattr(AsyncStore, "run", held_claim)

    async def scenario() -> None:
        nonlocal proceed
        proceed = asyncio.Event()
        task = asyncio.ensure_future(call(app, scope_for("k-cancel")))
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        proceed.set()
        # aclose first lets the orphaned claim land and be released.
        await ledger.aclose()

    asyncio.run(scenario())
    assert landed.is_set() and runs == [] and executor.handed == []
    assert ledger.lookup("acct_A", "k-cancel") is None


def test_fastapi_route_class_runs_its_ledger_statements_on_the_loop(make_ledger, monkeypatch):
    ledger = make_ledger()
    runs: list[int] = []

    async def no_threadpool(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"handed to the thread pool: {fn!r}")

    monkeypatch.setattr(idemctl.fastapi, "run_in_threadpool", no_threadpool)
    monkeypatch.setattr(idemctl.fastapi, "_in_thread", no_threadpool)

    def account(request: Request) -> str | None:
        return request.headers.get("x-user")

    router = APIRouter(route_class=idempotent_route(ledger, principal=account))

    @router.post("/orders", status_code=201)
    async def create() -> dict:
        runs.append(1)
        return {"id": len(runs)}

    @router.post("/fails")
    async def fails() -> dict:
        raise RuntimeError("boom")

    app = FastAPI()
    app.include_router(router)
    headers = {"x-user": "acct_A", "idempotency-key": "k1"}
    with TestClient(app, raise_server_exceptions=False) as client:
        first = client.post("/orders", content=ORDER, headers=headers)
        again = client.post("/orders", content=ORDER, headers=headers)
        failed = client.post("/fails", content=ORDER, headers={**headers, "idempotency-key": "k2"})
    assert (first.status_code, first.json(), again.status_code, again.json()) == (201, {"id": 1}, 201, {"id": 1})
    assert failed.status_code == 500 and runs == [1]
    pending = ledger.lookup("acct_A", "k2")  # abandoned, kept for a takeover (release_on_error=False)
    assert pending is not None and pending.status.value == "pending"


def test_async_functions_decide_and_store_on_the_loop(make_ledger, monkeypatch):
    ledger = make_ledger()
    monkeypatch.setattr(asyncio, "to_thread", no_thread)
    runs: list[int] = []

    @ledger.idempotent(key=lambda amount: f"pay_{amount}", principal="billing")
    async def charge(amount: int) -> dict:
        runs.append(amount)
        return {"charged": amount}

    async def scenario() -> list[Any]:
        values = [await charge(500), await charge(500)]
        for _ in range(2):
            async with ledger.idempotent_call(principal="billing", key="pay_x", args={"amount": 7}) as made:
                if not made.replayed:
                    made.store({"charged": 7})
            values.append((made.outcome, made.value))
        await ledger.aclose()
        return values

    assert asyncio.run(scenario()) == [
        {"charged": 500},
        {"charged": 500},
        (Outcome.EXECUTED, {"charged": 7}),
        (Outcome.REPLAYED, {"charged": 7}),
    ]
    assert runs == [500]


def test_the_asgi_lifespan_shutdown_closes_the_loops_connections(make_ledger):
    ledger = make_ledger()
    app, _ = middleware(ledger, [])

    async def lifespan_app(scope, receive, send):  # type: ignore[no-untyped-def]
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return

    app.app = lifespan_app

    async def scenario() -> tuple[bool, bool]:
        await call(IdempotencyMiddleware(orders_app([]), ledger, principal=lambda s: s["user"]), scope_for("k1"))
        opened = ledger.async_store()
        messages = iter([{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])
        sent: list[dict] = []

        async def receive():  # type: ignore[no-untyped-def]
            return next(messages)

        async def send(message):  # type: ignore[no-untyped-def]
            sent.append(message)

        await app({"type": "lifespan"}, receive, send)
        assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
        # Shutdown closed this loop's store: asking again opens a new one.
        reopened = ledger.async_store()
        await ledger.aclose()
        return opened is not None, reopened is not None and reopened is not opened

    assert asyncio.run(scenario()) == (True, True)
