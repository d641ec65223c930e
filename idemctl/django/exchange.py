"""One protected request's Django side, for the middleware and the DRF
mixin alike: the request parsed for the sequence, its body, the view's
response captured, and the answer sent as a Django response. Django runs
the view after the middleware (or DRF's ``initial``) returned, so the
sequence waits for it (:class:`~idemctl.exchange.drive.Later`) and is
resumed with the view's response.

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

from .. import responses
from ..exchange import body as rules
from ..exchange import environ as environs
from ..exchange import scope as scopes
from ..exchange.body import BodyRefused
from ..exchange.capture import Capture
from ..exchange.drive import LATER, Later, drive
from ..exchange.gate import Delivery, Gate
from ..exchange.sequence import Request, Run, sequence
from ..exchange.wire import status_line, wire_headers
from ..ledger import Ledger
from ..outcomes import Answer
from .conf import Config, log
from .marks import EXEMPT, KEY_OPTIONAL


def _is_asgi(request: Any) -> bool:
    return isinstance(getattr(request, "scope", None), dict)


def request_target(request: Any, under_asgi: bool | None = None) -> str:
    """What the fingerprint covers: the target the WSGI middleware (or, under
    ASGI, the ASGI middleware) would see for this request."""
    if not (_is_asgi(request) if under_asgi is None else under_asgi):
        return environs.request_target(request.META)
    scope = dict(request.scope)
    query = scope.get("query_string")
    if isinstance(query, str):  # Django's AsyncClient puts a str where servers put bytes
        scope["query_string"] = query.encode("latin-1")
    return scopes.request_target(scope)


def parse(request: Any, fingerprint_headers: Any) -> Request:
    """What the sequence needs of a Django request."""
    meta = request.META
    under_asgi = _is_asgi(request)
    # Django's handlers join repeated header fields before the view sees them.
    key = meta.get("HTTP_IDEMPOTENCY_KEY")
    return Request(
        str(request.method).upper(),
        request_target(request, under_asgi),
        () if key is None else (key,),
        environs.environ_headers(meta, fingerprint_headers),
        meta.get("CONTENT_LENGTH"),
        # Django reads a WSGI body by its Content-Length alone: a chunked one
        # would reach the view (and the fingerprint) empty.
        bool(meta.get("HTTP_TRANSFER_ENCODING")) and not under_asgi,
    )


def _body(request: Any) -> bytes:
    """`request.body`, or the refusal when it cannot be read."""
    try:
        body = request.body
    except RequestDataTooBig:
        raise BodyRefused(responses.body_too_large(int(django_conf.settings.DATA_UPLOAD_MAX_MEMORY_SIZE))) from None
    except UnreadablePostError as exc:
        log.info("client disconnected mid-body: %s", exc)
        raise rules.incomplete() from None
    except RawPostDataException:
        raise ImproperlyConfigured(
            "the request body was parsed as a stream (request.POST of a multipart body) before idemctl could "
            "read it for the fingerprint: list IdempotencyMiddleware before the middleware that reads it"
        ) from None
    if not isinstance(body, bytes):
        raise TypeError(f"request.body must be bytes, got {type(body).__name__}")
    return body


def read_body(request: Any, limit: int) -> bytes:
    """The request body, refused (400, 411, 413) by the body rules."""
    meta = request.META
    declared = rules.declared_length(meta.get("CONTENT_LENGTH"), limit)
    if declared is None and meta.get("HTTP_TRANSFER_ENCODING") and not _is_asgi(request):
        raise rules.length_required()
    body = _body(request)
    rules.check_read(len(body), limit)
    rules.check_complete(len(body), declared)
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


class AnswerResponse(HttpResponse):  # type: ignore[misc]  # Django ships no type information
    """The ledger's answer as a Django response, carrying exactly the WSGI
    middleware's status line, headers and body. `after` (the post-response
    sweep) runs when the server closes the response, once the answer is out."""

    def __init__(self, answer: Answer, *, replayed_header: bool, after: Callable[[], None] | None = None) -> None:
        # The headers are given to HttpResponse at once: no default
        # Content-Type set, then deleted, for an answer that carries its own.
        fields: dict[str, tuple[str, str]] = {}
        cookies: list[str] = []
        for name, value in wire_headers(answer, replayed_header=replayed_header):
            lname = name.lower()
            if lname == "set-cookie":
                # Django sends cookies from response.cookies, one field each: never folded.
                cookies.append(value)
            elif lname in fields:
                # Django holds one value per name: a repeated field is joined, as
                # RFC 9110 §5.3 allows for every field but Set-Cookie.
                fields[lname] = (name, f"{fields[lname][1]}, {value}")
            else:
                fields[lname] = (name, value)
        status = answer.status
        super().__init__(
            answer.body,
            status=status,
            reason=status_line(status)[4:],
            headers=dict(fields.values()),
        )
        self.after = after
        if "content-type" not in fields:
            del self["Content-Type"]  # HttpResponse's default; the answer says what it has
        for value in cookies:
            self.cookies.load(value)

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


class Door:
    """One protected request's Django side. `request` is Django's
    HttpRequest (its META, body and path); `caller` is what the principal
    source is given (DRF's Request for the mixin); `mode` the view's mark."""

    __slots__ = ("caller", "config", "delivery", "mode", "request")

    def __init__(self, config: Config, request: Any, caller: Any, mode: str | None) -> None:
        self.config = config
        self.request = request
        self.caller = caller
        self.mode = mode
        self.delivery: Delivery | None = None

    def exempt(self) -> bool:
        return self.mode == EXEMPT

    def key_optional(self) -> bool:
        return self.mode == KEY_OPTIONAL

    def release(self) -> bool:
        return self.config.release(self.request)

    def principal(self) -> object:
        return self.config.principal(self.caller)

    def read_body(self, limit: int, declared: int | None) -> bytes:
        return _body(self.request)

    def run(self, need: Run) -> object:
        self.request.META[environs.PRINCIPAL_ENVIRON_KEY] = need.principal  # as the WSGI middleware puts it
        return LATER  # Django runs the view once the door has returned

    def send(self, delivery: Delivery, after: Callable[[], None] | None) -> AnswerResponse:
        self.delivery = delivery
        return AnswerResponse(delivery.answer, replayed_header=self.config.replayed_header, after=after)

    def pass_through(self) -> None:
        return None


def start(config: Config, request: Any, caller: Any, mode: str | None) -> tuple[Door, AnswerResponse | Later | None]:
    """The sequence up to the view: what the door sent (an answer without
    running the view), the sequence waiting for the view, or None (pass through)."""
    door = Door(config, request, caller, mode)
    gate = config.gate
    out: AnswerResponse | Later | None = drive(
        gate, sequence(gate, parse(request, config.policy.fingerprint_headers), door), door
    )
    return door, out


class State:
    """One request's passage through the middleware or the mixin: the answer
    to send instead of the view's, or the sequence waiting for the view."""

    __slots__ = ("config", "decided", "path_exempt", "pending", "raised", "reply")

    def __init__(self, config: Config, path_exempt: bool) -> None:
        self.config = config
        self.path_exempt = path_exempt
        self.decided = False
        self.reply: AnswerResponse | None = None
        self.pending: tuple[Later, Door] | None = None
        self.raised = False

    def fail(self, exc: BaseException) -> None:
        """The view failed: the sequence abandons (or releases) its reservation."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            drive(self.config.gate, pending[0].steps, pending[1], exc)
        except BaseException as again:
            if again is not exc:
                raise

    def complete(self, response: Any) -> AnswerResponse:
        """The view's response stored: the answer to send, with the sweep after it."""
        pending, self.pending = self.pending, None
        assert pending is not None
        later, door = pending
        failed: BaseException | None = None
        try:
            capture_response(response, later.run.capture)
        except BaseException as exc:
            # A stream that fails after the view returned: the view's failure.
            failed = exc
        sent: AnswerResponse = drive(self.config.gate, later.steps, door, failed)
        return sent


__all__ = [
    "AnswerResponse",
    "Door",
    "State",
    "answer_response",
    "buffer_multipart",
    "capture_response",
    "parse",
    "read_body",
    "request_target",
    "respond",
    "start",
]
