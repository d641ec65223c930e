"""The ASGI middleware touches only protected HTTP requests: lifespan and
websocket scopes, and unprotected methods, reach the app untouched and cost
no ledger statement."""

from __future__ import annotations

import asyncio

from idemctl import Ledger
from idemctl.asgi import IdempotencyMiddleware


def run(app, scope, incoming):  # type: ignore[no-untyped-def]
    sent: list[dict] = []
    queue = list(incoming)

    async def receive():  # type: ignore[no-untyped-def]
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(message):  # type: ignore[no-untyped-def]
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def statements_counted(ledger: Ledger) -> list[str]:
    seen: list[str] = []
    ledger.store.engine.admin().conn.set_trace_callback(seen.append)
    return seen


def test_lifespan_and_websocket_scopes_pass_through_untouched(tmp_path):
    ledger = Ledger.open(tmp_path / "l.db")
    ledger.init()
    reached: list[tuple[str, object]] = []

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        message = await receive()
        reached.append((scope["type"], message["type"]))
        if scope["type"] == "lifespan":
            await send({"type": "lifespan.startup.complete"})
        else:
            await send({"type": "websocket.accept"})

    seen = statements_counted(ledger)
    middleware = IdempotencyMiddleware(app, ledger, principal=lambda scope: "acct")
    lifespan = run(middleware, {"type": "lifespan", "asgi": {"version": "3.0"}}, [{"type": "lifespan.startup"}])
    websocket = run(
        middleware,
        {"type": "websocket", "path": "/ws", "headers": [(b"idempotency-key", b"k")]},
        [{"type": "websocket.connect"}],
    )
    assert reached == [("lifespan", "lifespan.startup"), ("websocket", "websocket.connect")]
    assert lifespan == [{"type": "lifespan.startup.complete"}]
    assert websocket == [{"type": "websocket.accept"}]
    assert seen == [] and ledger.operator.stats().total == 0
    ledger.close()


def test_an_unprotected_method_reaches_the_app_with_its_own_body_and_no_ledger_work(tmp_path):
    ledger = Ledger.open(tmp_path / "l.db")
    ledger.init()
    bodies: list[bytes] = []

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        bodies.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-own", b"1")]})
        await send({"type": "http.response.body", "body": b"listing"})

    seen = statements_counted(ledger)
    middleware = IdempotencyMiddleware(app, ledger, principal=lambda scope: "acct")
    sent = run(
        middleware,
        {
            "type": "http",
            "method": "GET",
            "path": "/orders",
            "headers": [(b"idempotency-key", b"k")],
            "query_string": b"",
        },
        [{"type": "http.request", "body": b"q", "more_body": False}],
    )
    assert sent == [
        {"type": "http.response.start", "status": 200, "headers": [(b"x-own", b"1")]},
        {"type": "http.response.body", "body": b"listing"},
    ]
    assert bodies == [b"q"] and seen == []
    ledger.close()


def test_a_scope_is_read_by_header_names_in_any_case_and_any_bytes_type() -> None:
    from idemctl.exchange.scope import parse

    scope = {
        "method": "post",
        "path": "/orders",
        "query_string": b"b=2",
        "headers": [
            (b"Idempotency-Key", b"k1"),
            (bytearray(b"CONTENT-LENGTH"), memoryview(b"2")),
            (b"content-length", b"99"),  # a second field: the first one counts
            (memoryview(b"Content-Type"), b"application/json"),
            (b"x-other", b"not fingerprinted"),
            (b"idempotency-key", bytearray(b"k2")),
        ],
    }
    request = parse(scope, ("Content-Type", "x-absent"))
    assert (request.method, request.target) == ("POST", "/orders?b=2")
    assert request.key_fields == ["k1", "k2"]
    assert request.content_length == "2"
    assert request.headers == [("content-type", "application/json")]
    # The same policy's names again, and another policy's: each set of names is its own.
    assert parse(scope, ("x-other",)).headers == [("x-other", "not fingerprinted")]
    assert parse(scope, ()).headers == []
