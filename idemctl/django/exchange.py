"""One protected request's exchange with the ledger, for the middleware and
the DRF mixin alike: its body and target, the decision, the view's response
captured, and the answer sent as a Django response.

Answers are the WSGI middleware's, byte for byte: the view's response
(streamed or not) is collected whole, stored, and the answer built from
what was stored is sent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from django import conf as django_conf
from django.core.exceptions import ImproperlyConfigured, RequestDataTooBig
from django.http import HttpResponse, RawPostDataException, UnreadablePostError

from .. import asgi, responses, wsgi
from .. import gate as gates
from ..capture import Capture
from ..gate import BodyRefused, Delivery, Gate
from ..ledger import Ledger
from ..outcomes import Answer, Ticket
from ..wire import wire_headers
from .conf import Config, log


def _is_asgi(request: Any) -> bool:
    return isinstance(getattr(request, "scope", None), dict)


def request_target(request: Any) -> str:
    """What the fingerprint covers: the target the WSGI middleware (or, under
    ASGI, the ASGI middleware) would see for this request."""
    if not _is_asgi(request):
        return wsgi.request_target(request.META)
    scope = dict(request.scope)
    query = scope.get("query_string")
    if isinstance(query, str):  # Django's AsyncClient puts a str where servers put bytes
        scope["query_string"] = query.encode("latin-1")
    return asgi.request_target(scope)


def read_body(request: Any, limit: int) -> bytes:
    """The request body, refused (400, 411, 413) by the gate's rules."""
    meta = request.META
    declared = gates.declared_length(meta.get("CONTENT_LENGTH"), limit)
    if declared is None and meta.get("HTTP_TRANSFER_ENCODING") and not _is_asgi(request):
        # Django reads a WSGI body by its Content-Length alone: a chunked one
        # would reach the view (and the fingerprint) empty.
        raise gates.length_required()
    try:
        body = request.body
    except RequestDataTooBig:
        raise BodyRefused(responses.body_too_large(int(django_conf.settings.DATA_UPLOAD_MAX_MEMORY_SIZE))) from None
    except UnreadablePostError as exc:
        log.info("client disconnected mid-body: %s", exc)
        raise gates.incomplete() from None
    except RawPostDataException:
        raise ImproperlyConfigured(
            "the request body was parsed as a stream (request.POST of a multipart body) before idemctl could "
            "read it for the fingerprint: list IdempotencyMiddleware before the middleware that reads it"
        ) from None
    if not isinstance(body, bytes):
        raise TypeError(f"request.body must be bytes, got {type(body).__name__}")
    gates.check_read(len(body), limit)
    gates.check_complete(len(body), declared)
    return body


def buffer_multipart(request: Any, limit: int) -> None:
    """Read a multipart body into memory before anything parses it as a
    stream (CsrfViewMiddleware and DRF's SessionAuthentication read
    request.POST), which would leave nothing for the fingerprint. Other
    bodies are read by their parsers through request.body anyway."""
    if not str(request.META.get("CONTENT_TYPE", "")).lower().startswith("multipart/"):
        return
    with contextlib.suppress(BodyRefused):  # answered when the request is decided, if its view is protected
        read_body(request, limit)


def begin(config: Config, request: Any, who: object) -> Answer | Ticket:
    """The gate's decision for a protected request (Django's HttpRequest)."""
    gate = config.gate
    method = str(request.method).upper()
    target = request_target(request)
    # Django's handlers join repeated header fields before the view sees them.
    key = request.META.get("HTTP_IDEMPOTENCY_KEY")
    principal = gate.principal(who, key=key, method=method, target=target)
    if isinstance(principal, Answer):
        return principal
    try:
        body = read_body(request, config.max_body_bytes)
    except BodyRefused as refused:
        return gate.refused(refused, principal=principal, key=key, method=method, target=target)
    headers = wsgi.environ_headers(request.META, config.policy.fingerprint_headers)
    return gate.begin(principal, key, method, target, headers, body)


def capture_response(response: Any, capture: Capture) -> None:
    """A Django response fed into the bounded capture: a streamed one is
    consumed to its end (which finishes a generator), and the file a
    `FileResponse` streams is closed.

    Never ``response.close()``: it also sends ``request_finished``, and the
    request is not finished while the answer built from this response is
    still to go out. Whatever else the response would close is left to the
    garbage collector, as Django's own middleware leave a response they
    replace (``ConditionalGetMiddleware``'s 304)."""
    try:
        headers = [(str(k), str(v)) for k, v in response.items()]
        headers += [("Set-Cookie", morsel.output(header="").strip()) for morsel in response.cookies.values()]
        capture.start(int(response.status_code), headers)
        if response.streaming:
            for chunk in response:
                capture.add(chunk)
        else:
            capture.add(bytes(response.content))
    finally:
        streamed = getattr(response, "file_to_stream", None)
        if streamed is not None and callable(getattr(streamed, "close", None)):
            try:
                streamed.close()
            except Exception:
                log.exception("closing the file the view's response streamed failed")


def complete(config: Config, ticket: Ticket, response: Any, request: Any) -> Delivery:
    """Store the view's answer: what to send, and whether to sweep after it."""
    captured = config.gate.capture()
    try:
        capture_response(response, captured)
    except BaseException:
        # A stream that fails after the view returned: the view's failure.
        config.gate.abandon(ticket, release=config.release(request))
        raise
    return config.gate.finish(ticket, captured)


class AnswerResponse(HttpResponse):  # type: ignore[misc]  # Django ships no type information
    """The ledger's answer as a Django response, carrying exactly the WSGI
    middleware's status line, headers and body. `after` (the post-response
    sweep) runs when the server closes the response, once the answer is out."""

    def __init__(self, answer: Answer, *, replayed_header: bool, after: Callable[[], None] | None = None) -> None:
        super().__init__(answer.body, status=answer.status)
        self.after = after
        self.reason_phrase = wsgi.status_line(answer.status)[4:]
        del self["Content-Type"]  # HttpResponse's default; the answer says what it has
        seen: dict[str, str] = {}
        for name, value in wire_headers(answer, replayed_header=replayed_header):
            lname = name.lower()
            if lname == "set-cookie":
                # Django sends cookies from response.cookies, one field each: never folded.
                self.cookies.load(value)
            elif lname in seen:
                # Django holds one value per name: a repeated field is joined, as
                # RFC 9110 §5.3 allows for every field but Set-Cookie.
                seen[lname] = self[name] = f"{seen[lname]}, {value}"
            else:
                seen[lname] = self[name] = value

    def close(self) -> None:
        after, self.after = self.after, None
        try:
            if after is not None:
                after()
        finally:
            super().close()


def answer_response(answer: Answer, *, replayed_header: bool = False, sweep: Ledger | None = None) -> HttpResponse:
    """An Answer as a Django response carrying exactly the WSGI middleware's
    status line, headers and body. With `sweep`, the bounded sweep runs
    when the server closes the response, after the answer has gone out."""
    gate = Gate(sweep, replayed_header=replayed_header) if sweep is not None else None
    return respond(Delivery(answer, sweep is not None), replayed_header, gate)


def respond(delivery: Delivery, replayed_header: bool, gate: Gate | None) -> AnswerResponse:
    """What an adapter's answer becomes: the response, with the sweep the gate allows after it."""
    after = gate.sweep_after(delivery) if gate is not None else None
    return AnswerResponse(delivery.answer, replayed_header=replayed_header, after=after)


class State:
    """One request's passage through the middleware or the mixin."""

    __slots__ = ("answer", "config", "decided", "path_exempt", "raised", "ticket")

    def __init__(self, config: Config, path_exempt: bool) -> None:
        self.config = config
        self.path_exempt = path_exempt
        self.decided = False
        self.answer: Answer | None = None
        self.ticket: Ticket | None = None
        self.raised = False

    def abandon(self, request: Any) -> None:
        ticket, self.ticket = self.ticket, None
        if ticket is not None:
            self.config.gate.abandon(ticket, release=self.config.release(request))


__all__ = [
    "AnswerResponse",
    "State",
    "answer_response",
    "begin",
    "buffer_multipart",
    "capture_response",
    "complete",
    "read_body",
    "request_target",
    "respond",
]
