"""The contract table of SPEC §1, run against every adapter from one table,
so WSGI, ASGI, FastAPI, Django and the Flask view decorator can never drift
apart: same statuses, headers and bytes."""

from __future__ import annotations

import asyncio
import io
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import flask
import pytest
from django.http import HttpResponse
from django.urls import path as django_path
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.testclient import TestClient
from werkzeug.test import Client as WerkzeugClient

from idemctl import Ledger, Policy
from idemctl.asgi import IdempotencyMiddleware as AsgiMiddleware
from idemctl.django import IdempotencyMixin, idempotency_key_optional
from idemctl.fastapi import idempotent_route
from idemctl.flask import idempotent
from idemctl.wsgi import IdempotencyMiddleware as WsgiMiddleware
from tests.adapters.django_site import Site, setup
from tests.helpers import Reply, asgi_exchange

# A Redis Cluster runs this module too (tests/conftest.py, CLUSTER_OPT_IN).
ON_REDIS_CLUSTER = True

# The FastAPI route class, DRF's view mixin and the Flask view decorator take
# the same contract options except the middleware-only ones (exempt,
# key_optional): a router or a view opts in instead.
ADAPTERS = ["wsgi", "asgi", "fastapi", "django", "drf", "flask-view"]
MIDDLEWARE = ["wsgi", "asgi", "django"]
ORDER = b'{"sku":"tea","qty":2}'


@dataclass
class Orders:
    """The app behind either adapter: counts runs, answers 201 with a Location."""

    runs: list[bytes] = field(default_factory=list)
    status: int = 201
    gate: threading.Event | None = None
    fail: bool = False

    def answer(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        self.runs.append(body)
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            raise RuntimeError("the mutation failed")
        n = len(self.runs)
        return (
            self.status,
            [("Content-Type", "application/json"), ("Location", f"/orders/{n}"), ("X-Trace", "t")],
            (b'{"id":%d}' % n),
        )


class WsgiClient:
    def __init__(self, ledger: Ledger, orders: Orders, **options: object) -> None:
        def app(environ, start_response):  # type: ignore[no-untyped-def]
            status, headers, body = orders.answer(environ["wsgi.input"].read(int(environ["CONTENT_LENGTH"] or 0)))
            start_response(f"{status} X", headers)
            return [body]

        self.mw = WsgiMiddleware(app, ledger, principal=lambda env: env.get("REMOTE_USER"), **options)

    def request(self, method: str, path: str, body: bytes, headers: dict[str, str], user: str | None) -> Reply:
        env = {
            "REQUEST_METHOD": method,
            "PATH_INFO": path.split("?")[0],
            "QUERY_STRING": path.split("?")[1] if "?" in path else "",
            "SCRIPT_NAME": "",
            "CONTENT_LENGTH": str(len(body)),
            "wsgi.input": io.BytesIO(body),
        }
        if user is not None:
            env["REMOTE_USER"] = user
        for name, value in headers.items():
            if isinstance(value, list):
                value = ", ".join(value)  # several fields, joined as WSGI servers join them
            if name.lower() == "content-type":
                env["CONTENT_TYPE"] = value
            else:
                env["HTTP_" + name.upper().replace("-", "_")] = value
        seen: dict[str, object] = {}

        def start_response(status, hdrs, exc_info=None):  # type: ignore[no-untyped-def]
            seen["status"], seen["headers"] = status, hdrs

        result = self.mw(env, start_response)
        try:
            out = b"".join(result)
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        return Reply(int(str(seen["status"])[:3]), list(seen["headers"]), out)  # type: ignore[arg-type]


class AsgiClient:
    def __init__(self, ledger: Ledger, orders: Orders, **options: object) -> None:
        async def app(scope, receive, send):  # type: ignore[no-untyped-def]
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            status, headers, out = await asyncio.get_running_loop().run_in_executor(None, orders.answer, body)
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [(k.lower().encode(), v.encode()) for k, v in headers],
                }
            )
            # Streamed in two pieces: the stored answer joins them.
            await send({"type": "http.response.body", "body": out[:3], "more_body": True})
            await send({"type": "http.response.body", "body": out[3:]})

        async def who(scope):  # type: ignore[no-untyped-def]
            return scope.get("user")

        self.mw = AsgiMiddleware(app, ledger, principal=who, **options)

    def request(self, method: str, path: str, body: bytes, headers: dict[str, str], user: str | None) -> Reply:
        raw_path, _, query = path.partition("?")
        scope = {
            "type": "http",
            "method": method,
            "path": raw_path,
            "raw_path": raw_path.encode(),
            "query_string": query.encode(),
            "headers": [
                (k.lower().encode(), v.encode())
                for k, vs in headers.items()
                for v in (vs if isinstance(vs, list) else [vs])
            ]
            + [(b"content-length", str(len(body)).encode())],
            "user": user,
        }
        chunks = [body[: len(body) // 2], body[len(body) // 2 :]]
        sent: list[dict] = []

        async def receive():  # type: ignore[no-untyped-def]
            if chunks:
                piece = chunks.pop(0)
                return {"type": "http.request", "body": piece, "more_body": bool(chunks)}
            await asyncio.sleep(3600)  # no disconnect while the test runs

        async def send(message):  # type: ignore[no-untyped-def]
            sent.append(message)

        async def run() -> None:
            await self.mw(scope, receive, send)
            # Let the post-response sweep finish before the loop closes.
            await self.mw.wait_idle()

        asyncio.run(run())
        start = sent[0]
        return Reply(
            start["status"],
            [(k.decode("latin-1"), v.decode("latin-1")) for k, v in start["headers"]],
            b"".join(m.get("body", b"") for m in sent[1:]),
        )


class FastApiClient:
    def __init__(self, ledger: Ledger, orders: Orders, **options: object) -> None:
        def account(request: Request) -> str | None:
            return request.headers.get("x-user")

        router = APIRouter(route_class=idempotent_route(ledger, principal=account, **options))  # type: ignore[arg-type]

        @router.api_route("/orders", methods=["GET", "POST"])
        async def orders_endpoint(request: Request) -> Response:
            status, headers, body = orders.answer(await request.body())
            return Response(content=body, status_code=status, headers=dict(headers))

        app = FastAPI()
        app.include_router(router)
        self.app = app
        self.client = TestClient(app, raise_server_exceptions=True)

    def request(self, method: str, path: str, body: bytes, headers: dict[str, str], user: str | None) -> Reply:
        sent = [
            (name, v.encode("latin-1")) for name, vs in headers.items() for v in (vs if isinstance(vs, list) else [vs])
        ]
        if user is not None:
            sent.append(("X-User", user.encode("latin-1")))
        if len(path) > 60_000:  # past httpx's own URL bound: straight to the ASGI app
            return _asgi_call(self.app, method, path, body, sent)
        got = self.client.request(method, path, content=body, headers=sent)
        return Reply(got.status_code, list(got.headers.multi_items()), got.content)


def _asgi_call(app, method: str, path: str, body: bytes, headers: list[tuple[str, bytes]]) -> Reply:  # type: ignore[no-untyped-def]
    raw_path, _, query = path.partition("?")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "scheme": "http",
        "server": ("test", 80),
        "client": ("test", 1),
        "root_path": "",
        "method": method,
        "path": raw_path,
        "raw_path": raw_path.encode(),
        "query_string": query.encode(),
        "headers": [(k.lower().encode(), v) for k, v in headers] + [(b"content-length", str(len(body)).encode())],
    }
    sent = asyncio.run(asgi_exchange(app, scope, body))
    start = sent[0]
    return Reply(
        start["status"],
        [(k.decode("latin-1"), v.decode("latin-1")) for k, v in start["headers"]],
        b"".join(m.get("body", b"") for m in sent[1:]),
    )


class DjangoClient:
    """Django's test client through idemctl.django.IdempotencyMiddleware; the
    options are the IDEMCTL settings of the same names."""

    def __init__(self, ledger: Ledger, orders: Orders, **options: object) -> None:
        def view(request):  # type: ignore[no-untyped-def]
            status, headers, body = orders.answer(request.body)
            response = HttpResponse(body, status=status)
            for name, value in headers:
                response[name] = value
            return response

        exempt = options.pop("exempt", None)
        if options.pop("key_optional", None) is not None:
            view = idempotency_key_optional(view)  # Django marks views, not requests
        idemctl: dict[str, object] = {"LEDGER": ledger, "PRINCIPAL": lambda request: request.META.get("HTTP_X_USER")}
        idemctl.update({name.upper(): value for name, value in options.items()})
        if exempt is not None:
            idemctl["EXEMPT_PATHS"] = [lambda request: exempt(request.META)]  # type: ignore[operator]
        self.site = Site([django_path("orders", view), django_path("login", view)], idemctl)

    def request(self, method: str, path: str, body: bytes, headers: dict[str, str], user: str | None) -> Reply:
        # Several fields reach Django joined, as its WSGI or ASGI handler joins them.
        sent = {name: ", ".join(value) if isinstance(value, list) else value for name, value in headers.items()}
        if user is not None:
            sent["X-User"] = user
        got = self.site.request(method, path, body, sent)
        return Reply(got.status_code, list(got.items()), got.content)


class DrfClient(DjangoClient):
    """A DRF APIView with idemctl.django.IdempotencyMixin, configured by the
    same IDEMCTL settings as the middleware (which leaves the view to it)."""

    def __init__(self, ledger: Ledger, orders: Orders, **options: object) -> None:
        setup()  # DRF reads Django's settings as it is imported
        from rest_framework.permissions import AllowAny
        from rest_framework.views import APIView

        def answer(view: object, request) -> HttpResponse:  # type: ignore[no-untyped-def]
            status, headers, body = orders.answer(request.body)
            response = HttpResponse(body, status=status)
            for name, value in headers:
                response[name] = value
            return response

        attributes = {"authentication_classes": (), "permission_classes": (AllowAny,), "get": answer, "post": answer}
        view = type("OrdersView", (IdempotencyMixin, APIView), attributes).as_view()
        idemctl: dict[str, object] = {"LEDGER": ledger, "PRINCIPAL": lambda request: request.META.get("HTTP_X_USER")}
        idemctl.update({name.upper(): value for name, value in options.items()})
        self.site = Site([django_path("orders", view)], idemctl)


class FlaskViewClient:
    """One Flask view under idemctl.flask.idempotent."""

    def __init__(self, ledger: Ledger, orders: Orders, **options: object) -> None:
        app = flask.Flask(__name__)
        app.testing = True

        @app.route("/orders", methods=["GET", "POST"])
        @idempotent(ledger, principal=lambda: flask.request.headers.get("X-User"), **options)  # type: ignore[arg-type]
        def orders_view() -> flask.Response:
            status, headers, body = orders.answer(flask.request.get_data())
            return flask.Response(body, status=status, headers=headers)

        # Werkzeug's own client: Flask's needs a Flask newer than the lowest the tests support.
        self.client = WerkzeugClient(app)

    def request(self, method: str, path: str, body: bytes, headers: dict[str, str], user: str | None) -> Reply:
        sent = [(name, v) for name, vs in headers.items() for v in (vs if isinstance(vs, list) else [vs])]
        if user is not None:
            sent.append(("X-User", user))
        got = self.client.open(path, method=method, data=body, headers=sent)
        return Reply(got.status_code, list(got.headers.items()), got.get_data())


CLIENTS = {
    "wsgi": WsgiClient,
    "asgi": AsgiClient,
    "fastapi": FastApiClient,
    "django": DjangoClient,
    "drf": DrfClient,
    "flask-view": FlaskViewClient,
}


@pytest.fixture(params=ADAPTERS)
def adapter(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=MIDDLEWARE)
def middleware(request: pytest.FixtureRequest) -> str:
    return request.param


def _factory(kind: str, make_ledger: Callable[..., Ledger]):
    def make(orders: Orders, *, policy: Policy | None = None, **options: object):
        ledger = make_ledger(policy=policy)
        return CLIENTS[kind](ledger, orders, **options), ledger

    return make


@pytest.fixture
def client_for(adapter: str, make_ledger: Callable[..., Ledger]):
    return _factory(adapter, make_ledger)


@pytest.fixture
def mw_client_for(middleware: str, make_ledger: Callable[..., Ledger]):
    return _factory(middleware, make_ledger)


def post(
    client,
    *,
    key: str | list[str] | None = "k-1",
    body: bytes = ORDER,
    user: str | None = "acct_A",
    path: str = "/orders",
    ctype: str = "application/json",
) -> Reply:
    headers = {"Content-Type": ctype}
    if key is not None:
        headers["Idempotency-Key"] = key  # type: ignore[assignment]  # a list: several fields
    return client.request("POST", path, body, headers, user)


def test_first_request_runs_once_and_every_retry_gets_the_same_bytes(client_for):
    orders = Orders()
    client, _ = client_for(orders)
    first = post(client)
    again = post(client)
    assert (first.status, first.lowered, first.body) == (
        201,
        [("content-type", "application/json"), ("location", "/orders/1"), ("content-length", "8")],
        b'{"id":1}',
    )
    assert (again.status, again.lowered, again.body) == (first.status, first.lowered, first.body)
    assert orders.runs == [ORDER]


def test_replayed_header_is_opt_in(client_for):
    client, _ = client_for(Orders(), replayed_header=True)
    assert post(client).header("Idempotent-Replayed") is None
    assert post(client).header("Idempotent-Replayed") == "true"


@pytest.mark.parametrize(
    ("kwargs", "status", "body"),
    [
        ({"key": None}, 400, b'{"error":"idempotency_key_required"}'),
        ({"key": ""}, 400, b'{"error":"idempotency_key_required"}'),
        (
            {"key": "k\u00e9"},
            400,
            b'{"error":"idempotency_key_invalid","message":"Idempotency-Key must be 1-255 printable ASCII characters."}',
        ),
        (
            {"key": "x" * 256},
            400,
            b'{"error":"idempotency_key_invalid","message":"Idempotency-Key must be 1-255 printable ASCII characters."}',
        ),
        ({"user": None}, 401, b'{"error":"unauthenticated","message":"No authenticated principal for this request."}'),
    ],
    ids=["no-key", "empty-key", "non-ascii-key", "long-key", "no-principal"],
)
def test_refusals_are_json_and_nothing_runs(client_for, kwargs, status, body):
    orders = Orders()
    client, ledger = client_for(orders)
    reply = post(client, **kwargs)
    assert (reply.status, reply.body) == (status, body)
    assert reply.lowered == [("content-type", "application/json"), ("content-length", str(len(body)))]
    assert orders.runs == [] and ledger.operator.stats().total == 0


def test_same_key_with_another_body_is_409_reused_and_nothing_is_replayed(client_for):
    orders = Orders()
    client, _ = client_for(orders)
    post(client)
    reply = post(client, body=b'{"sku":"coffee"}')
    assert (reply.status, reply.body) == (409, b'{"error":"idempotency_key_reused"}')
    assert len(orders.runs) == 1


def test_reuse_status_422_is_a_policy_choice(client_for):
    client, _ = client_for(Orders(), policy=Policy(reuse_status=422))
    post(client)
    assert post(client, body=b"{}").status == 422


def sent_while_the_first_runs(client, orders: Orders) -> tuple[Reply, Reply]:  # type: ignore[no-untyped-def]
    """A second POST of the same request, sent while the first one's
    mutation is held inside the app (at `orders`' gate): the replies to
    the first, once it has been let go and has finished, and to the second."""
    assert orders.gate is not None
    first: list[Reply] = []
    runner = threading.Thread(target=lambda: first.append(post(client)))
    runner.start()
    try:
        for _ in range(200):
            if orders.runs:
                break
            threading.Event().wait(0.01)
        second = post(client)
    finally:
        orders.gate.set()
        runner.join(10)
    return first[0], second


def test_a_duplicate_while_the_first_runs_is_409_in_progress_with_retry_after(client_for):
    orders = Orders(gate=threading.Event())
    client, _ = client_for(orders)
    first, dup = sent_while_the_first_runs(client, orders)
    assert (dup.status, dup.header("Retry-After"), dup.body) == (
        409,
        "30",
        b'{"error":"idempotency_key_in_progress","retry_after_ms":30000}',
    )
    assert first.status == 201 and len(orders.runs) == 1


def test_a_stale_reservation_is_taken_over_and_runs_again(client_for, clock):
    orders = Orders(fail=True)
    client, ledger = client_for(orders)
    with pytest.raises(RuntimeError):
        post(client)
    orders.fail = False
    assert post(client).status == 409
    clock.advance(30_001)
    reply = post(client)
    assert (reply.status, reply.body, len(orders.runs)) == (201, b'{"id":2}', 2)
    assert ledger.lookup("acct_A", "k-1").generation == 2


def test_release_on_error_lets_the_retry_run_at_once(client_for):
    orders = Orders(fail=True)
    client, ledger = client_for(orders, release_on_error=True)
    with pytest.raises(RuntimeError):
        post(client)
    assert ledger.lookup("acct_A", "k-1") is None
    orders.fail = False
    assert post(client).status == 201


def test_principals_never_meet(client_for):
    orders = Orders()
    client, _ = client_for(orders)
    a = post(client, user="acct_A")
    b = post(client, user="acct_B")
    assert (a.body, b.body) == (b'{"id":1}', b'{"id":2}')


def test_safe_methods_and_exempt_paths_pass_through_untouched(mw_client_for):
    orders = Orders()
    client, ledger = mw_client_for(orders, exempt=_path_is("/login"))
    got = client.request("GET", "/orders", b"", {}, None)
    assert (got.status, got.header("Location")) == (201, "/orders/1")
    login = post(client, key=None, path="/login")
    assert login.status == 201 and ledger.operator.stats().total == 0


def test_key_optional_lets_keyless_requests_through(mw_client_for):
    orders = Orders()
    client, ledger = mw_client_for(orders, key_optional=lambda request: True)
    assert post(client, key=None).status == 201
    assert post(client, key=None).status == 201
    assert len(orders.runs) == 2 and ledger.operator.stats().total == 0


def test_a_body_over_the_limit_is_413_before_any_claim(client_for):
    orders = Orders()
    client, ledger = client_for(orders, max_body_bytes=4)
    reply = post(client, body=b"12345")
    assert (reply.status, json.loads(reply.body)["error"], json.loads(reply.body)["limit_bytes"]) == (
        413,
        "request_body_too_large",
        4,
    )
    assert orders.runs == [] and ledger.operator.stats().total == 0


def test_an_unavailable_ledger_fails_closed_with_503(adapter, tmp_path):
    orders = Orders()
    missing = Ledger.open(tmp_path / "never-initialised.db")
    client = CLIENTS[adapter](missing, orders)
    reply = post(client)
    assert (reply.status, reply.header("Retry-After"), reply.body) == (
        503,
        "1",
        b'{"error":"idempotency_ledger_unavailable","message":"The idempotency ledger is unavailable; retry later."}',
    )
    assert orders.runs == []


def test_a_query_string_is_part_of_the_fingerprint(client_for):
    orders = Orders()
    client, _ = client_for(orders)
    post(client, path="/orders?a=1")
    assert post(client, path="/orders?a=2").status == 409
    assert post(client, path="/orders?a=1").body == b'{"id":1}'


def test_every_adapter_stores_the_same_row_for_the_same_request(make_ledger):
    rows = []
    for cls in CLIENTS.values():
        ledger = make_ledger()
        post(cls(ledger, Orders()), key=f"same-{cls.__name__}")
        row = ledger.lookup("acct_A", f"same-{cls.__name__}")
        rows.append((row.fingerprint, row.response_status, row.response_headers, row.body_bytes))
    assert rows == [rows[0]] * len(CLIENTS)


def _path_is(path: str):
    def predicate(request) -> bool:  # type: ignore[no-untyped-def]
        if isinstance(request, dict) and "type" in request:
            return request.get("path") == path
        return request.get("PATH_INFO") == path

    return predicate


# -- the opt-in contract options and events, through every adapter -------------------------------


def test_with_the_wait_option_a_stampede_gets_one_run_and_identical_answers(client_for):
    gate = threading.Event()
    orders = Orders(gate=gate)
    client, _ = client_for(orders, policy=Policy(in_progress_wait_ms=10_000))
    replies: list[Reply] = []
    barrier = threading.Barrier(12)

    def one() -> None:
        barrier.wait(10)
        replies.append(post(client))

    threads = [threading.Thread(target=one) for _ in range(12)]
    for t in threads:
        t.start()
    threading.Timer(0.3, gate.set).start()
    for t in threads:
        t.join(20)
    assert len(orders.runs) == 1
    assert {(r.status, tuple(r.lowered), r.body) for r in replies} == {
        (201, (("content-type", "application/json"), ("location", "/orders/1"), ("content-length", "8")), b'{"id":1}')
    }
    assert len(replies) == 12


def test_a_policy_that_keeps_no_5xx_lets_the_retry_run_again(client_for):
    orders = Orders(status=503)
    client, ledger = client_for(orders, policy=Policy(keep_answer=lambda status, headers: status < 500))
    first = post(client)
    assert (first.status, first.body) == (503, b'{"id":1}')
    assert ledger.lookup("acct_A", "k-1") is None
    orders.status = 201
    second = post(client)
    assert (second.status, second.body, len(orders.runs)) == (201, b'{"id":2}', 2)
    assert post(client).body == b'{"id":2}'


def test_events_through_an_adapter_match_the_answers(client_for):
    from idemctl import Outcome

    client, ledger = client_for(Orders())
    seen: list[Outcome] = []
    ledger.subscribe(lambda event: seen.append(event.outcome))
    post(client)
    post(client)
    post(client, body=b'{"sku":"coffee"}')
    post(client, key=None)
    assert seen == [Outcome.EXECUTED, Outcome.REPLAYED, Outcome.REUSED, Outcome.KEY_REQUIRED]


# -- one gate: every answer is one event, whichever adapter made it -------------------------


@pytest.mark.parametrize(
    ("kwargs", "options", "outcome", "status"),
    [
        ({"user": None}, {}, "unauthenticated", 401),
        ({"body": b"12345"}, {"max_body_bytes": 4}, "body_refused", 413),
        ({"key": None}, {}, "key_required", 400),
    ],
    ids=["401", "413", "400"],
)
def test_every_refusal_an_adapter_makes_publishes_exactly_one_event(client_for, kwargs, options, outcome, status):
    orders = Orders()
    client, ledger = client_for(orders, **options)
    seen = []
    ledger.subscribe(seen.append)
    reply = post(client, **kwargs)
    assert reply.status == status
    assert [(e.outcome.value, e.status, e.method, e.path) for e in seen] == [(outcome, status, "POST", "/orders")]
    assert orders.runs == []


def test_an_unavailable_ledger_publishes_one_unavailable_event(adapter, tmp_path):
    missing = Ledger.open(tmp_path / "never-initialised.db")
    seen = []
    missing.subscribe(seen.append)
    reply = post(CLIENTS[adapter](missing, Orders()))
    assert reply.status == 503
    assert [(e.outcome.value, e.status) for e in seen] == [("unavailable", 503)]


NOT_STORED = (
    b'{"error":"idempotency_response_not_stored","message":"The request was processed, but its response was too '
    b'large to store, so it cannot be replayed; it will not run again under this Idempotency-Key."}'
)
NOT_STORED_PROBLEM = (
    b'{"type":"urn:idemctl:problem:idempotency_response_not_stored","title":"Answer too large to store",'
    b'"status":500,"detail":"The request was processed, but its response was too large to store, so it cannot be '
    b'replayed; it will not run again under this Idempotency-Key.","error":"idempotency_response_not_stored"}'
)


@pytest.mark.parametrize(
    ("problem_details", "content_type", "body"),
    [(False, "application/json", NOT_STORED), (True, "application/problem+json", NOT_STORED_PROBLEM)],
    ids=["json", "problem-details"],
)
def test_an_answer_over_the_body_cap_is_the_ledgers_json_error_first_and_on_every_retry(
    client_for, problem_details, content_type, body
):
    # The app answers application/json with a Location: neither describes
    # the 500 sent instead, whose body is the ledger's own error.
    orders = Orders()
    client, ledger = client_for(orders, policy=Policy(body_cap_bytes=4, problem_details=problem_details))
    first = post(client)
    again = post(client)
    expected = (500, [("content-type", content_type), ("content-length", str(len(body)))], body)
    assert (first.status, first.lowered, first.body) == expected
    assert (again.status, again.lowered, again.body) == expected
    assert len(orders.runs) == 1
    row = ledger.lookup("acct_A", "k-1")
    assert (row.response_status, row.body_bytes) == (500, None)


def test_headers_over_the_header_cap_are_the_same_json_error(client_for):
    orders = Orders()
    client, _ = client_for(orders, policy=Policy(header_cap_bytes=10))
    first = post(client)
    again = post(client)
    expected = (500, [("content-type", "application/json"), ("content-length", str(len(NOT_STORED)))], NOT_STORED)
    assert (first.status, first.lowered, first.body) == expected
    assert (again.status, again.lowered, again.body) == expected
    assert len(orders.runs) == 1


def test_an_error_raised_after_the_claim_leaves_the_reservation_pending_and_publishes_failed(client_for):
    orders = Orders(fail=True)
    client, ledger = client_for(orders)
    seen = []
    ledger.subscribe(seen.append)
    with pytest.raises(RuntimeError):
        post(client)
    assert [e.outcome.value for e in seen] == ["failed"]
    assert ledger.lookup("acct_A", "k-1").status.value == "pending"


# -- the key as the IETF draft sends it: an sf-string ------------------------------------------
DRAFT_KEY = "8e03978e-40d5-43e8-bc93-6894a57f9324"
INVALID_KEY = (
    b'{"error":"idempotency_key_invalid","message":"Idempotency-Key must be 1-255 printable ASCII characters."}'
)


def test_the_quoted_and_the_bare_key_are_one_reservation_through_every_adapter(client_for):
    orders = Orders()
    client, ledger = client_for(orders)
    first = post(client, key=f'"{DRAFT_KEY}"')
    again = post(client, key=DRAFT_KEY)
    assert (first.status, again.status, again.body) == (201, 201, first.body)
    assert orders.runs == [ORDER]
    assert ledger.lookup("acct_A", DRAFT_KEY).generation == 1


@pytest.mark.parametrize("value", ['"abc', '"a"b"', '""'])
def test_an_invalid_sf_string_is_400_and_nothing_runs_through_every_adapter(client_for, value):
    orders = Orders()
    client, ledger = client_for(orders)
    reply = post(client, key=value)
    assert (reply.status, reply.body) == (400, INVALID_KEY)
    assert orders.runs == [] and ledger.operator.stats().total == 0


KEY_LIST = (
    b'{"error":"idempotency_key_invalid","message":"Send exactly one Idempotency-Key: several fields, or a comma '
    b'outside a quoted key, are a list."}'
)


@pytest.mark.parametrize(
    ("value", "body"),
    [
        ('"lx" ;x=1', INVALID_KEY),  # RFC 8941: no space before a parameter's ";"
        ('"lx"\t;x=1', INVALID_KEY),
        ('"lx";X=1', INVALID_KEY),  # a parameter name is lower-case
        ('"lx";x=', INVALID_KEY),  # "=" needs a bare item
        ('"lx";x=1;', INVALID_KEY),
        ('"ly";x=1,"other"', KEY_LIST),  # a list is not an item
        ('"ly", "ly"', KEY_LIST),
        ("t2, t2", KEY_LIST),  # two fields a server or proxy joined, or a list
        ("t1,t2", KEY_LIST),
        (["t2", "t2"], KEY_LIST),  # two fields, joined by the WSGI server or seen apart
        (['"t2"', '"t2"'], KEY_LIST),
    ],
    ids=[
        "space-before-param",
        "tab-before-param",
        "upper-param",
        "empty-param-value",
        "trailing-semicolon",
        "quoted-list",
        "quoted-list-spaced",
        "bare-list",
        "bare-list-no-space",
        "two-fields",
        "two-quoted-fields",
    ],
)
def test_a_key_that_is_no_single_sf_item_is_400_and_nothing_runs_through_every_adapter(client_for, value, body):
    orders = Orders()
    client, ledger = client_for(orders)
    reply = post(client, key=value)
    assert (reply.status, reply.lowered, reply.body) == (
        400,
        [("content-type", "application/json"), ("content-length", str(len(body)))],
        body,
    )
    assert orders.runs == [] and ledger.operator.stats().total == 0


@pytest.mark.parametrize(
    ("value", "key"),
    [
        ('"lx"; x=1', "lx"),
        ('"lx";x=1;y="a b";z=?0;w=:YQ==:;v=tok/1;u=-1.5', "lx"),
        ('"a,b"', "a,b"),
        ("a;x=1", "a;x=1"),
    ],
    ids=["space-after-semicolon", "every-bare-item", "comma-inside-quotes", "bare-with-semicolon"],
)
def test_a_single_item_with_parameters_is_its_key_through_every_adapter(client_for, value, key):
    orders = Orders()
    client, ledger = client_for(orders)
    first = post(client, key=value)
    assert (first.status, first.body) == (201, b'{"id":1}')
    assert ledger.lookup("acct_A", key).generation == 1 and ledger.operator.stats().total == 1


def test_a_255_character_key_in_quotes_is_accepted_through_every_adapter(client_for):
    client, ledger = client_for(Orders())
    assert post(client, key='"' + "k" * 255 + '"').status == 201
    assert ledger.lookup("acct_A", "k" * 255) is not None


# -- problem details on request ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "options", "status", "code", "extra"),
    [
        ({"key": None}, {}, 400, "idempotency_key_required", {}),
        ({"key": '"abc'}, {}, 400, "idempotency_key_invalid", {}),
        ({"user": None}, {}, 401, "unauthenticated", {}),
        ({"body": b"12345"}, {"max_body_bytes": 4}, 413, "request_body_too_large", {"limit_bytes": 4}),
    ],
    ids=["400-required", "400-invalid", "401", "413"],
)
def test_with_problem_details_every_refusal_is_problem_json(client_for, kwargs, options, status, code, extra):
    client, _ = client_for(Orders(), policy=Policy(problem_details=True), **options)
    reply = post(client, **kwargs)
    problem = json.loads(reply.body)
    assert reply.status == status
    assert reply.header("Content-Type") == "application/problem+json"
    assert {k: problem[k] for k in ("type", "status", "error")} == {
        "type": f"urn:idemctl:problem:{code}",
        "status": status,
        "error": code,
    }
    assert problem["title"] and problem["detail"]
    assert {k: problem[k] for k in extra} == extra


def test_with_problem_details_409s_keep_retry_after_and_their_members(client_for):
    orders = Orders(gate=threading.Event())
    client, _ = client_for(orders, policy=Policy(problem_details=True))
    first, busy = sent_while_the_first_runs(client, orders)
    assert first.status == 201
    reused = post(client, body=b'{"sku":"coffee"}')
    replay = post(client)
    assert (busy.status, busy.header("Retry-After"), busy.header("Content-Type")) == (
        409,
        "30",
        "application/problem+json",
    )
    assert json.loads(busy.body)["retry_after_ms"] == 30000
    assert json.loads(busy.body)["type"] == "urn:idemctl:problem:idempotency_key_in_progress"
    assert json.loads(reused.body)["type"] == "urn:idemctl:problem:idempotency_key_reused"
    # The app's own answer is never touched, first or replayed.
    assert (replay.status, replay.body, replay.header("Content-Type")) == (201, b'{"id":1}', "application/json")


def test_with_problem_details_an_unavailable_ledger_is_problem_json_with_retry_after(adapter, tmp_path):
    missing = Ledger.open(tmp_path / "never-initialised.db", policy=Policy(problem_details=True))
    reply = post(CLIENTS[adapter](missing, Orders()))
    assert (reply.status, reply.header("Retry-After"), reply.header("Content-Type")) == (
        503,
        "1",
        "application/problem+json",
    )
    assert json.loads(reply.body)["type"] == "urn:idemctl:problem:idempotency_ledger_unavailable"


# -- a request line or a principal the ledger cannot take: the client's 4xx, never a 500 ------
LONG_TARGET = "/orders?pad=" + "a" * 65_536  # past the ledger's 64 KiB bound on the request target
TARGET_TOO_LONG = b'{"error":"request_target_too_long","message":"The request target is longer than 65536 bytes."}'
PRINCIPAL_UNUSABLE = (
    b'{"error":"unauthenticated","message":"The authenticated principal cannot be used as an idempotency namespace."}'
)


def test_a_request_target_over_64_kib_is_414_and_nothing_is_claimed(client_for):
    orders = Orders()
    client, ledger = client_for(orders)
    seen = []
    ledger.subscribe(seen.append)
    reply = post(client, path=LONG_TARGET)
    assert (reply.status, reply.body) == (414, TARGET_TOO_LONG)
    assert reply.lowered == [("content-type", "application/json"), ("content-length", str(len(TARGET_TOO_LONG)))]
    assert orders.runs == [] and ledger.operator.stats().total == 0
    assert [(e.outcome.value, e.status, e.principal, e.key) for e in seen] == [
        ("request_refused", 414, "acct_A", "k-1")
    ]
    # The same client with a sane target is served as ever.
    assert post(client).status == 201


def test_a_principal_over_512_bytes_is_401_and_nothing_is_claimed(client_for, caplog):
    orders = Orders()
    client, ledger = client_for(orders)
    seen = []
    ledger.subscribe(seen.append)
    reply = post(client, user="u" * 513)
    assert (reply.status, reply.body) == (401, PRINCIPAL_UNUSABLE)
    assert orders.runs == [] and ledger.operator.stats().total == 0
    assert [(e.outcome.value, e.status, e.principal) for e in seen] == [("unauthenticated", 401, None)]
    # The operator learns that the auth layer resolved a principal the ledger cannot hold.
    assert any("cannot be used as a ledger principal" in r.getMessage() for r in caplog.records)


def test_with_problem_details_the_414_is_problem_json(client_for):
    client, _ = client_for(Orders(), policy=Policy(problem_details=True))
    reply = post(client, path=LONG_TARGET)
    problem = json.loads(reply.body)
    assert (reply.status, reply.header("Content-Type")) == (414, "application/problem+json")
    assert {k: problem[k] for k in ("type", "title", "status", "error")} == {
        "type": "urn:idemctl:problem:request_target_too_long",
        "title": "Request target too long",
        "status": 414,
        "error": "request_target_too_long",
    }
