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
import contextvars
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from concurrent.futures import Executor
from typing import Any, TypeVar
from urllib.parse import quote

from . import gate as gates
from .capture import Capture, CaptureError
from .gate import BodyRefused, Delivery
from .ledger import Ledger
from .outcomes import Answer, Ticket
from .wire import DEFAULT_MAX_BODY_BYTES, DEFAULT_UNAVAILABLE_RETRY_AFTER_MS, wire_headers

log = logging.getLogger("idemctl.asgi")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
ScopePredicate = Callable[[Scope], bool]
PrincipalResolver = Callable[[Scope], "Awaitable[str | None] | str | None"]
T = TypeVar("T")

PRINCIPAL_SCOPE_KEY = "idemctl.principal"
# RFC 3986 pchar minus the unreserved set, as the WSGI middleware rebuilds a path.
_PATH_SAFE = "/:@!$&'()*+,;="
# Extensions that would let the app send a response we cannot capture, and
# trailers, which no stored answer carries: an app told they are unsupported
# sends none (one that sends them anyway is answered without them).
_UNCAPTURABLE_EXTENSIONS = ("http.response.pathsend", "http.response.zerocopysend", "http.response.trailers")


class _ClientGone(Exception):
    """The client disconnected before its request body was complete."""


def request_target(scope: Scope) -> str:
    """The request target the fingerprint covers: path and query as received,
    the same string the WSGI middleware sees for the same request.

    >>> request_target({"path": "/orders", "raw_path": b"/orders", "query_string": b"b=2&a=1"})
    '/orders?b=2&a=1'
    >>> request_target({"path": "/caf\\u00e9", "query_string": b""})
    '/caf%C3%A9'
    """
    raw = scope.get("raw_path")
    if raw:
        path = bytes(raw).decode("latin-1")
    else:
        path = quote((scope.get("root_path", "") or "") + scope.get("path", ""), safe=_PATH_SAFE) or "/"
    query = bytes(scope.get("query_string", b"") or b"").decode("latin-1")
    return f"{path}?{query}" if query else path


def scope_headers(scope: Scope, names: Iterable[str]) -> list[tuple[str, str]]:
    """The named request headers (lower-case names), every occurrence, as sent.

    >>> scope_headers({"headers": [(b"content-type", b"application/json"), (b"x-other", b"1")]}, ["content-type"])
    [('content-type', 'application/json')]
    """
    wanted = {n.lower() for n in names}
    out = []
    for name, value in scope.get("headers", ()):
        lname = bytes(name).decode("latin-1").lower()
        if lname in wanted:
            out.append((lname, bytes(value).decode("latin-1")))
    return out


def header_fields(scope: Scope, name: bytes) -> list[str]:
    """Every field of one request header, in the order sent.

    >>> header_fields({"headers": [(b"idempotency-key", b"k1"), (b"Idempotency-Key", b"k2")]}, b"idempotency-key")
    ['k1', 'k2']
    """
    return [bytes(v).decode("latin-1") for k, v in scope.get("headers", ()) if bytes(k).lower() == name]


async def _read_body(receive: Receive, scope: Scope, limit: int) -> bytes:
    """The whole request body, refused by the gate's rules when it cannot be read safely."""
    fields = header_fields(scope, b"content-length")
    gates.declared_length(fields[0] if fields else None, limit)
    parts: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        kind = message.get("type")
        if kind == "http.disconnect":
            raise _ClientGone()
        if kind != "http.request":
            continue
        chunk = bytes(message.get("body", b"") or b"")
        total += len(chunk)
        gates.check_read(total, limit)
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


class MessageCapture:
    """The app's ASGI messages, fed into the gate's bounded capture."""

    def __init__(self, capture: Capture) -> None:
        self.capture = capture

    async def send(self, message: Message) -> None:
        kind = message.get("type")
        capture = self.capture
        if kind == "http.response.start":
            headers = [(bytes(k).decode("latin-1"), bytes(v).decode("latin-1")) for k, v in message.get("headers", ())]
            capture.start(int(message["status"]), headers)
        elif kind == "http.response.body":
            if capture.complete:
                raise CaptureError("the app sent a body after its last one")
            capture.add(bytes(message.get("body", b"") or b""))
            capture.complete = not message.get("more_body", False)
        elif kind == "http.response.trailers":
            capture.trailers()
        else:
            raise CaptureError(f"the app sent {kind!r}, which an idempotent response cannot carry")

    def check_complete(self) -> None:
        if self.capture.status is None or not self.capture.complete:
            raise CaptureError("the app returned before it finished its response")


def capturable_scope(scope: Scope) -> Scope:
    """A copy of `scope` without the extensions that would let the app send
    a response the capture cannot see (a file by path, zero-copy, trailers).

    >>> capturable_scope({"type": "http", "extensions": {"http.response.pathsend": {}}})["extensions"]
    {}
    """
    inner = dict(scope)
    extensions = dict(inner.get("extensions") or {})
    for name in _UNCAPTURABLE_EXTENSIONS:
        extensions.pop(name, None)
    inner["extensions"] = extensions
    return inner


def _log_orphan_failure(future: asyncio.Future[Any]) -> None:
    # Nobody awaits a shielded mutation whose request was cancelled.
    if not future.cancelled() and future.exception() is not None:
        exc = future.exception()
        log.error("idempotent request failed after its client left: %r", exc, exc_info=exc)


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
        # The executor's own future, awaitable as it is: a coroutine around it
        # would cost a task of its own for every hand-off.
        # Run in (a copy of) the request's context, as asyncio.to_thread does:
        # the ledger's event listeners there see its current span.
        loop, run = asyncio.get_running_loop(), contextvars.copy_context().run
        if kwargs:
            return loop.run_in_executor(self.executor, functools.partial(run, fn, *args, **kwargs))
        return loop.run_in_executor(self.executor, run, fn, *args)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") == "lifespan":
            await self.app(scope, receive, self._closing_on_shutdown(send))
            return
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        method = str(scope.get("method", "GET")).upper()
        if self.passes(method, scope):
            await self.app(scope, receive, send)
            return
        gate = self.gate
        target = request_target(scope)
        key = gate.key(header_fields(scope, b"idempotency-key"), method=method, target=target)
        if isinstance(key, Answer):
            await self._send(send, gates.replied(key))
            return
        if self.passes_keyless(key, scope):
            await self.app(scope, receive, send)
            return

        resolved = self.principal(scope)
        if inspect.isawaitable(resolved):
            resolved = await resolved
        who = gate.principal(resolved, key=key, method=method, target=target)
        if isinstance(who, Answer):
            await self._send(send, gates.replied(who))
            return
        try:
            body = await _read_body(receive, scope, gate.max_body_bytes)
        except BodyRefused as refused:
            answer = gate.refused(refused, principal=who, key=key, method=method, target=target)
            await self._send(send, gates.replied(answer))
            return
        except _ClientGone:
            log.info("client disconnected before its request body was complete; nothing was claimed")
            return

        headers = scope_headers(scope, self.policy.fingerprint_headers)
        decision = await gate.begin_async(who, key, method, target, headers, body, self._in_thread)
        if isinstance(decision, Answer):
            await self._send(send, gates.replied(decision))
            return

        # Run and complete as one task the request cannot cancel: a client
        # that leaves mid-mutation must find its answer stored when it retries.
        work = asyncio.ensure_future(self._run_and_finish(scope, receive, decision, who))
        self._keep(work)
        try:
            delivery = await asyncio.shield(work)
        except asyncio.CancelledError:
            work.add_done_callback(_log_orphan_failure)
            raise
        await self._send(send, delivery)

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

    async def _run_and_finish(self, scope: Scope, receive: Receive, ticket: Ticket, who: str) -> Delivery:
        inner = capturable_scope(scope)
        inner[PRINCIPAL_SCOPE_KEY] = who
        delivered = False

        async def replay_body() -> Message:
            # The app reads the body the fingerprint covered, once; after that
            # it waits on the real channel (where a disconnect shows up).
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": ticket.body, "more_body": False}
            return await receive()

        capture = self.gate.capture()
        captured = MessageCapture(capture)
        try:
            await self.app(inner, replay_body, captured.send)
            captured.check_complete()
        except BaseException:
            await self.gate.abandon_async(ticket, release=self.release(scope), in_thread=self._in_thread)
            raise
        return await self.gate.finish_async(ticket, capture, self._in_thread)

    async def wait_idle(self) -> None:
        """Wait until this event loop's background work is done: mutations
        whose client left, and post-response sweeps. For a graceful shutdown
        (call it from the lifespan shutdown) and for tests."""
        loop = asyncio.get_running_loop()
        while pending := [f for f in self._background if f.get_loop() is loop]:
            await asyncio.gather(*pending, return_exceptions=True)

    def _keep(self, future: asyncio.Future[Any]) -> None:
        self._background.add(future)
        future.add_done_callback(self._forget)

    def _forget(self, future: asyncio.Future[Any]) -> None:
        self._background.discard(future)

    async def _send(self, send: Send, delivery: Delivery) -> None:
        answer = delivery.answer
        headers = [
            (name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in wire_headers(answer, replayed_header=self.gate.replayed_header)
        ]
        try:
            await send({"type": "http.response.start", "status": answer.status, "headers": headers})
            await send({"type": "http.response.body", "body": answer.body, "more_body": False})
        except OSError as exc:  # the client left: its answer is stored for the retry
            log.info("client left before its answer (status %d) was sent: %s", answer.status, exc)
        sweep = self.gate.sweep_after_async(delivery, self._in_thread)
        if sweep is not None:
            # After the answer, never awaited by the request (on the loop on
            # PostgreSQL, in a worker thread on SQLite); replays, 409s and a
            # resting sweep cost nothing at all.
            self._keep(asyncio.ensure_future(sweep()))


__all__ = ["PRINCIPAL_SCOPE_KEY", "IdempotencyMiddleware", "header_fields", "request_target", "scope_headers"]
