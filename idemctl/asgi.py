"""ASGI middleware: the whole Idempotency-Key contract in front of any ASGI 3 app.

The same contract, options and bytes as the WSGI middleware, without ever
making the event loop wait on the database: every ledger statement runs in
a worker thread (`Ledger.begin`, `finish`, `abandon`, `after_response`),
and the app runs on the loop between them. The request body is read
completely before the claim; the app's response (streamed or not) is
captured, stored, and the answer built from what was stored is sent, so
the first answer equals every replay. A client that disconnects while the
mutation runs cancels neither the mutation nor its completion: its retry
is replayed. Needs no framework at run time.

>>> from idemctl import Ledger
>>> from idemctl.asgi import IdempotencyMiddleware
>>> async def orders(scope, receive, send):
...     await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"text/plain")]})
...     await send({"type": "http.response.body", "body": b"created"})
>>> ledger = Ledger.open(":memory:"); _ = ledger.init()
>>> app = IdempotencyMiddleware(orders, ledger, principal=lambda scope: "acct_1")
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

from .exchange import body as rules
from .exchange import gate as gates
from .exchange.drive import drive_async
from .exchange.gate import Delivery
from .exchange.scope import (
    Message,
    MessageCapture,
    Receive,
    Scope,
    Send,
    capturable_scope,
    header_fields,
    parse,
    request_target,
    scope_headers,
)
from .exchange.sequence import Run, sequence
from .exchange.threads import hand_off
from .exchange.wire import DEFAULT_MAX_BODY_BYTES, DEFAULT_UNAVAILABLE_RETRY_AFTER_MS, wire_headers
from .ledger import Ledger

log = logging.getLogger("idemctl.asgi")

ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
ScopePredicate = Callable[[Scope], bool]
PrincipalResolver = Callable[[Scope], "Awaitable[str | None] | str | None"]
T = TypeVar("T")

PRINCIPAL_SCOPE_KEY = "idemctl.principal"


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body; 413 once more than `limit` bytes arrived,
    ClientGone when the client leaves before its end."""
    parts: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        kind = message.get("type")
        if kind == "http.disconnect":
            raise rules.ClientGone()
        if kind != "http.request":
            continue
        chunk = bytes(message.get("body", b"") or b"")
        total += len(chunk)
        rules.check_read(total, limit)
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


class IdempotencyMiddleware(gates.GatedMiddleware[ASGIApp, Scope]):
    """Wrap an ASGI 3 app so every protected request honours its Idempotency-Key.

    `principal(scope)` (a plain or an async callable) returns the caller's
    identity from the app's own auth layer, or None to refuse with 401;
    never a value the client controls directly. `exempt`, `key_optional`,
    `release_on_error`, `max_body_bytes`, `replayed_header` and
    `unavailable_retry_after_ms` mean what they mean for the WSGI
    middleware. Ledger statements run on `executor` (default: the event
    loop's default executor). `lifespan` and `websocket` scopes, and
    methods the ledger's Policy does not protect, pass straight through.

    >>> import asyncio
    >>> from idemctl import Ledger
    >>> async def orders(scope, receive, send):
    ...     await send({"type": "http.response.start", "status": 201, "headers": []})
    ...     await send({"type": "http.response.body", "body": b"created"})
    >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
    >>> app = IdempotencyMiddleware(orders, ledger, principal=lambda scope: "acct_1")
    >>> sent = []
    >>> async def receive(): return {"type": "http.request", "body": b"{}"}
    >>> async def send(message): sent.append(message)
    >>> scope = {"type": "http", "method": "POST", "path": "/orders", "raw_path": b"/orders",
    ...          "query_string": b"", "headers": [(b"idempotency-key", b"k1")]}
    >>> asyncio.run(app(scope, receive, send))
    >>> sent[0]["status"], sent[1]["body"]
    (201, b'created')
    """

    def __init__(
        self,
        app: ASGIApp,
        ledger: Ledger,
        *,
        principal: PrincipalResolver,
        exempt: ScopePredicate | None = None,
        key_optional: ScopePredicate | None = None,
        release_on_error: bool | ScopePredicate = False,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        replayed_header: bool = False,
        unavailable_retry_after_ms: int = DEFAULT_UNAVAILABLE_RETRY_AFTER_MS,
        executor: Executor | None = None,
    ) -> None:
        gate = gates.adapter_gate(
            ledger,
            principal,
            "scope (or an async one)",
            log,
            max_body_bytes,
            replayed_header,
            unavailable_retry_after_ms,
        )
        super().__init__(app, ledger, gate, principal, exempt, key_optional, release_on_error)
        self.executor = executor
        # Work that outlives its request (a shielded mutation, a sweep):
        # referenced here so the loop cannot drop it half-way.
        self._background: set[asyncio.Future[Any]] = set()

    def _in_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        return hand_off(self.executor, fn, *args, **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") == "lifespan":
            await self.app(scope, receive, self._closing_on_shutdown(send))
            return
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        gate = self.gate
        door = _Door(self, scope, receive, send)
        await drive_async(gate, sequence(gate, parse(scope, self.policy.fingerprint_headers), door), door)

    def _closing_on_shutdown(self, send: Send) -> Send:
        # The ledger's connections of this loop (PostgreSQL's asynchronous
        # pool) close with the app, before the server hears it is done.
        async def forward(message: Message) -> None:
            if message.get("type") == "lifespan.shutdown.complete":
                try:
                    await self.ledger.aclose()
                except Exception:
                    log.exception("closing the ledger's connections at shutdown failed")
            await send(message)

        return forward

    async def wait_idle(self) -> None:
        """Wait until this event loop's background work is done: mutations
        whose client left, and post-response sweeps. For a graceful shutdown
        (call it from the lifespan shutdown) and for tests."""
        loop = asyncio.get_running_loop()
        # Only what is still running: a finished task stays in the set until
        # its done callback runs, a turn of the loop later, and gathering only
        # finished ones completes at once (Python 3.12+) without yielding.
        while pending := [f for f in self._background if f.get_loop() is loop and not f.done()]:
            await asyncio.gather(*pending, return_exceptions=True)

    def _keep(self, future: asyncio.Future[Any]) -> None:
        self._background.add(future)
        future.add_done_callback(self._forget)

    def _forget(self, future: asyncio.Future[Any]) -> None:
        self._background.discard(future)


class _Door(gates.MiddlewareDoor[Scope]):
    """One request's ASGI side: the scope (`request`) and channels in, the answer out."""

    __slots__ = ("receive", "send_message")

    middleware: IdempotencyMiddleware

    def __init__(self, middleware: IdempotencyMiddleware, scope: Scope, receive: Receive, send: Send) -> None:
        self.middleware, self.request = middleware, scope
        self.receive, self.send_message = receive, send

    @property
    def in_thread(self) -> Callable[..., Awaitable[Any]]:
        return self.middleware._in_thread

    @property
    def keep(self) -> Callable[[asyncio.Future[Any]], None]:
        return self.middleware._keep

    def principal(self) -> object:
        return self.middleware.principal(self.request)  # an awaitable is awaited by the driver

    def read_body(self, limit: int, declared: int | None) -> Awaitable[bytes]:
        return read_body(self.receive, limit)

    async def run(self, need: Run) -> None:
        inner = capturable_scope(self.request)
        inner[PRINCIPAL_SCOPE_KEY] = need.principal
        receive = self.receive
        delivered = False

        async def replay_body() -> Message:
            # The app reads the body the fingerprint covered, once; after that
            # it waits on the real channel (where a disconnect shows up).
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": need.body, "more_body": False}
            return await receive()

        captured = MessageCapture(need.capture)
        await self.middleware.app(inner, replay_body, captured.send)
        captured.check_complete()

    async def send(self, delivery: Delivery, after: Callable[[], Awaitable[None]] | None) -> None:
        answer = delivery.answer
        headers = [
            (name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in wire_headers(answer, replayed_header=self.middleware.gate.replayed_header)
        ]
        send = self.send_message
        try:
            await send({"type": "http.response.start", "status": answer.status, "headers": headers})
            await send({"type": "http.response.body", "body": answer.body, "more_body": False})
        except OSError as exc:  # the client left: its answer is stored for the retry
            log.info("client left before its answer (status %d) was sent: %s", answer.status, exc)
        if after is not None:
            # After the answer, never awaited by the request (on the loop on
            # PostgreSQL, in a worker thread on SQLite); replays, 409s and a
            # resting sweep cost nothing at all.
            self.middleware._keep(asyncio.ensure_future(after()))

    async def pass_through(self) -> None:
        await self.middleware.app(self.request, self.receive, self.send_message)


__all__ = [
    "PRINCIPAL_SCOPE_KEY",
    "IdempotencyMiddleware",
    "MessageCapture",
    "capturable_scope",
    "hand_off",
    "header_fields",
    "parse",
    "read_body",
    "request_target",
    "scope_headers",
]
