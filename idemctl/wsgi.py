"""WSGI middleware: the whole Idempotency-Key contract in front of any WSGI app.

The middleware reads the request body once, asks the ledger whether this
request may run, runs the wrapped app at most once per (principal, key) and
generation, and sends the answer that was stored, so the first caller and
every retry get the same bytes. The bounded sweep runs from the `close()` of
the iterable handed to the server, after the answer has gone out.

>>> from wsgiref.simple_server import demo_app
>>> from idemctl import Ledger
>>> from idemctl.wsgi import IdempotencyMiddleware
>>> ledger = Ledger.open(":memory:"); _ = ledger.init()
>>> app = IdempotencyMiddleware(demo_app, ledger, principal=lambda environ: environ.get("REMOTE_USER"))
"""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Callable, Iterable
from types import TracebackType
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from .exchange import body as rules
from .exchange import gate as gates
from .exchange.capture import Capture
from .exchange.drive import drive
from .exchange.environ import (
    PRINCIPAL_ENVIRON_KEY,
    environ_headers,
    environ_names,
    parse,
    parse_environ,
    request_target,
)
from .exchange.gate import Delivery
from .exchange.sequence import Run, sequence
from .exchange.wire import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_UNAVAILABLE_RETRY_AFTER_MS,
    REPLAYED_HEADER,
    status_line,
    wire_headers,
)
from .ledger import Ledger

log = logging.getLogger("idemctl.wsgi")

EnvironPredicate = Callable[[WSGIEnvironment], bool]
ExcInfo = tuple[type[BaseException], BaseException, TracebackType] | tuple[None, None, None] | None

_READ_CHUNK = 64 * 1024
_STATUS_LINE = re.compile(r"([0-9]{3}) ")


def read_body(environ: WSGIEnvironment, limit: int, declared: int | None) -> bytes:
    """Read the request body once, completely: exactly `declared` bytes (its
    Content-Length); to the end of the stream when there is none and the
    server marks the input terminated (chunked uploads); otherwise empty.
    Raises `BodyRefused` (400 cut short, 413 over `limit`)."""
    stream = environ["wsgi.input"]
    if declared is not None:
        if 0 < declared <= _READ_CHUNK:
            # The usual body: one read, unless the stream hands it over in pieces.
            chunk = _read_chunk(stream, declared, declared, declared)
            if len(chunk) == declared:
                return chunk if chunk.__class__ is bytes else bytes(chunk)
            return b"".join((chunk, _read_exactly(stream, declared - len(chunk), declared)))
        return _read_exactly(stream, declared, declared)
    if environ.get("wsgi.input_terminated"):
        return _read_to_end(stream, limit)
    return b""


def _read_exactly(stream: io.RawIOBase, length: int, declared: int) -> bytes:
    parts: list[bytes] = []
    remaining = length
    while remaining > 0:
        chunk = _read_chunk(stream, min(remaining, _READ_CHUNK), remaining, declared)
        parts.append(chunk)
        remaining -= len(chunk)
    return b"".join(parts)


def _read_chunk(stream: io.RawIOBase, size: int, remaining: int, declared: int) -> bytes:
    """At most `size` bytes, at least one; the client left when there are none (400)."""
    try:
        chunk = stream.read(size)
    except OSError as exc:  # gunicorn's NoMoreData and socket errors: the client left
        log.info("client disconnected mid-body after %d of %d bytes: %s", declared - remaining, declared, exc)
        raise rules.incomplete() from exc
    if not chunk:
        raise rules.incomplete()
    return chunk


def _read_to_end(stream: io.RawIOBase, limit: int) -> bytes:
    parts: list[bytes] = []
    total = 0
    while True:
        try:
            chunk = stream.read(_READ_CHUNK)
        except OSError as exc:
            raise rules.incomplete() from exc
        if not chunk:
            return b"".join(parts)
        total += len(chunk)
        rules.check_read(total, limit)
        parts.append(chunk)


class _Captured:
    """PEP 3333's start_response / write / iterable / exc_info, feeding the
    gate's bounded capture instead of a server."""

    def __init__(self, capture: Capture) -> None:
        self.capture = capture
        self.status: str | None = None
        # What a streaming server would already have put on the wire: once a
        # non-empty chunk is out, the headers are committed.
        self.headers_sent = False

    def start_response(
        self, status: str, headers: list[tuple[str, str]], exc_info: ExcInfo = None
    ) -> Callable[[bytes], object]:
        if exc_info:
            try:
                if self.headers_sent:
                    raise exc_info[1].with_traceback(exc_info[2])  # type: ignore[union-attr]
            finally:
                exc_info = None  # break the traceback reference cycle
        elif self.status is not None:
            raise AssertionError("start_response was called a second time without exc_info")
        if not isinstance(status, str) or not _STATUS_LINE.match(status):
            raise ValueError(f"WSGI status must be a string like '201 Created', got {status!r}")
        self.status = status
        self.capture.status = None  # a second start_response (with exc_info) replaces the first
        self.capture.start(int(status[:3]), headers)
        return self.write

    def write(self, data: bytes) -> None:
        if self.status is None:
            raise AssertionError("write() was called before start_response()")
        self._append(data)

    def _append(self, data: bytes) -> None:
        if not isinstance(data, bytes):
            raise TypeError(f"a WSGI app must produce bytes, got {type(data).__name__}")
        if data:
            self.headers_sent = True
            self.capture.add(data)

    def consume(self, result: Iterable[bytes]) -> None:
        capture = self.capture
        try:
            for chunk in result:
                if self.status is None:
                    raise AssertionError("the application produced a body before calling start_response()")
                if chunk.__class__ is bytes and chunk:  # the usual chunk, without _append's call
                    self.headers_sent = True
                    capture.add(chunk)
                else:
                    self._append(chunk)
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        if self.status is None:
            raise AssertionError("the application returned without calling start_response()")


def _run_app(app: WSGIApplication, environ: WSGIEnvironment, body: bytes, capture: Capture) -> None:
    """Run the wrapped app once on `environ` (the request's, copied for the
    app), its answer captured instead of sent."""
    # The app gets the body the fingerprint covered, de-chunked, with its
    # exact length: plain PEP 3333 input, read by CONTENT_LENGTH. The
    # input_terminated extension is dropped because frameworks honour it by
    # calling read() without a size, which PEP 3333 input need not support.
    environ["wsgi.input"] = io.BytesIO(body)
    environ["CONTENT_LENGTH"] = str(len(body))
    environ.pop("wsgi.input_terminated", None)
    environ.pop("HTTP_TRANSFER_ENCODING", None)
    captured = _Captured(capture)
    captured.consume(app(environ, captured.start_response))


class _Body(list[bytes]):
    """The iterable handed to the server (a list: iterating it costs no
    Python call). Its close() runs the post-response housekeeping, so the
    sweep never delays the answer (PEP 3333: the server calls close() once
    the response has been sent)."""

    __slots__ = ("_after",)

    _after: Callable[[], object] | None

    def close(self) -> None:
        after, self._after = self._after, None
        if after is None:
            return
        try:
            after()
        except Exception:  # the answer is already out; a failed sweep must not turn into a 500
            log.exception("post-response housekeeping failed")


class IdempotencyMiddleware(gates.GatedMiddleware[WSGIApplication, WSGIEnvironment]):
    """Wrap a WSGI app so every protected request honours its Idempotency-Key.

    `principal(environ)` returns the caller's identity from the app's own auth
    layer (an account id, `REMOTE_USER`, a session), or None to refuse with
    401; never a value the client controls directly. Methods the ledger's
    `Policy` does not protect pass straight through, as do requests for which
    `exempt(environ)` is true, and requests without an `Idempotency-Key`
    header for which `key_optional(environ)` is true.

    >>> import io
    >>> def orders(environ, start_response):
    ...     start_response("201 Created", [("Content-Type", "application/json")])
    ...     return [b'{"id":7}']
    >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
    >>> app = IdempotencyMiddleware(orders, ledger, principal=lambda env: env.get("REMOTE_USER"),
    ...                             exempt=lambda env: env["PATH_INFO"] == "/login")
    >>> environ = {"REQUEST_METHOD": "POST", "PATH_INFO": "/orders", "REMOTE_USER": "acct_1",
    ...            "HTTP_IDEMPOTENCY_KEY": "k1", "CONTENT_LENGTH": "2", "wsgi.input": io.BytesIO(b"{}")}
    >>> b"".join(app(environ, lambda status, headers: print(status)))
    201 Created
    b'{"id":7}'
    """

    def __init__(
        self,
        app: WSGIApplication,
        ledger: Ledger,
        *,
        principal: Callable[[WSGIEnvironment], str | None],
        exempt: EnvironPredicate | None = None,
        key_optional: EnvironPredicate | None = None,
        release_on_error: bool | EnvironPredicate = False,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        replayed_header: bool = False,
        unavailable_retry_after_ms: int = DEFAULT_UNAVAILABLE_RETRY_AFTER_MS,
    ) -> None:
        gate = gates.adapter_gate(
            ledger, principal, "environ", log, max_body_bytes, replayed_header, unavailable_retry_after_ms
        )
        super().__init__(app, ledger, gate, principal, exempt, key_optional, release_on_error)

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        gate = self.gate
        # The fingerprint headers' environ names, mapped once for this ledger's policy.
        request = parse_environ(environ, environ_names(self.ledger.policy.fingerprint_headers))
        door = _Door(self, environ, start_response)
        result: Iterable[bytes] = drive(gate, sequence(gate, request, door), door)
        return result


class _Door(gates.MiddlewareDoor[WSGIEnvironment]):
    """One request's WSGI side: the environ (`request`) in, the answer out."""

    __slots__ = ("start_response",)

    middleware: IdempotencyMiddleware

    def __init__(self, middleware: IdempotencyMiddleware, environ: WSGIEnvironment, start_response: StartResponse):
        self.middleware, self.request, self.start_response = middleware, environ, start_response

    def principal(self) -> object:
        return self.middleware.principal(self.request)

    def read_body(self, limit: int, declared: int | None) -> bytes:
        return read_body(self.request, limit, declared)

    def run(self, need: Run) -> None:
        inner = dict(self.request)  # the app's own copy, changed by _run_app too
        inner[PRINCIPAL_ENVIRON_KEY] = need.principal
        _run_app(self.middleware.app, inner, need.body, need.capture)

    def send(self, delivery: Delivery, after: Callable[[], None] | None) -> _Body:
        answer = delivery.answer
        headers = wire_headers(answer, replayed_header=self.middleware.gate.replayed_header)
        self.start_response(status_line(answer.status), headers)
        body = answer.body
        out = _Body((body,) if body else ())
        out._after = after
        return out

    def pass_through(self) -> Iterable[bytes]:
        return self.middleware.app(self.request, self.start_response)


__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "PRINCIPAL_ENVIRON_KEY",
    "REPLAYED_HEADER",
    "IdempotencyMiddleware",
    "environ_headers",
    "parse",
    "read_body",
    "request_target",
    "status_line",
]
