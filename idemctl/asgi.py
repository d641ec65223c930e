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
import functools
import inspect
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from concurrent.futures import Executor
from typing import Any, TypeVar
from urllib.parse import quote

from . import responses
from .errors import AnswerNotStoredError, LedgerUnavailableError, StorageError
from .ledger import Ledger
from .outcomes import Answer, Outcome, Ticket
from .policy import Policy
from .wire import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_UNAVAILABLE_RETRY_AFTER_MS,
    check_options,
    log_not_stored,
    wire_headers,
)

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
_CONTENT_LENGTH = re.compile(r"[0-9]+\Z")
# RFC 3986 pchar minus the unreserved set, as the WSGI middleware rebuilds a path.
_PATH_SAFE = "/:@!$&'()*+,;="
# Extensions that would let the app send a response we cannot capture.
_UNCAPTURABLE_EXTENSIONS = ("http.response.pathsend", "http.response.zerocopysend", "http.response.trailers")


class _Refused(Exception):
    """The request cannot be let through; carries the JSON answer to send."""

    def __init__(self, answer: tuple[int, responses.Headers, bytes]) -> None:
        super().__init__(answer[0])
        self.answer = answer


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


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if bytes(key).lower() == name:
            return bytes(value).decode("latin-1")
    return None


async def _read_body(receive: Receive, scope: Scope, limit: int) -> bytes:
    """The whole request body, refused with 400/413 when it cannot be read safely."""
    declared = _header(scope, b"content-length")
    if declared is not None:
        declared = declared.strip(" \t")
        if not _CONTENT_LENGTH.match(declared):
            raise _Refused(responses.content_length_invalid())
        if int(declared) > limit:
            raise _Refused(responses.body_too_large(limit))
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
        if total > limit:
            raise _Refused(responses.body_too_large(limit))
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


class _Captured:
    """The app's whole response, collected instead of sent."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.headers: list[tuple[str, str]] = []
        self.chunks: list[bytes] = []
        self.complete = False

    async def send(self, message: Message) -> None:
        kind = message.get("type")
        if kind == "http.response.start":
            if self.status is not None:
                raise RuntimeError("the app sent http.response.start twice")
            self.status = int(message["status"])
            self.headers = [
                (bytes(k).decode("latin-1"), bytes(v).decode("latin-1")) for k, v in message.get("headers", ())
            ]
        elif kind == "http.response.body":
            if self.status is None:
                raise RuntimeError("the app sent a body before http.response.start")
            if self.complete:
                raise RuntimeError("the app sent a body after its last one")
            self.chunks.append(bytes(message.get("body", b"") or b""))
            self.complete = not message.get("more_body", False)
        else:
            raise RuntimeError(f"the app sent {kind!r}, which an idempotent response cannot carry")

    def answer(self) -> tuple[int, list[tuple[str, str]], bytes]:
        if self.status is None or not self.complete:
            raise RuntimeError("the app returned before it finished its response")
        return self.status, self.headers, b"".join(self.chunks)


def _log_orphan_failure(future: asyncio.Future[Any]) -> None:
    # Nobody awaits a shielded mutation whose request was cancelled.
    if not future.cancelled() and future.exception() is not None:
        exc = future.exception()
        log.error("idempotent request failed after its client left: %r", exc, exc_info=exc)


class IdempotencyMiddleware:
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
        check_options(principal, max_body_bytes, unavailable_retry_after_ms, takes="scope (or an async one)")
        self.app = app
        self.ledger = ledger
        self.principal = principal
        self.exempt = exempt
        self.key_optional = key_optional
        self.release_on_error = release_on_error
        self.max_body_bytes = max_body_bytes
        self.replayed_header = replayed_header
        self.unavailable_retry_after_ms = unavailable_retry_after_ms
        self.executor = executor
        # Work that outlives its request (a shielded mutation, a sweep):
        # referenced here so the loop cannot drop it half-way.
        self._background: set[asyncio.Future[Any]] = set()

    @property
    def policy(self) -> Policy:
        return self.ledger.policy

    async def _in_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        method = str(scope.get("method", "GET")).upper()
        if not self.policy.protects(method) or (self.exempt is not None and self.exempt(scope)):
            await self.app(scope, receive, send)
            return
        key = _header(scope, b"idempotency-key")
        if key is None and self.key_optional is not None and self.key_optional(scope):
            await self.app(scope, receive, send)
            return

        who = self.principal(scope)
        if inspect.isawaitable(who):
            who = await who
        if who is not None and not isinstance(who, str):
            raise TypeError(f"principal() must return str or None, got {type(who).__name__}")
        if not who:
            await self._send(send, Answer(*responses.unauthenticated(), Outcome.UNAUTHENTICATED))
            return
        try:
            body = await _read_body(receive, scope, self.max_body_bytes)
        except _Refused as refused:
            await self._send(send, Answer(*refused.answer, Outcome.BODY_REFUSED))
            return
        except _ClientGone:
            log.info("client disconnected before its request body was complete; nothing was claimed")
            return

        target = request_target(scope)
        headers = scope_headers(scope, self.policy.fingerprint_headers)
        try:
            decision = await self._in_thread(self.ledger.begin, who, key, method, target, headers, body)
        except StorageError as exc:
            level = logging.WARNING if isinstance(exc, LedgerUnavailableError) else logging.ERROR
            log.log(level, "idempotency ledger unavailable, refused %s %s with 503: %s", method, target, exc)
            unavailable = responses.unavailable(self.unavailable_retry_after_ms)
            await self._send(send, Answer(*unavailable, Outcome.UNAVAILABLE))
            return
        if isinstance(decision, Answer):
            await self._send(send, decision)
            return

        # Run and complete as one task the request cannot cancel: a client
        # that leaves mid-mutation must find its answer stored when it retries.
        work = asyncio.ensure_future(self._run_and_finish(scope, receive, decision, who, key))
        self._keep(work)
        try:
            answer, sweep = await asyncio.shield(work)
        except asyncio.CancelledError:
            work.add_done_callback(_log_orphan_failure)
            raise
        await self._send(send, answer, sweep=sweep)

    async def _run_and_finish(
        self, scope: Scope, receive: Receive, ticket: Ticket, who: str, key: str | None
    ) -> tuple[Answer, bool]:
        inner = dict(scope)
        inner[PRINCIPAL_SCOPE_KEY] = who
        extensions = dict(inner.get("extensions") or {})
        for name in _UNCAPTURABLE_EXTENSIONS:
            extensions.pop(name, None)
        inner["extensions"] = extensions
        delivered = False

        async def replay_body() -> Message:
            # The app reads the body the fingerprint covered, once; after that
            # it waits on the real channel (where a disconnect shows up).
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": ticket.body, "more_body": False}
            return await receive()

        captured = _Captured()
        try:
            await self.app(inner, replay_body, captured.send)
            status, out_headers, out_body = captured.answer()
        except BaseException:
            release = self.release_on_error(scope) if callable(self.release_on_error) else bool(self.release_on_error)
            await self._in_thread(self.ledger.abandon, ticket, release=release)
            raise
        try:
            return await self._in_thread(self.ledger.finish, ticket, status, out_headers, out_body), True
        except AnswerNotStoredError as exc:
            # As in the WSGI middleware: the client gets what the app computed,
            # shaped as a stored answer, rather than an invitation to run it again.
            log_not_stored(log, exc, who, key)
            return exc.answer, False

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

    async def _send(self, send: Send, answer: Answer, *, sweep: bool = True) -> None:
        headers = [
            (name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in wire_headers(answer, replayed_header=self.replayed_header)
        ]
        try:
            await send({"type": "http.response.start", "status": answer.status, "headers": headers})
            await send({"type": "http.response.body", "body": answer.body, "more_body": False})
        except OSError as exc:  # the client left: its answer is stored for the retry
            log.info("client left before its answer (status %d) was sent: %s", answer.status, exc)
        if sweep and self.ledger.sweep_due(answer):
            # After the answer, off the loop, never awaited by the request;
            # replays, 409s and a resting sweep cost no hand-off at all.
            loop = asyncio.get_running_loop()
            self._keep(loop.run_in_executor(self.executor, self.ledger.after_response, answer))


__all__ = ["PRINCIPAL_SCOPE_KEY", "IdempotencyMiddleware", "request_target", "scope_headers"]
