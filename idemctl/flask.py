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

from flask import Request, Response, current_app, request
from werkzeug.datastructures import Headers
from werkzeug.exceptions import ClientDisconnected

from .exchange import body as rules
from .exchange import gate as gates
from .exchange.capture import Capture
from .exchange.drive import drive
from .exchange.environ import PRINCIPAL_ENVIRON_KEY, environ_names, parse_environ
from .exchange.gate import Delivery, Gate
from .exchange.sequence import EveryRequestProtected, Run, sequence
from .exchange.wire import DEFAULT_MAX_BODY_BYTES, DEFAULT_UNAVAILABLE_RETRY_AFTER_MS, status_line, wire_headers
from .ledger import Ledger

log = logging.getLogger("idemctl.flask")

F = TypeVar("F", bound=Callable[..., Any])
View = Callable[..., Any]
Principal = Callable[[], "str | None"]


def _read_body(req: Request) -> bytes:
    """The request body (the sequence applies the body rules to it)."""
    try:
        # Cached: the view reads the same bytes (get_data, get_json, form).
        return req.get_data(cache=True)
    except ClientDisconnected as exc:
        log.info("client disconnected mid-body: %s", exc)
        raise rules.incomplete() from None


class _AnswerResponse(Response):
    """Sent with exactly the headers it holds, as the WSGI middleware sends
    them: Werkzeug would rename `location` to `Location` on the way out."""

    # Built with the answer's own headers: no default Content-Type added.
    default_mimetype = None

    def get_wsgi_headers(self, environ: WSGIEnvironment) -> Headers:
        # Werkzeug only reads what this returns (to_wsgi_list): no copy needed.
        return self.headers


def _capture(response: Response, environ: WSGIEnvironment, capture: Capture) -> None:
    """The view's response as a WSGI server would receive it, fed into the
    bounded capture (a streamed one is consumed, then closed)."""
    try:
        capture.start(response.status_code, response.get_wsgi_headers(environ).items())
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

    # The fingerprint headers' environ names, mapped once.
    pairs = environ_names(tuple(ledger.policy.fingerprint_headers))

    def decorate(view: F) -> F:
        @functools.wraps(view)
        def protected(*args: Any, **kwargs: Any) -> Any:
            # The request proxy resolved once: each use of it is three Python calls.
            req = request._get_current_object()  # type: ignore[attr-defined]
            door = _Door(gate, view, args, kwargs, principal, release_on_error, req)
            return drive(gate, sequence(gate, parse_environ(req.environ, pairs), door), door)

        return cast(F, protected)

    return decorate


class _Door(EveryRequestProtected):
    """One call of a protected view: Flask's request context in, a Flask response out."""

    __slots__ = ("args", "gate", "kwargs", "principal_source", "release_on_error", "request", "view")

    def __init__(
        self, gate: Gate, view: View, args: Any, kwargs: Any, principal: Principal, release: bool, req: Request
    ):
        self.request, self.gate, self.view = req, gate, view
        self.args, self.kwargs = args, kwargs
        self.principal_source, self.release_on_error = principal, release

    def principal(self) -> object:
        return self.principal_source()

    def read_body(self, limit: int, declared: int | None) -> bytes:
        return _read_body(self.request)

    def run(self, need: Run) -> None:
        environ = self.request.environ
        environ[PRINCIPAL_ENVIRON_KEY] = need.principal
        app = current_app._get_current_object()  # type: ignore[attr-defined]
        try:
            result = self.view(*self.args, **self.kwargs)
        except Exception as exc:
            # What Flask makes of it (abort(404), a registered error
            # handler) is the answer; an unhandled one propagates.
            result = app.handle_user_exception(exc)
        _capture(app.make_response(result), environ, need.capture)

    def send(self, delivery: Delivery, after: Callable[[], None] | None) -> Response:
        answer = delivery.answer
        headers = Headers(wire_headers(answer, replayed_header=self.gate.replayed_header))
        # The body as a list: set_data would add a Content-Length of its own.
        response = _AnswerResponse([answer.body], status_line(answer.status), headers)
        if after is not None:
            # Werkzeug calls it when the server closes the response: after the answer.
            response.call_on_close(after)
        return response

    def pass_through(self) -> Any:
        return self.view(*self.args, **self.kwargs)


__all__ = ["idempotent"]
