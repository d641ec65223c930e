"""IdempotencyMiddleware in process, on a real ledger file: the contract as a
WSGI client sees it, PEP 3333 checked by wsgiref.validate on both sides of the
middleware (the server side and the app side)."""

from __future__ import annotations

import io
import logging
import sqlite3
import threading
from http import HTTPStatus
from wsgiref.util import setup_testing_defaults
from wsgiref.validate import validator

import pytest

from idemctl import Ledger, Policy, State, Status, fingerprint, wall_clock_ms
from idemctl.responses import not_stored
from idemctl.wsgi import IdempotencyMiddleware, request_target, status_line
from tests.helpers import ROOT, Reply

# Any PEP 3333 warning from either validator fails the test.
pytestmark = pytest.mark.filterwarnings("error::wsgiref.validate.WSGIWarning")

JSON = "application/json"
ORDER = b'{"sku":"tea","qty":2}'


class Input(io.BytesIO):
    """A wsgi.input that records how much the middleware read."""

    def __init__(self, data: bytes = b"", fail_after: int | None = None, piece: int | None = None) -> None:
        super().__init__(data)
        self.fail_after = fail_after
        self.piece = piece  # at most this many bytes per read, like a socket

    def read(self, size: int = -1) -> bytes:  # type: ignore[override]
        if self.fail_after is not None and self.tell() >= self.fail_after:
            raise ConnectionResetError("client went away")
        if self.fail_after is not None and size > 0:
            size = min(size, self.fail_after - self.tell())
        if self.piece is not None and size > 0:
            size = min(size, self.piece)
        return super().read(size)


def environ(
    method: str = "POST",
    path: str = "/orders",
    body: bytes = ORDER,
    *,
    key: str | None = "key-1",
    user: str | None = "acct_A",
    content_type: str | None = JSON,
    length: str | None = "auto",
    query: str = "",
    stream: io.BytesIO | None = None,
    **extra: object,
) -> dict:
    env: dict = {}
    setup_testing_defaults(env)
    env.update(REQUEST_METHOD=method, PATH_INFO=path, SCRIPT_NAME="", QUERY_STRING=query)
    env["wsgi.input"] = stream if stream is not None else Input(body)
    if length == "auto":
        env["CONTENT_LENGTH"] = str(len(body))
    elif length is not None:
        env["CONTENT_LENGTH"] = length
    if content_type is not None:
        env["CONTENT_TYPE"] = content_type
    if key is not None:
        env["HTTP_IDEMPOTENCY_KEY"] = key
    if user is not None:
        env["REMOTE_USER"] = user  # set by the (test) auth layer, never by the client
    env.update(extra)
    return env


def call(app, env: dict, *, close: bool = True) -> Reply:
    seen: dict = {}

    def start_response(status, headers, exc_info=None):
        seen["status"], seen["headers"] = status, list(headers)
        return lambda data: None

    result = app(env, start_response)
    try:
        body = b"".join(result)
    finally:
        if close and hasattr(result, "close"):
            result.close()
    return Reply(seen["status"], seen["headers"], body)


class OrdersApp:
    """A WSGI app whose side effects a test can count, with one route per
    PEP 3333 feature the middleware must adapt."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.closed = 0
        self.lock: sqlite3.Connection | None = None  # see /orders/lock-after

    def __call__(self, env, start_response):
        body = env["wsgi.input"].read(int(env.get("CONTENT_LENGTH") or 0))
        self.calls.append({"path": env["PATH_INFO"], "body": body, "environ": env})
        n = len(self.calls)
        route = env["PATH_INFO"]
        if route == "/orders":
            start_response(
                "201 Made It",
                [("Content-Type", JSON), ("Location", f"/orders/{n}"), ("X-Request-Id", f"req-{n}")],
            )
            return [b'{"id":', str(n).encode(), b"}"]
        if route == "/cancel":
            start_response("204 No Content", [])
            return []
        if route == "/echo":
            start_response("201 Created", [("Content-Type", "application/octet-stream")])
            return [body]
        if route == "/write":
            write = start_response("202 Accepted", [("Content-Type", "text/plain")])
            write(b"queued ")
            write(b"job-" + str(n).encode())
            return []
        if route == "/lazy":
            return self._lazy(start_response, n)
        if route == "/boom":
            raise RuntimeError("payment gateway timed out")
        if route == "/exc-before-body":
            start_response("200 OK", [("Content-Type", "text/plain")])
            try:
                raise KeyError("inventory")
            except KeyError:
                import sys

                start_response("500 Internal Server Error", [("Content-Type", "text/plain")], sys.exc_info())
            return [b"inventory lookup failed"]
        if route == "/exc-after-body":
            write = start_response("200 OK", [("Content-Type", "text/plain")])
            write(b"partial")
            try:
                raise KeyError("inventory")
            except KeyError:
                import sys

                start_response("500 Internal Server Error", [("Content-Type", "text/plain")], sys.exc_info())
            return [b"never"]
        if route == "/big":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"x" * 20_000]
        if route == "/odd-status":
            start_response("299 Mostly Fine", [("Content-Type", "text/plain")])
            return [b"odd"]
        if route == "/lock-after":
            # Leaves the ledger write-locked when the app returns, so the
            # completion cannot be stored (the test releases the lock).
            assert self.lock is not None
            self.lock.execute("BEGIN EXCLUSIVE")
            start_response("201 Created", [("Content-Type", JSON)])
            return [b'{"charged":true}']
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"no route"]

    def _lazy(self, start_response, n):
        # start_response is only called once the server starts iterating.
        start_response("201 Created", [("Content-Type", "text/plain")])
        yield b"lazy-"
        yield b""
        yield str(n).encode()


@pytest.fixture
def orders() -> OrdersApp:
    return OrdersApp()


def wrap(orders_app, ledger, **options):
    options.setdefault("principal", lambda env: env.get("REMOTE_USER"))
    return validator(IdempotencyMiddleware(validator(orders_app), ledger, **options))


# -- the contract -----------------------------------------------------------------------


def test_first_post_runs_once_and_the_retry_gets_the_byte_identical_stored_answer(ledger, orders):
    app = wrap(orders, ledger)
    first = call(app, environ())
    retry = call(app, environ())
    assert len(orders.calls) == 1
    expected_headers = [("content-type", JSON), ("location", "/orders/1"), ("content-length", "8")]
    # The first answer is the stored one: standard reason phrase, allowlisted
    # headers only (X-Request-Id is not replayable, so the first caller does not get it either).
    assert first == Reply("201 Created", expected_headers, b'{"id":1}')
    assert retry == first
    row = ledger.operator.get("acct_A", "key-1")
    assert row.state is State.COMPLETED and row.row.generation == 1
    assert row.row.response_status == 201 and row.row.body_bytes == b'{"id":1}'


def test_replayed_header_is_off_by_default(ledger, orders):
    app = wrap(orders, ledger)
    call(app, environ())
    assert call(app, environ()).header("Idempotent-Replayed") is None


def test_replayed_header_option_marks_replays_and_nothing_else(ledger, orders):
    app = wrap(orders, ledger, replayed_header=True)
    first = call(app, environ())
    retry = call(app, environ())
    reused = call(app, environ(body=b'{"sku":"tea","qty":3}'))
    assert first.header("Idempotent-Replayed") is None
    assert retry.headers == [
        ("content-type", JSON),
        ("location", "/orders/1"),
        ("idempotent-replayed", "true"),
        ("content-length", "8"),
    ]
    assert retry.body == first.body
    assert reused.code == 409 and reused.header("Idempotent-Replayed") is None


@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS", "PUT"])
def test_unprotected_methods_pass_through_untouched(ledger, orders, method):
    seen = {}

    def app(env, start_response):
        seen["environ"] = env
        start_response("200 Fine Thanks", [("Content-Type", "text/plain")])
        return [b"listing"]

    env = environ(method, key=None, user=None)
    stream = env["wsgi.input"]
    reply = call(IdempotencyMiddleware(app, ledger, principal=lambda e: None), env)
    assert reply == Reply("200 Fine Thanks", [("Content-Type", "text/plain")], b"listing")
    assert seen["environ"] is env and env["wsgi.input"] is stream and stream.tell() == 0
    assert ledger.operator.stats().total == 0


def test_missing_key_is_400_key_required_and_the_app_never_runs(ledger, orders):
    reply = call(wrap(orders, ledger), environ(key=None))
    body = b'{"error":"idempotency_key_required"}'
    assert reply == Reply("400 Bad Request", [("content-type", JSON), ("content-length", str(len(body)))], body)
    assert orders.calls == [] and ledger.operator.stats().total == 0


def test_empty_key_is_400_key_required(ledger, orders):
    reply = call(wrap(orders, ledger), environ(key=""))
    assert (reply.code, reply.json()) == (400, {"error": "idempotency_key_required"})
    assert orders.calls == []


def test_invalid_key_is_400_key_invalid_and_the_app_never_runs(ledger, orders):
    reply = call(wrap(orders, ledger), environ(key="x" * 256))
    assert reply.code == 400
    assert reply.body == (
        b'{"error":"idempotency_key_invalid","message":"Idempotency-Key must be 1-255 printable ASCII characters."}'
    )
    assert orders.calls == [] and ledger.operator.stats().total == 0


def test_no_principal_is_401_without_reading_the_body_or_running_the_app(ledger, orders):
    env = environ(user=None)
    reply = call(wrap(orders, ledger), env)
    assert reply.status == "401 Unauthorized"
    assert reply.json() == {"error": "unauthenticated", "message": "No authenticated principal for this request."}
    assert reply.header("Content-Type") == JSON
    assert orders.calls == [] and ledger.operator.stats().total == 0


def test_principal_must_be_a_string(ledger, orders):
    app = IdempotencyMiddleware(orders, ledger, principal=lambda env: 42)
    with pytest.raises(TypeError, match="principal\\(\\) must return str or None, got int"):
        call(app, environ())
    assert orders.calls == []


def test_the_app_sees_the_resolved_principal(ledger, orders):
    call(wrap(orders, ledger), environ())
    assert orders.calls[0]["environ"]["idemctl.principal"] == "acct_A"


def test_same_key_for_two_principals_runs_twice_and_each_replays_its_own_answer(ledger, orders):
    app = wrap(orders, ledger)
    a1 = call(app, environ(user="acct_A"))
    b1 = call(app, environ(user="acct_B"))
    a2 = call(app, environ(user="acct_A"))
    b2 = call(app, environ(user="acct_B"))
    assert len(orders.calls) == 2
    assert (a1.body, b1.body) == (b'{"id":1}', b'{"id":2}')
    assert (a2, b2) == (a1, b1)


def test_same_key_with_a_different_body_is_409_reused_and_nothing_is_replayed(ledger, orders):
    app = wrap(orders, ledger)
    call(app, environ())
    reply = call(app, environ(body=b'{"sku":"tea","qty":3}'))
    assert reply == Reply(
        "409 Conflict", [("content-type", JSON), ("content-length", "34")], b'{"error":"idempotency_key_reused"}'
    )
    assert len(orders.calls) == 1


def test_reuse_status_422_comes_from_the_policy(make_ledger, orders):
    app = wrap(orders, make_ledger(policy=Policy(reuse_status=422)))
    call(app, environ())
    assert call(app, environ(body=b"{}")).status == f"422 {HTTPStatus(422).phrase}"


def test_fingerprint_covers_content_type_and_api_version_but_not_other_headers(ledger, orders):
    app = wrap(orders, ledger)
    call(app, environ(HTTP_X_API_VERSION="2024-01-01", HTTP_USER_AGENT="curl/8"))
    assert call(app, environ(HTTP_X_API_VERSION="2024-01-01", HTTP_USER_AGENT="httpie/3")).code == 201
    assert call(app, environ(HTTP_X_API_VERSION="2025-01-01")).code == 409
    assert call(app, environ(HTTP_X_API_VERSION="2024-01-01", content_type="text/plain")).code == 409
    assert len(orders.calls) == 1
    expected = fingerprint("POST", "/orders", {"content-type": JSON, "x-api-version": "2024-01-01"}, ORDER)
    assert ledger.lookup("acct_A", "key-1").fingerprint == expected


def test_exempt_routes_pass_through_without_a_key(ledger, orders):
    app = wrap(orders, ledger, exempt=lambda env: env["PATH_INFO"] == "/echo")
    reply = call(app, environ(path="/echo", key=None, body=b"ping"))
    assert (reply.status, reply.body) == ("201 Created", b"ping")
    assert ledger.operator.stats().total == 0


def test_optional_key_route_without_a_key_runs_unprotected_and_with_a_key_is_protected(ledger, orders):
    app = wrap(orders, ledger, key_optional=lambda env: env["PATH_INFO"] == "/orders")
    assert call(app, environ(key=None)).status == "201 Made It"  # passthrough keeps the app's own status line
    assert call(app, environ(key=None)).status == "201 Made It"
    assert len(orders.calls) == 2 and ledger.operator.stats().total == 0
    protected = [call(app, environ(key="k-opt")) for _ in range(2)]
    assert len(orders.calls) == 3 and protected[0] == protected[1]
    assert protected[0].status == "201 Created"
    # Other routes still require a key.
    assert call(app, environ(path="/echo", key=None)).code == 400


def test_in_progress_is_409_with_retry_after_from_the_pending_ttl(make_ledger, orders):
    ledger = make_ledger(policy=Policy(pending_ttl_ms=2500))
    app = wrap(orders, ledger)
    with pytest.raises(RuntimeError):
        call(app, environ(path="/boom"))
    reply = call(app, environ(path="/boom"))
    body = b'{"error":"idempotency_key_in_progress","retry_after_ms":2500}'
    assert reply == Reply(
        "409 Conflict", [("content-type", JSON), ("retry-after", "3"), ("content-length", str(len(body)))], body
    )
    assert len(orders.calls) == 1


# -- adapting the app's answer ------------------------------------------------------------


def test_the_write_callable_output_is_captured_stored_and_replayed(ledger, orders):
    app = wrap(orders, ledger)
    first = call(app, environ(path="/write"))
    assert first == Reply("202 Accepted", [("content-type", "text/plain"), ("content-length", "12")], b"queued job-1")
    assert call(app, environ(path="/write")) == first
    assert ledger.lookup("acct_A", "key-1").body_bytes == b"queued job-1"


def test_a_generator_app_that_starts_the_response_lazily_is_consumed_and_closed_once(ledger):
    closes = []

    class Body:
        def __init__(self, start_response):
            self.start_response = start_response

        def __iter__(self):
            self.start_response("201 Created", [("Content-Type", "text/plain")])
            yield b"made"

        def close(self):
            closes.append(1)

    app = wrap(lambda env, sr: Body(sr), ledger)
    reply = call(app, environ())
    assert (reply.status, reply.body, closes) == ("201 Created", b"made", [1])


def test_exc_info_before_any_body_replaces_the_answer_and_that_is_stored(ledger, orders):
    app = wrap(orders, ledger)
    first = call(app, environ(path="/exc-before-body"))
    assert (first.status, first.body) == ("500 Internal Server Error", b"inventory lookup failed")
    assert call(app, environ(path="/exc-before-body")) == first
    assert len(orders.calls) == 1
    assert ledger.lookup("acct_A", "key-1").response_status == 500


def test_exc_info_after_body_was_written_reraises_and_leaves_the_reservation_pending(ledger, orders):
    app = IdempotencyMiddleware(orders, ledger, principal=lambda env: env.get("REMOTE_USER"))
    with pytest.raises(KeyError, match="inventory"):
        call(app, environ(path="/exc-after-body"))
    assert ledger.lookup("acct_A", "key-1").status is Status.PENDING


def test_an_app_that_raises_propagates_and_leaves_the_reservation_pending(ledger, orders):
    app = wrap(orders, ledger)
    with pytest.raises(RuntimeError, match="payment gateway timed out"):
        call(app, environ(path="/boom"))
    row = ledger.lookup("acct_A", "key-1")
    assert (row.status, row.generation) == (Status.PENDING, 1)


@pytest.mark.parametrize("opt_in", [True, lambda env: env["PATH_INFO"] == "/boom"], ids=["flag", "predicate"])
def test_release_on_error_deletes_the_reservation_so_the_retry_runs_again(ledger, orders, opt_in):
    app = wrap(orders, ledger, release_on_error=opt_in)
    with pytest.raises(RuntimeError):
        call(app, environ(path="/boom"))
    assert ledger.lookup("acct_A", "key-1") is None
    with pytest.raises(RuntimeError):
        call(app, environ(path="/boom"))
    assert len(orders.calls) == 2


def test_release_on_error_predicate_false_keeps_the_reservation(ledger, orders):
    app = wrap(orders, ledger, release_on_error=lambda env: False)
    with pytest.raises(RuntimeError):
        call(app, environ(path="/boom"))
    assert ledger.lookup("acct_A", "key-1").status is Status.PENDING


def test_a_204_answer_and_its_replay_carry_no_body_no_length_and_no_content_type(ledger, orders):
    app = wrap(orders, ledger)
    first = call(app, environ(path="/cancel", method="DELETE", body=b""))
    assert first == Reply("204 No Content", [], b"")
    assert call(app, environ(path="/cancel", method="DELETE", body=b"")) == first
    assert len(orders.calls) == 1


def test_a_content_type_on_a_204_is_dropped_from_the_first_answer_and_the_replay(ledger):
    def app(env, start_response):  # Flask and Werkzeug add one by default
        start_response("204 No Content", [("Content-Type", "text/html; charset=utf-8")])
        return []

    wrapped = validator(IdempotencyMiddleware(app, ledger, principal=lambda env: "acct_A"))
    first = call(wrapped, environ(method="DELETE", body=b""))
    assert first == Reply("204 No Content", [], b"")
    assert call(wrapped, environ(method="DELETE", body=b"")) == first
    assert ledger.lookup("acct_A", "key-1").headers == {"content-type": "text/html; charset=utf-8"}


def test_binary_request_and_response_bodies_round_trip_byte_for_byte(ledger, orders):
    blob = bytes(range(256)) * 8 + b"\xff\xfe\x00\xc3"
    app = wrap(orders, ledger)
    first = call(app, environ(path="/echo", body=blob, content_type="application/octet-stream"))
    retry = call(app, environ(path="/echo", body=blob, content_type="application/octet-stream"))
    assert first.body == blob and retry == first
    assert orders.calls[0]["body"] == blob
    assert isinstance(ledger.lookup("acct_A", "key-1").response_body, bytes)  # stored as a BLOB


def test_a_response_over_the_body_cap_is_the_500_sentinel_for_the_first_caller_too(ledger, orders):
    app = wrap(orders, ledger)
    first = call(app, environ(path="/big"))
    # The ledger's own JSON error, not the app's text/plain over a body that is not there.
    body = not_stored()[2]
    assert first == Reply(
        "500 Internal Server Error", [("content-type", "application/json"), ("content-length", str(len(body)))], body
    )
    assert call(app, environ(path="/big")) == first


def test_an_unregistered_status_code_gets_its_class_phrase_on_first_answer_and_replay(ledger, orders):
    app = wrap(orders, ledger)
    first = call(app, environ(path="/odd-status"))
    assert first.status == "299 Success"
    assert call(app, environ(path="/odd-status")) == first
    assert (status_line(201), status_line(499), status_line(599)) == (
        "201 Created",
        "499 Client Error",
        "599 Server Error",
    )


# -- the request target ---------------------------------------------------------------------


def test_request_target_prefers_raw_uri_verbatim():
    env = {"RAW_URI": "/orders/a%2Fb?z=1&a=%41", "PATH_INFO": "/orders/a/b", "QUERY_STRING": "z=1&a=%41"}
    assert request_target(env) == "/orders/a%2Fb?z=1&a=%41"


def test_request_target_uses_request_uri_when_there_is_no_raw_uri():
    env = {"REQUEST_URI": "/api/orders?b=2&a=1", "SCRIPT_NAME": "/api", "PATH_INFO": "/orders"}
    assert request_target(env) == "/api/orders?b=2&a=1"


def test_request_target_is_rebuilt_from_script_name_path_info_and_query_without_decoding_the_query():
    # PEP 3333: PATH_INFO holds the decoded bytes as latin-1 ("é" arrived as %C3%A9).
    env = {"SCRIPT_NAME": "/api", "PATH_INFO": "/orders/caf\xc3\xa9 au lait:1", "QUERY_STRING": "b=%20&a=1"}
    assert request_target(env) == "/api/orders/caf%C3%A9%20au%20lait:1?b=%20&a=1"


def test_request_target_has_no_question_mark_for_an_empty_query():
    assert request_target({"SCRIPT_NAME": "", "PATH_INFO": "/orders", "QUERY_STRING": ""}) == "/orders"
    assert request_target({"SCRIPT_NAME": "", "PATH_INFO": ""}) == "/"


def test_request_target_reduces_an_absolute_form_target_to_path_and_query():
    assert request_target({"RAW_URI": "http://shop.example/orders?a=1"}) == "/orders?a=1"
    assert request_target({"RAW_URI": "https://shop.example"}) == "/"


def test_the_fingerprint_uses_raw_uri_so_reordered_query_parameters_are_a_different_request(ledger, orders):
    app = wrap(orders, ledger)
    call(app, environ(query="a=1&b=2", RAW_URI="/orders?a=1&b=2"))
    assert ledger.lookup("acct_A", "key-1").fingerprint == fingerprint(
        "POST", "/orders?a=1&b=2", {"content-type": JSON}, ORDER
    )
    assert call(app, environ(query="b=2&a=1", RAW_URI="/orders?b=2&a=1")).code == 409
    assert call(app, environ(query="a=1&b=2", RAW_URI="/orders?a=1&b=2")).code == 201
    assert len(orders.calls) == 1


def test_the_fingerprint_uses_the_rebuilt_target_when_the_server_gives_no_raw_uri(ledger, orders):
    app = wrap(orders, ledger)
    call(app, environ(path="/orders", query="b=2&a=1", SCRIPT_NAME="/shop"))
    expected = fingerprint("POST", "/shop/orders?b=2&a=1", {"content-type": JSON}, ORDER)
    assert ledger.lookup("acct_A", "key-1").fingerprint == expected


# -- reading the body -------------------------------------------------------------------------


def test_the_app_gets_the_exact_body_as_a_fresh_input_with_its_length(ledger, orders):
    call(wrap(orders, ledger), environ(path="/echo", body=b"abc\x00def"))
    env = orders.calls[0]["environ"]
    assert orders.calls[0]["body"] == b"abc\x00def"
    assert env["CONTENT_LENGTH"] == "7"


def test_a_chunked_body_is_read_to_the_end_and_handed_on_with_a_content_length(ledger, orders):
    body = b"chunk-" * 2000
    env = environ(path="/echo", length=None, stream=Input(body, piece=1000), HTTP_TRANSFER_ENCODING="chunked")
    env["wsgi.input_terminated"] = True
    reply = call(wrap(orders, ledger), env)
    assert reply.body == body and orders.calls[0]["body"] == body
    inner = orders.calls[0]["environ"]
    assert inner["CONTENT_LENGTH"] == str(len(body)) and "HTTP_TRANSFER_ENCODING" not in inner
    assert "wsgi.input_terminated" not in inner
    assert ledger.lookup("acct_A", "key-1").fingerprint == fingerprint("POST", "/echo", {"content-type": JSON}, body)


def test_no_content_length_and_no_transfer_encoding_is_an_empty_body(ledger, orders):
    call(wrap(orders, ledger), environ(path="/echo", body=b"", length=None))
    assert orders.calls[0]["body"] == b"" and orders.calls[0]["environ"]["CONTENT_LENGTH"] == "0"


def test_a_body_over_the_limit_is_413_before_anything_is_claimed_or_read(ledger, orders):
    env = environ(body=b"x" * 101)
    stream = env["wsgi.input"]
    reply = call(wrap(orders, ledger, max_body_bytes=100), env)
    assert reply.status == f"413 {HTTPStatus(413).phrase}"
    assert reply.json() == {
        "error": "request_body_too_large",
        "message": "The request body exceeds 100 bytes.",
        "limit_bytes": 100,
    }
    assert stream.tell() == 0
    assert orders.calls == [] and ledger.operator.stats().total == 0


def test_a_body_exactly_at_the_limit_is_accepted(ledger, orders):
    assert call(wrap(orders, ledger, max_body_bytes=len(ORDER)), environ()).code == 201


def test_a_chunked_body_over_the_limit_is_413_and_nothing_is_claimed(ledger, orders):
    env = environ(length=None, stream=Input(b"y" * 5000, piece=1000), HTTP_TRANSFER_ENCODING="chunked")
    env["wsgi.input_terminated"] = True
    reply = call(wrap(orders, ledger, max_body_bytes=4096), env)
    assert reply.code == 413 and reply.json()["limit_bytes"] == 4096
    assert orders.calls == [] and ledger.operator.stats().total == 0


def test_a_chunked_body_the_server_cannot_terminate_is_411_length_required(ledger, orders):
    env = environ(length=None, HTTP_TRANSFER_ENCODING="chunked")
    reply = call(wrap(orders, ledger), env)
    assert reply.status == "411 Length Required"
    assert reply.json() == {
        "error": "content_length_required",
        "message": "A request body needs a Content-Length header.",
    }
    assert orders.calls == [] and ledger.operator.stats().total == 0


@pytest.mark.parametrize("bad", ["abc", "-1", "+5", "1_0", "0x10", "5 5", "1e3"])
def test_a_malformed_content_length_is_400_and_nothing_is_claimed(ledger, orders, bad):
    # Not behind the outer validator: it would reject the bad header itself.
    app = IdempotencyMiddleware(validator(orders), ledger, principal=lambda env: env.get("REMOTE_USER"))
    reply = call(app, environ(length=bad))
    assert reply.status == "400 Bad Request"
    assert reply.json() == {
        "error": "content_length_invalid",
        "message": "Content-Length must be a non-negative decimal integer.",
    }
    assert orders.calls == [] and ledger.operator.stats().total == 0


def test_a_client_that_sends_less_than_content_length_gets_400_and_nothing_is_claimed(ledger, orders):
    env = environ(length="500")  # only len(ORDER) bytes will ever arrive
    reply = call(wrap(orders, ledger), env)
    assert reply.status == "400 Bad Request"
    assert reply.json()["error"] == "request_body_incomplete"
    assert orders.calls == [] and ledger.operator.stats().total == 0


def test_a_client_that_disconnects_mid_body_leaves_nothing_claimed(ledger, orders):
    env = environ(body=b"z" * 100_000, stream=Input(b"z" * 100_000, fail_after=70_000))
    reply = call(wrap(orders, ledger), env)
    assert reply.json()["error"] == "request_body_incomplete"
    assert orders.calls == [] and ledger.operator.stats().total == 0


# -- failing closed ---------------------------------------------------------------------------


def test_a_ledger_locked_past_the_busy_timeout_is_503_with_retry_after_and_the_app_never_runs(tmp_path, orders, caplog):
    ledger_target = str(tmp_path / "ledger.db")  # SQLite locking: one backend only
    ledger = Ledger.open(ledger_target, busy_timeout_ms=50)
    ledger.init()
    blocker = sqlite3.connect(ledger_target, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        with caplog.at_level(logging.WARNING, logger="idemctl.wsgi"):
            reply = call(wrap(orders, ledger, unavailable_retry_after_ms=2500), environ())
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
        ledger.close()
    body = b'{"error":"idempotency_ledger_unavailable","message":"The idempotency ledger is unavailable; retry later."}'
    assert reply == Reply(
        "503 Service Unavailable",
        [("content-type", JSON), ("retry-after", "3"), ("content-length", str(len(body)))],
        body,
    )
    assert orders.calls == []
    assert any("refused POST /orders with 503" in r.getMessage() and "locked" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "ledger_at, level, logged",
    [
        # Nothing listens on port 1.
        ("postgresql://postgres@127.0.0.1:1/test", logging.WARNING, "cannot reach PostgreSQL"),
        ("{tmp}/ledger.db", logging.ERROR, "has no idempotency ledger (ledger.init() creates it)"),
    ],
    ids=["unreachable-postgres", "sqlite-without-its-schema"],
)
def test_a_ledger_that_cannot_answer_is_503_and_the_app_never_runs(tmp_path, orders, caplog, ledger_at, level, logged):
    if ledger_at.startswith("postgresql"):
        pytest.importorskip("psycopg_pool")
    ledger = Ledger.open(ledger_at.format(tmp=tmp_path))  # the SQLite file is never initialised
    try:
        with caplog.at_level(level, logger="idemctl.wsgi"):
            reply = call(wrap(orders, ledger), environ())
    finally:
        ledger.close()
    assert (reply.code, reply.header("Retry-After"), reply.json()["error"]) == (
        503,
        "1",
        "idempotency_ledger_unavailable",
    )
    assert orders.calls == []
    assert [r.levelno for r in caplog.records if logged in r.getMessage()] == [level]


def test_when_the_answer_cannot_be_stored_the_client_still_gets_what_the_app_computed(tmp_path, orders, caplog):
    ledger_target = str(tmp_path / "ledger.db")  # SQLite locking: one backend only
    ledger = Ledger.open(ledger_target, busy_timeout_ms=50)
    ledger.init()
    orders.lock = sqlite3.connect(ledger_target, isolation_level=None, check_same_thread=False)
    try:
        with caplog.at_level(logging.ERROR, logger="idemctl.wsgi"):
            reply = call(wrap(orders, ledger), environ(path="/lock-after"))
    finally:
        orders.lock.execute("ROLLBACK")
        orders.lock.close()
    try:
        assert reply == Reply("201 Created", [("content-type", JSON), ("content-length", "16")], b'{"charged":true}')
        assert ledger.lookup("acct_A", "key-1").status is Status.PENDING
        assert any(
            "the mutation ran but its answer (status 201) could not be stored" in r.getMessage() for r in caplog.records
        )
    finally:
        ledger.close()


def test_an_app_raising_a_storage_error_of_its_own_propagates_instead_of_503(ledger):
    from idemctl import StorageError

    def app(env, start_response):
        raise StorageError("the app's own database is full")

    with pytest.raises(StorageError, match="the app's own database is full"):
        call(IdempotencyMiddleware(app, ledger, principal=lambda env: "acct_A"), environ())


# -- the post-response sweep ------------------------------------------------------------------------


def test_the_sweep_runs_when_the_server_closes_the_response_not_before(ledger, orders, clock):
    old = ledger.claim("acct_old", "stale-key", "f" * 64)
    assert old is not None
    clock.advance(ledger.policy.retention_ms + 1)
    app = wrap(orders, ledger)
    seen: dict = {}
    result = app(environ(), lambda status, headers, exc_info=None: seen.setdefault("status", status))
    assert b"".join(result) == b'{"id":1}'
    assert ledger.lookup("acct_old", "stale-key") is not None  # answer sent, sweep not yet run
    result.close()
    assert ledger.lookup("acct_old", "stale-key") is None
    assert ledger.lookup("acct_A", "key-1").status is Status.COMPLETED


def test_a_sweep_that_fails_after_the_response_is_logged_and_never_raised(tmp_path, orders, caplog, clock):
    ledger_target = str(tmp_path / "ledger.db")  # SQLite locking: one backend only
    ledger = Ledger.open(ledger_target, busy_timeout_ms=50, clock=clock)
    ledger.init()
    assert ledger.claim("acct_old", "stale-key", "f" * 64) is not None
    clock.advance(ledger.policy.retention_ms + 1)  # so the sweep has a row to delete
    app = wrap(orders, ledger)
    result = app(environ(), lambda status, headers, exc_info=None: None)
    assert b"".join(result) == b'{"id":1}'
    blocker = sqlite3.connect(ledger_target, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        with caplog.at_level(logging.WARNING):
            result.close()  # must not raise
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    try:
        assert any("post-response sweep failed" in r.getMessage() for r in caplog.records)
        assert ledger.lookup("acct_old", "stale-key") is not None  # left for the next request's sweep
    finally:
        ledger.close()


# -- threads ---------------------------------------------------------------------------------------


def test_sixteen_threads_with_one_key_run_the_app_once_and_agree_on_the_answer(ledger_target):
    ledger = Ledger.open(ledger_target, policy=Policy(pending_ttl_ms=30_000), clock=wall_clock_ms)
    ledger.init()
    calls = []
    started = threading.Event()
    release = threading.Event()

    def slow_app(env, start_response):
        calls.append(threading.get_ident())
        started.set()
        release.wait(10)
        start_response("201 Created", [("Content-Type", JSON)])
        return [b'{"id":1}']

    app = wrap(slow_app, ledger)
    replies: list[Reply] = []
    lock = threading.Lock()

    def client():
        reply = call(app, environ())
        with lock:
            replies.append(reply)

    threads = [threading.Thread(target=client) for _ in range(16)]
    for t in threads:
        t.start()
    assert started.wait(10)
    # Every thread but the owner is answered while the owner is still running.
    for _ in range(500):
        with lock:
            if len(replies) == 15:
                break
        threading.Event().wait(0.01)
    release.set()
    for t in threads:
        t.join(10)
    ledger.close()
    assert len(calls) == 1
    codes = sorted(r.code for r in replies)
    assert codes == [201] + [409] * 15
    assert all(
        r.json() == {"error": "idempotency_key_in_progress", "retry_after_ms": 30000} for r in replies if r.code == 409
    )


def test_constructor_rejects_impossible_settings(ledger, orders):
    with pytest.raises(ValueError, match="max_body_bytes"):
        IdempotencyMiddleware(orders, ledger, principal=lambda e: "a", max_body_bytes=-1)
    with pytest.raises(ValueError, match="unavailable_retry_after_ms"):
        IdempotencyMiddleware(orders, ledger, principal=lambda e: "a", unavailable_retry_after_ms=0)
    with pytest.raises(TypeError, match="principal must be a callable"):
        IdempotencyMiddleware(orders, ledger, principal="REMOTE_USER")  # type: ignore[arg-type]


def test_the_readme_wrapping_example_runs_and_replays(tmp_path, monkeypatch):
    import re

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## WSGI middleware\n.*?```python\n(.*?)```", readme, re.S)
    assert block, "README lost its WSGI example"
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(block.group(1), "README.md", "exec"), scope)
    try:
        first = call(validator(scope["app"]), environ(body=b'{"sku":"tea"}'))
        retry = call(validator(scope["app"]), environ(body=b'{"sku":"tea"}'))
        anonymous = call(validator(scope["app"]), environ(user=None))
    finally:
        scope["ledger"].close()
    assert first == Reply(
        "201 Created", [("content-type", JSON), ("location", "/orders/42"), ("content-length", "9")], b'{"id":42}'
    )
    assert retry == first and anonymous.code == 401
    assert (tmp_path / "idempotency.db").exists()
