"""The holes the shared gate and capture close, each as the scenario that
showed it: waiting duplicates that held executor threads, FastAPI's native
answer shapes, repeated key fields, refusals without events, claims left
behind by cancelled tasks, and generator functions that burned their key."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import httpx
import pytest
from fastapi import APIRouter, BackgroundTasks, Depends, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, PlainTextResponse, StreamingResponse
from fastapi.testclient import TestClient

from idemctl import Ledger, Outcome, Policy, decision
from idemctl.asgi import IdempotencyMiddleware
from idemctl.errors import UnsupportedFunctionError
from idemctl.fastapi import idempotent_route
from idemctl.storage.aio import AsyncStore
from idemctl.storage.deadlines import ON_THE_WIRE
from tests.helpers import step_of

ORDER = b'{"sku":"tea"}'


def scope_for(key: str | list[str], *, user: str = "acct_A", body: bytes = ORDER) -> dict:
    keys = [key] if isinstance(key, str) else key
    headers = [(b"idempotency-key", k.encode()) for k in keys]
    headers.append((b"content-length", str(len(body)).encode()))
    return {
        "type": "http",
        "method": "POST",
        "path": "/orders",
        "raw_path": b"/orders",
        "query_string": b"",
        "headers": headers,
        "user": user,
    }


async def call(app, scope: dict, body: bytes = ORDER) -> tuple[int, bytes]:
    sent: list[dict] = []
    delivered = False

    async def receive():  # type: ignore[no-untyped-def]
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()

    async def send(message):  # type: ignore[no-untyped-def]
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


# -- ASGI: waiting duplicates hold no thread ----------------------------------------------
def test_fifty_waiting_duplicates_hold_no_executor_thread_and_get_one_identical_replay(make_ledger):
    ledger = make_ledger(policy=Policy(in_progress_wait_ms=20_000))
    runs: list[str] = []

    async def scenario() -> tuple[list[tuple[int, bytes]], tuple[int, bytes], int]:
        release = asyncio.Event()
        started = asyncio.Event()

        async def orders(scope, receive, send):  # type: ignore[no-untyped-def]
            key = dict(scope["headers"])[b"idempotency-key"].decode()
            runs.append(key)
            if key == "slow":
                started.set()
                await release.wait()
            await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": f"made {key}".encode()})

        async def who(scope):  # type: ignore[no-untyped-def]
            return scope["user"]

        app = IdempotencyMiddleware(orders, ledger, principal=who)
        owner = asyncio.ensure_future(call(app, scope_for("slow")))
        await started.wait()
        duplicates = [asyncio.ensure_future(call(app, scope_for("slow"))) for _ in range(50)]
        await asyncio.sleep(0.3)  # every duplicate is now waiting on the loop
        # An unrelated key is answered while all fifty wait and the owner runs:
        # with the waits in executor threads it queued behind them.
        unrelated = await asyncio.wait_for(call(app, scope_for("other")), timeout=30)
        still_waiting = sum(not d.done() for d in duplicates)
        release.set()
        first = await owner
        replies = await asyncio.gather(*duplicates)
        await app.wait_idle()
        return [first, *replies], unrelated, still_waiting

    replies, unrelated, still_waiting = asyncio.run(scenario())
    assert unrelated == (201, b"made other")
    assert still_waiting == 50
    assert replies == [(201, b"made slow")] * 51
    assert sorted(runs) == ["other", "slow"]


def test_a_request_cancelled_while_its_claim_runs_leaves_no_claim_behind(make_ledger, monkeypatch):
    ledger = make_ledger()
    held = ClaimsHeld(ledger, monkeypatch)

    async def orders(scope, receive, send):  # type: ignore[no-untyped-def]
        raise AssertionError("the mutation must not run")

    app = IdempotencyMiddleware(orders, ledger, principal=lambda scope: scope["user"])
    asyncio.run(held.cancel_mid_claim(lambda: call(app, scope_for("k-cancel")), "acct_A", "k-cancel"))
    held.restore()
    assert ledger.lookup("acct_A", "k-cancel") is None


class ClaimsHeld:
    """Every claim of `ledger` (in a thread, or on the loop through the
    asynchronous store) waits until `proceed` is set; `entered` says one
    started, `landed` that it finished. Until the claim has landed, "no row"
    proves nothing."""

    def __init__(self, ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ledger = ledger
        self.entered, self.proceed, self.landed = threading.Event(), threading.Event(), threading.Event()
        # The decision loop yields its claim as a statement (on PostgreSQL
        # one that also reads the row in the way), run by `store.run`: held there.
        claims = ("claim", "claim_or_read")
        self.run = run = ledger.store.run

        def slow_run(op):  # type: ignore[no-untyped-def]
            if step_of(op) not in claims:
                return run(op)
            self.entered.set()
            self.proceed.wait(10)
            try:
                return run(op)
            finally:
                self.landed.set()

        ledger.store.run = slow_run  # type: ignore[method-assign]
        # PostgreSQL's claim runs on the loop (the asynchronous store): held there.
        async_run = AsyncStore.run

        async def slow_async_run(store, op):  # type: ignore[no-untyped-def]
            if step_of(op) not in claims:
                return await async_run(store, op)
            # Held as if the claim were sent already: the cancellation must not cut it off.
            ON_THE_WIRE.set(True)
            self.entered.set()
            await asyncio.get_running_loop().run_in_executor(None, self.proceed.wait, 10)
            try:
                return await async_run(store, op)
            finally:
                self.landed.set()

        monkeypatch.setattr(AsyncStore, "run", slow_async_run)

    async def cancel_mid_claim(self, start, principal: str, key: str) -> None:  # type: ignore[no-untyped-def]
        """Cancel the task `start()` makes while its claim is held, then let
        the claim land and wait until the orphaned claim is released."""
        task = asyncio.ensure_future(start())
        await asyncio.get_running_loop().run_in_executor(None, self.entered.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        self.proceed.set()
        # The orphaned claim lands (in its thread, or on the loop), then is released.
        assert await decision.settle_orphans(10) == 0
        assert self.landed.is_set()

    def restore(self) -> None:
        self.ledger.store.__dict__.pop("run", None)


def test_wait_idle_returns_when_background_work_is_done_though_its_done_callbacks_have_not_run_yet(ledger):
    # A task that ended in this turn of the loop is done, but its callbacks
    # (the middleware forgetting it) run in a later turn. wait_idle must let
    # that turn come instead of waiting on the same done task forever
    # without ever yielding (seen on Python 3.13 after a post-response sweep).
    async def app(scope, receive, send):  # pragma: no cover (never called)
        raise AssertionError("the app was called")

    middleware = IdempotencyMiddleware(app, ledger, principal=lambda scope: "acct_A")
    returned = threading.Event()

    async def scenario() -> None:
        done = asyncio.get_running_loop().create_future()
        middleware._keep(done)
        done.set_result(None)  # its done callbacks are only scheduled now
        await middleware.wait_idle()
        returned.set()

    # In a thread of its own: a wait_idle that never yields could not even be timed out on its loop.
    threading.Thread(target=asyncio.run, args=(scenario(),), daemon=True).start()
    assert returned.wait(timeout=10), "wait_idle never returned"


def test_two_idempotency_key_fields_are_400_and_nothing_runs_under_asgi(make_ledger):
    ledger = make_ledger()
    seen = []
    ledger.subscribe(seen.append)
    runs: list[int] = []

    async def orders(scope, receive, send):  # type: ignore[no-untyped-def]
        runs.append(1)

    app = IdempotencyMiddleware(orders, ledger, principal=lambda scope: scope["user"])
    status, body = asyncio.run(call(app, scope_for(["k1", "k2"])))
    assert (status, body) == (
        400,
        b'{"error":"idempotency_key_invalid","message":"Send exactly one Idempotency-Key: several fields, or a comma '
        b'outside a quoted key, are a list."}',
    )
    assert runs == [] and ledger.operator.stats().total == 0
    assert [e.outcome for e in seen] == [Outcome.KEY_INVALID]


# -- FastAPI's native answer shapes ----------------------------------------------------------
def account(request: Request) -> str | None:
    return request.headers.get("x-user")


def fastapi_client(ledger: Ledger, build: Callable[[APIRouter], None], **options: object) -> TestClient:
    router = APIRouter(route_class=idempotent_route(ledger, principal=account, **options))  # type: ignore[arg-type]
    build(router)
    app = FastAPI()
    app.include_router(router)
    return TestClient(app)


def post(client: TestClient, key: str | list[str] = "k-1", path: str = "/orders") -> httpx.Response:
    keys = [key] if isinstance(key, str) else key
    headers = [("x-user", "acct_A"), *(("idempotency-key", k) for k in keys)]
    return client.post(path, content=ORDER, headers=headers)


def test_fastapi_background_tasks_run_once_after_the_first_answer_and_never_on_a_replay(make_ledger):
    ledger = make_ledger()
    done: list[str] = []

    def build(router: APIRouter) -> None:
        @router.post("/orders", status_code=201)
        async def create(background: BackgroundTasks) -> dict:
            background.add_task(done.append, "receipt mailed")
            return {"id": 1}

    client = fastapi_client(ledger, build)
    first, again = post(client), post(client)
    assert (first.status_code, first.content) == (201, b'{"id":1}')
    assert (again.status_code, again.content) == (201, b'{"id":1}')
    assert done == ["receipt mailed"]


def test_fastapi_an_http_exception_from_the_endpoint_is_its_answer_stored_and_replayed(make_ledger):
    ledger = make_ledger()
    runs: list[int] = []

    def build(router: APIRouter) -> None:
        @router.post("/orders")
        async def create() -> dict:
            runs.append(1)
            raise HTTPException(status_code=404, detail="no such basket")

    client = fastapi_client(ledger, build)
    first, again = post(client), post(client)
    assert (first.status_code, first.content) == (404, b'{"detail":"no such basket"}')
    assert (again.status_code, again.content) == (404, b'{"detail":"no such basket"}')
    assert runs == [1]
    assert ledger.lookup("acct_A", "k-1").response_status == 404


def test_fastapi_an_http_exception_from_a_dependency_claims_nothing(make_ledger):
    ledger = make_ledger()

    def forbidden() -> None:
        raise HTTPException(status_code=403, detail="forbidden")

    def build(router: APIRouter) -> None:
        @router.post("/orders", dependencies=[Depends(forbidden)])
        async def create() -> dict:
            return {"id": 1}

    client = fastapi_client(ledger, build)
    assert post(client).status_code == 403
    assert ledger.lookup("acct_A", "k-1") is None


def test_fastapi_a_file_response_is_captured_byte_for_byte_and_replayed(make_ledger, tmp_path):
    ledger = make_ledger()
    receipt = tmp_path / "receipt.bin"
    receipt.write_bytes(bytes(range(256)) * 8)

    def build(router: APIRouter) -> None:
        @router.post("/orders")
        async def create() -> FileResponse:
            return FileResponse(receipt, media_type="application/octet-stream")

    client = fastapi_client(ledger, build)
    first, again = post(client), post(client)
    assert (first.status_code, first.content) == (200, receipt.read_bytes())
    assert (again.status_code, again.content) == (200, receipt.read_bytes())
    assert ledger.lookup("acct_A", "k-1").body_bytes == receipt.read_bytes()


def test_fastapi_a_streaming_response_is_captured_and_replayed(make_ledger):
    ledger = make_ledger()

    def build(router: APIRouter) -> None:
        @router.post("/orders")
        async def create() -> StreamingResponse:
            async def parts():  # type: ignore[no-untyped-def]
                for part in (b"one,", b"two,", b"three"):
                    yield part

            return StreamingResponse(parts(), status_code=201, media_type="text/csv")

    client = fastapi_client(ledger, build)
    first, again = post(client), post(client)
    assert (first.status_code, first.content, again.content) == (201, b"one,two,three", b"one,two,three")


def test_fastapi_a_stream_failing_after_the_endpoint_returned_releases_with_release_on_error(make_ledger):
    ledger = make_ledger()
    seen = []
    ledger.subscribe(seen.append)

    def build(router: APIRouter) -> None:
        @router.post("/orders")
        async def create() -> StreamingResponse:
            async def parts():  # type: ignore[no-untyped-def]
                yield b"half"
                raise RuntimeError("the stream broke")

            return StreamingResponse(parts())

    client = fastapi_client(ledger, build, release_on_error=True)
    with pytest.raises(Exception) as raised:  # older Starlette wraps it in an ExceptionGroup
        post(client)
    assert "the stream broke" in _messages(raised.value)
    assert ledger.lookup("acct_A", "k-1") is None
    assert [e.outcome for e in seen] == [Outcome.FAILED]


def _messages(exc: BaseException) -> list[str]:
    """The messages of an exception and of every exception a group holds."""
    inner = getattr(exc, "exceptions", None)
    if inner:
        return [m for e in inner for m in _messages(e)]
    return [str(exc)]


def test_fastapi_two_key_fields_are_400_and_nothing_runs(make_ledger):
    ledger = make_ledger()
    runs: list[int] = []

    def build(router: APIRouter) -> None:
        @router.post("/orders")
        async def create() -> PlainTextResponse:
            runs.append(1)
            return PlainTextResponse("made")

    reply = post(fastapi_client(ledger, build), key=["k1", "k2"])
    assert (reply.status_code, reply.json()["error"]) == (400, "idempotency_key_invalid")
    assert runs == []


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("max_body_bytes", -5, "max_body_bytes must be an integer >= 0, got -5"),
        ("unavailable_retry_after_ms", 0, "unavailable_retry_after_ms must be an integer >= 1, got 0"),
    ],
)
def test_every_adapter_refuses_a_bad_option_when_it_is_built(option, value, message):
    from idemctl.flask import idempotent
    from idemctl.wsgi import IdempotencyMiddleware as WsgiMiddleware

    ledger = Ledger.open(":memory:")
    builders = [
        lambda: idempotent_route(ledger, principal=account, **{option: value}),
        lambda: IdempotencyMiddleware(lambda *a: None, ledger, principal=account, **{option: value}),
        lambda: WsgiMiddleware(lambda *a: None, ledger, principal=account, **{option: value}),
        lambda: idempotent(ledger, principal=lambda: "a", **{option: value}),
    ]
    for build in builders:
        with pytest.raises(ValueError, match=message):
            build()


# -- idempotent functions -------------------------------------------------------------------
def test_a_generator_function_is_refused_when_decorated(ledger):
    with pytest.raises(UnsupportedFunctionError, match="generator function"):

        @ledger.idempotent(key="k", principal="billing")
        def export():  # type: ignore[no-untyped-def]
            yield 1


def test_an_object_whose_call_is_a_generator_is_refused_when_decorated(ledger):
    class Export:
        def __call__(self):  # type: ignore[no-untyped-def]
            yield 1

    with pytest.raises(UnsupportedFunctionError):
        ledger.idempotent(key="k", principal="billing", name="export")(Export())


def test_an_object_whose_call_is_async_runs_as_async_and_replays(ledger):
    runs: list[int] = []

    class Charge:
        async def __call__(self, amount: int) -> dict:
            runs.append(amount)
            return {"charged": amount}

    charge = ledger.idempotent(key="pay_1", principal="billing", name="charge")(Charge())
    assert asyncio.run(charge(500)) == {"charged": 500}
    assert asyncio.run(charge(500)) == {"charged": 500}
    assert runs == [500]


def test_a_callable_returning_a_coroutine_is_refused_at_its_call_and_its_key_is_not_burned(ledger):
    async def charge(amount: int) -> dict:
        return {"charged": amount}

    class Opaque:  # hides that it returns a coroutine
        def __call__(self, amount: int):  # type: ignore[no-untyped-def]
            return charge(amount)

    wrapped = ledger.idempotent(key="pay_2", principal="billing", name="charge")(Opaque())
    with pytest.raises(UnsupportedFunctionError, match="returned a coroutine"):
        wrapped(500)
    assert ledger.lookup("billing", "pay_2") is None


def test_a_task_cancelled_while_its_call_is_claiming_leaves_no_orphan_claim(ledger, monkeypatch):
    held = ClaimsHeld(ledger, monkeypatch)

    async def work() -> None:
        async with ledger.idempotent_call(principal="billing", key="pay_3", args={"amount": 1}, release_on_error=False):
            raise AssertionError("the block must not run")

    asyncio.run(held.cancel_mid_claim(work, "billing", "pay_3"))
    held.restore()
    assert ledger.lookup("billing", "pay_3") is None


@pytest.mark.parametrize(
    ("method", "target", "status", "error"),
    [
        ("POST", "/orders\x01", 400, "request_target_invalid"),
        ("PO\nST", "/orders", 400, "request_target_invalid"),
        ("POST", "/orders?" + "\u00e9" * 32_769, 414, "request_target_too_long"),  # 65 538 bytes, 32 769 characters
    ],
    ids=["control-in-target", "control-in-method", "over-64-kib-in-utf-8"],
)
def test_the_gate_refuses_a_request_line_the_ledger_cannot_take_sync_and_async(
    make_ledger, method, target, status, error
):
    import json

    from idemctl.exchange.drive import drive, drive_async
    from idemctl.exchange.sequence import Request, sequence
    from idemctl.gate import Gate

    ledger = make_ledger(policy=Policy(protected_methods=frozenset({"POST", method})))
    gate = Gate(ledger)
    seen: list[Outcome] = []
    ledger.subscribe(lambda event: seen.append(event.outcome))

    async def on_the_loop(fn, *args):  # type: ignore[no-untyped-def]
        return fn(*args)

    class Door:  # the sequence up to the ledger's answer, in a thread
        keep = None

        def exempt(self) -> bool:
            return False

        key_optional = release = exempt

        def principal(self) -> str:
            return "acct_A"

        def read_body(self, limit: int, declared: int | None) -> bytes:
            return b"{}"

        def send(self, delivery, after):  # type: ignore[no-untyped-def]
            return delivery.answer

    class AsyncDoor(Door):  # and on an event loop
        in_thread = staticmethod(on_the_loop)

        async def principal(self) -> str:  # type: ignore[override]
            return "acct_A"

        async def read_body(self, limit: int, declared: int | None) -> bytes:  # type: ignore[override]
            return b"{}"

        async def send(self, delivery, after):  # type: ignore[no-untyped-def]
            return delivery.answer

    def request() -> Request:
        return Request(method, target, ("k-1",), (), "2", False)

    answers = [
        drive(gate, sequence(gate, request(), Door()), Door()),  # type: ignore[arg-type]
        asyncio.run(drive_async(gate, sequence(gate, request(), AsyncDoor()), AsyncDoor())),  # type: ignore[arg-type]
    ]
    for answer in answers:
        assert (answer.status, json.loads(answer.body)["error"], answer.outcome) == (
            status,
            error,
            Outcome.REQUEST_REFUSED,
        )
    assert seen == [Outcome.REQUEST_REFUSED] * 2
    assert ledger.operator.stats().total == 0
