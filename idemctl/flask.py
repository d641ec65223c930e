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
import re
from collections.abc import Callable
from typing import Any, TypeVar, cast
from wsgiref.types import WSGIEnvironment

from flask import Response, current_app, request
from werkzeug.datastructures import Headers
from werkzeug.exceptions import ClientDisconnected

from . import responses
from .errors import AnswerNotStoredError, LedgerUnavailableError, StorageError
from .ledger import Ledger
from .outcomes import Answer, Outcome
from .wire import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_UNAVAILABLE_RETRY_AFTER_MS,
    check_options,
    log_not_stored,
    wire_headers,
)
from .wsgi import PRINCIPAL_ENVIRON_KEY, environ_headers, request_target, status_line

log = logging.getLogger("idemctl.flask")

F = TypeVar("F", bound=Callable[..., Any])
_CONTENT_LENGTH = re.compile(r"[0-9]+\Z")


class _Refused(Exception):
    def __init__(self, answer: tuple[int, responses.Headers, bytes]) -> None:
        super().__init__(answer[0])
        self.answer = answer


def _read_body(limit: int) -> bytes:
    """The request body, refused (400, 411, 413) as the WSGI middleware refuses it."""
    environ = request.environ
    declared = str(environ.get("CONTENT_LENGTH", "") or "").strip(" \t")
    if declared:
        if not _CONTENT_LENGTH.match(declared):
            raise _Refused(responses.content_length_invalid())
        if int(declared) > limit:
            raise _Refused(responses.body_too_large(limit))
    elif environ.get("HTTP_TRANSFER_ENCODING") and not environ.get("wsgi.input_terminated"):
        raise _Refused(responses.length_required())
    try:
        # Cached: the view reads the same bytes (get_data, get_json, form).
        body = request.get_data(cache=True)
    except ClientDisconnected as exc:
        log.info("client disconnected mid-body: %s", exc)
        raise _Refused(responses.body_incomplete()) from None
    if len(body) > limit:
        raise _Refused(responses.body_too_large(limit))
    if declared and len(body) != int(declared):
        raise _Refused(responses.body_incomplete())
    return body


class _AnswerResponse(Response):
    """Sent with exactly the headers it holds, as the WSGI middleware sends
    them: Werkzeug would rename `location` to `Location` on the way out."""

    def get_wsgi_headers(self, environ: WSGIEnvironment) -> Headers:
        return Headers(self.headers)


def _captured(response: Response) -> tuple[int, list[tuple[str, str]], bytes]:
    """The view's response as status, headers and its whole body (a streamed
    one is consumed and closed), as a WSGI server would have received it."""
    try:
        headers = list(response.get_wsgi_headers(request.environ).items())
        return response.status_code, headers, b"".join(response.iter_encoded())
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
    check_options(principal, max_body_bytes, unavailable_retry_after_ms, takes="()")

    def send(answer: Answer, *, sweep: bool = True) -> Response:
        response = _AnswerResponse(answer.body)
        response.status = status_line(answer.status)
        response.headers = Headers(wire_headers(answer, replayed_header=replayed_header))
        if sweep and answer.started_at is not None:
            # Werkzeug calls it when the server closes the response: after the answer.
            response.call_on_close(lambda: ledger.after_response(answer))
        return response

    def decorate(view: F) -> F:
        @functools.wraps(view)
        def protected(*args: Any, **kwargs: Any) -> Any:
            method = request.method.upper()
            if not ledger.policy.protects(method):
                return view(*args, **kwargs)
            who = principal()
            if who is not None and not isinstance(who, str):
                raise TypeError(f"principal() must return str or None, got {type(who).__name__}")
            if not who:
                return send(Answer(*responses.unauthenticated(), Outcome.UNAUTHENTICATED))
            try:
                body = _read_body(max_body_bytes)
            except _Refused as refused:
                return send(Answer(*refused.answer, Outcome.BODY_REFUSED))
            target = request_target(request.environ)
            headers = environ_headers(request.environ, ledger.policy.fingerprint_headers)
            key = request.environ.get("HTTP_IDEMPOTENCY_KEY")
            try:
                decision = ledger.begin(who, key, method, target, headers, body)
            except StorageError as exc:
                # Fail closed: an unprotected mutation is worse than a refused one.
                level = logging.WARNING if isinstance(exc, LedgerUnavailableError) else logging.ERROR
                log.log(level, "idempotency ledger unavailable, refused %s %s with 503: %s", method, target, exc)
                return send(Answer(*responses.unavailable(unavailable_retry_after_ms), Outcome.UNAVAILABLE))
            if isinstance(decision, Answer):
                return send(decision)

            request.environ[PRINCIPAL_ENVIRON_KEY] = who
            try:
                try:
                    result = view(*args, **kwargs)
                except Exception as exc:
                    # What Flask makes of it (abort(404), a registered error
                    # handler) is the answer; an unhandled one propagates.
                    result = current_app.handle_user_exception(exc)
                status, out_headers, out_body = _captured(current_app.make_response(result))
            except BaseException:
                ledger.abandon(decision, release=release_on_error)
                raise
            try:
                answer = ledger.finish(decision, status, out_headers, out_body)
            except AnswerNotStoredError as exc:
                log_not_stored(log, exc, who, key)
                return send(exc.answer, sweep=False)
            return send(answer)

        return cast(F, protected)

    return decorate


__all__ = ["idempotent"]
