"""Flask: protect one view whose principal only the request context knows.

The WSGI middleware resolves the principal from the environ, before Flask
runs. An app whose caller is known only inside Flask (Flask-Login's
``current_user``, the session) protects its views one by one instead:
``@idempotent(ledger, principal=...)`` calls `principal()` inside the
request, then claims the key, runs the view at most once per key and sends
the stored answer, with the middleware's contract, options and bytes.

>>> from flask import Flask
>>> from idemctl import Ledger
>>> from idemctl.flask import idempotent
>>> ledger = Ledger.open(":memory:"); _ = ledger.init()
>>> app = Flask(__name__)
>>> @app.post("/orders")
... @idempotent(ledger, principal=lambda: "acct_1")  # e.g. current_user.get_id()
... def create_order():
...     return {"id": 7}, 201, {"Location": "/orders/7"}
>>> from werkzeug.test import Client
>>> client = Client(app)  # or app.test_client()
>>> first = client.post("/orders", json={"sku": "tea"}, headers={"Idempotency-Key": "k1"})
>>> again = client.post("/orders", json={"sku": "tea"}, headers={"Idempotency-Key": "k1"})
>>> first.status_code, again.status_code, again.get_data() == first.get_data()
(201, 201, True)
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar, cast
from wsgiref.types import WSGIEnvironment

from flask import Response, current_app, request
from werkzeug.datastructures import Headers
from werkzeug.exceptions import ClientDisconnected

from . import gate as gates
from .capture import Capture
from .gate import BodyRefused, Delivery
from .ledger import Ledger
from .outcomes import Answer, Ticket
from .wire import DEFAULT_MAX_BODY_BYTES, DEFAULT_UNAVAILABLE_RETRY_AFTER_MS, wire_headers
from .wsgi import PRINCIPAL_ENVIRON_KEY, environ_headers, request_target, status_line

log = logging.getLogger("idemctl.flask")

F = TypeVar("F", bound=Callable[..., Any])


def _read_body(limit: int) -> bytes:
    """The request body, refused (400, 411, 413) by the gate's rules."""
    environ = request.environ
    declared = gates.declared_length(environ.get("CONTENT_LENGTH"), limit)
    if declared is None and environ.get("HTTP_TRANSFER_ENCODING") and not environ.get("wsgi.input_terminated"):
        raise gates.length_required()
    try:
        # Cached: the view reads the same bytes (get_data, get_json, form).
        body = request.get_data(cache=True)
    except ClientDisconnected as exc:
        log.info("client disconnected mid-body: %s", exc)
        raise gates.incomplete() from None
    gates.check_read(len(body), limit)
    gates.check_complete(len(body), declared)
    return body


class _AnswerResponse(Response):
    """Sent with exactly the headers it holds, as the WSGI middleware sends
    them: Werkzeug would rename `location` to `Location` on the way out."""

    def get_wsgi_headers(self, environ: WSGIEnvironment) -> Headers:
        return Headers(self.headers)


def _capture(response: Response, capture: Capture) -> None:
    """The view's response as a WSGI server would receive it, fed into the
    bounded capture (a streamed one is consumed, then closed)."""
    try:
        capture.start(response.status_code, response.get_wsgi_headers(request.environ).items())
        capture.drain(response.iter_encoded())
    finally:
        response.close()


def idempotent(
    ledger: Ledger,
    *,
    principal: Callable[[], str | None],
    release_on_error: bool = False,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    replayed_header: bool = False,
    unavailable_retry_after_ms: int = DEFAULT_UNAVAILABLE_RETRY_AFTER_MS,
) -> Callable[[F], F]:
    """A decorator that puts one Flask view under the Idempotency-Key
    contract. `principal()` is called inside the request (for Flask-Login:
    ``lambda: current_user.get_id() if current_user.is_authenticated else
    None``); None answers 401. Methods the ledger's Policy does not protect
    call the view untouched. The other options mean what they mean for the
    WSGI middleware. Put it under ``@app.route``."""
    gate = gates.adapter_gate(ledger, principal, "()", log, max_body_bytes, replayed_header, unavailable_retry_after_ms)

    def send(delivery: Delivery) -> Response:
        answer = delivery.answer
        response = _AnswerResponse(answer.body)
        response.status = status_line(answer.status)
        response.headers = Headers(wire_headers(answer, replayed_header=gate.replayed_header))
        sweep = gate.sweep_after(delivery)
        if sweep is not None:
            # Werkzeug calls it when the server closes the response: after the answer.
            response.call_on_close(sweep)
        return response

    def run(view: Callable[..., Any], ticket: Ticket, args: Any, kwargs: Any) -> Delivery:
        capture = gate.capture()
        try:
            try:
                result = view(*args, **kwargs)
            except Exception as exc:
                # What Flask makes of it (abort(404), a registered error
                # handler) is the answer; an unhandled one propagates.
                result = current_app.handle_user_exception(exc)
            _capture(current_app.make_response(result), capture)
        except BaseException:
            gate.abandon(ticket, release=release_on_error)
            raise
        return gate.finish(ticket, capture)

    def decorate(view: F) -> F:
        @functools.wraps(view)
        def protected(*args: Any, **kwargs: Any) -> Any:
            method = request.method.upper()
            if not ledger.policy.protects(method):
                return view(*args, **kwargs)
            target = request_target(request.environ)
            # Werkzeug joins repeated header fields before the view sees them.
            key = request.environ.get("HTTP_IDEMPOTENCY_KEY")
            who = gate.principal(principal(), key=key, method=method, target=target)
            if isinstance(who, Answer):
                return send(gates.replied(who))
            try:
                body = _read_body(gate.max_body_bytes)
            except BodyRefused as refused:
                return send(gates.replied(gate.refused(refused, principal=who, key=key, method=method, target=target)))
            headers = environ_headers(request.environ, ledger.policy.fingerprint_headers)
            decision = gate.begin(who, key, method, target, headers, body)
            if isinstance(decision, Answer):
                return send(gates.replied(decision))
            request.environ[PRINCIPAL_ENVIRON_KEY] = who
            return send(run(view, decision, args, kwargs))

        return cast(F, protected)

    return decorate


__all__ = ["idempotent"]
