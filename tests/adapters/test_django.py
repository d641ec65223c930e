"""idemctl.django through Django's own test client: the signed-in user's
primary key is the principal, DRF views with the mixin get the user DRF's
token authentication found, the per-view marks and EXEMPT_PATHS, streamed
and multipart bodies, the settings dict, and one ledger per process,
opened at the first protected request."""

from __future__ import annotations

import asyncio
import functools
import io
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from django.test.client import MULTIPART_CONTENT, RequestFactory, encode_multipart
from django.urls import path
from django.views import View

import idemctl.django as idemctl_django
from idemctl import Ledger, responses
from idemctl.django import (
    Config,
    IdempotencyMiddleware,
    IdempotencyMixin,
    idempotency_exempt,
    idempotency_key_optional,
    idempotency_key_required,
    init_ledger,
    user_principal,
)
from idemctl.wsgi import PRINCIPAL_ENVIRON_KEY
from idemctl.wsgi import IdempotencyMiddleware as WsgiMiddleware
from tests.adapters.django_site import Site, make_user, setup, token_for, wire
from tests.helpers import clean_env

ORDER = b'{"sku":"tea","qty":2}'
UNAUTHENTICATED = b'{"error":"unauthenticated","message":"No authenticated principal for this request."}'
KEY_REQUIRED = b'{"error":"idempotency_key_required"}'


def header_principal(request: Any) -> str | None:
    """The tests' stand-in auth layer: the principal named by a header."""
    return request.META.get("HTTP_X_USER")


@pytest.fixture
def ledger(tmp_path, clock):
    with Ledger.open(tmp_path / "ledger.db", clock=clock) as opened:
        opened.init()
        yield opened


class Orders:
    """A plain Django view that counts its runs (with the principal idemctl
    resolved for each) and answers 201 + Location."""

    def __init__(self) -> None:
        self.runs: list[tuple[str | None, bytes]] = []

    def view(self, request: Any) -> HttpResponse:
        self.runs.append((request.META.get(PRINCIPAL_ENVIRON_KEY), request.body))
        n = len(self.runs)
        response = JsonResponse({"id": n}, status=201)
        response["Location"] = f"/orders/{n}"
        return response


# -- the middleware with Django's own users ------------------------------------------------
def test_a_signed_in_users_post_runs_once_and_its_retry_replays_the_stored_answer(ledger):
    orders = Orders()
    site = Site([path("orders", orders.view)], {"LEDGER": ledger})
    alice = make_user("alice")
    site.client.force_login(alice)
    first = site.post("/orders", ORDER)
    again = site.post("/orders", ORDER)
    assert (first.status_code, first.reason_phrase, first.content) == (201, "Created", b'{"id": 1}')
    assert (first["Location"], first["Content-Length"]) == ("/orders/1", "9")
    assert wire(again) == wire(first)
    assert orders.runs == [(str(alice.pk), ORDER)]
    row = ledger.lookup(str(alice.pk), "k-1")
    assert (row.status.value, row.response_status, row.generation) == ("completed", 201, 1)


def test_an_anonymous_post_gets_the_contracts_401_and_claims_nothing(ledger):
    orders = Orders()
    site = Site([path("orders", orders.view)], {"LEDGER": ledger})
    reply = site.post("/orders", ORDER)
    assert (reply.status_code, reply["Content-Type"], reply.content) == (401, "application/json", UNAUTHENTICATED)
    assert orders.runs == [] and ledger.operator.stats().total == 0


def test_two_users_with_the_same_key_never_meet(ledger):
    orders = Orders()
    site = Site([path("orders", orders.view)], {"LEDGER": ledger})
    alice, bob = make_user("alice"), make_user("bob")
    site.client.force_login(alice)
    a = site.post("/orders", ORDER, key="same")
    site.client.force_login(bob)
    b = site.post("/orders", ORDER, key="same")
    b_again = site.post("/orders", ORDER, key="same")
    site.client.force_login(alice)
    a_again = site.post("/orders", ORDER, key="same")
    assert (a.content, b.content) == (b'{"id": 1}', b'{"id": 2}')
    assert (a_again.content, b_again.content) == (a.content, b.content)
    assert orders.runs == [(str(alice.pk), ORDER), (str(bob.pk), ORDER)]
    assert {ledger.lookup(str(u.pk), "same").body_bytes for u in (alice, bob)} == {a.content, b.content}


def test_safe_methods_pass_through_without_a_key_or_a_user(ledger):
    orders = Orders()
    site = Site([path("orders", orders.view)], {"LEDGER": ledger})
    assert site.request("GET", "/orders").status_code == 201
    assert site.request("GET", "/orders").status_code == 201
    assert len(orders.runs) == 2 and ledger.operator.stats().total == 0


def test_a_principal_named_by_dotted_path_replaces_request_user(ledger):
    orders = Orders()
    site = Site(
        [path("orders", orders.view)], {"LEDGER": ledger, "PRINCIPAL": "tests.adapters.test_django.header_principal"}
    )
    assert site.post("/orders", ORDER, X_User="acct_A").status_code == 201
    assert ledger.lookup("acct_A", "k-1").response_status == 201


# -- Django REST framework -----------------------------------------------------------------
@functools.cache
def drf() -> SimpleNamespace:
    """DRF reads Django's settings as it is imported: only after setup()."""
    setup()
    from rest_framework import serializers, viewsets
    from rest_framework.authentication import TokenAuthentication
    from rest_framework.decorators import api_view
    from rest_framework.permissions import AllowAny, IsAuthenticated
    from rest_framework.response import Response
    from rest_framework.views import APIView

    class OrderSerializer(serializers.Serializer):  # type: ignore[misc]
        sku = serializers.CharField()
        qty = serializers.IntegerField(min_value=1)

    return SimpleNamespace(
        APIView=APIView,
        AllowAny=AllowAny,
        IsAuthenticated=IsAuthenticated,
        OrderSerializer=OrderSerializer,
        Response=Response,
        TokenAuthentication=TokenAuthentication,
        ViewSet=viewsets.ViewSet,
        api_view=api_view,
    )


class DrfOrders:
    """A DRF orders endpoint (token auth), with or without the mixin."""

    def __init__(self, *, mixin: bool = True, open_to_anonymous: bool = False) -> None:
        self.attempts = 0
        self.runs: list[str | None] = []
        self.fail = False
        d = drf()
        owner = self

        def post(view: Any, request: Any) -> Any:
            owner.attempts += 1
            order = d.OrderSerializer(data=request.data)
            order.is_valid(raise_exception=True)
            if owner.fail:
                raise RuntimeError("the mutation failed")
            owner.runs.append(str(request.user.pk) if request.user.is_authenticated else None)
            n = len(owner.runs)
            return d.Response({"id": n, **order.validated_data}, status=201, headers={"Location": f"/api/orders/{n}"})

        bases = (IdempotencyMixin, d.APIView) if mixin else (d.APIView,)
        permission = d.AllowAny if open_to_anonymous else d.IsAuthenticated
        attributes = {
            "authentication_classes": [d.TokenAuthentication],
            "permission_classes": [permission],
            "post": post,
        }
        self.view = type("OrderList", bases, attributes).as_view()


def test_drf_token_auth_makes_the_token_user_the_principal(ledger):
    orders = DrfOrders()
    site = Site([path("api/orders", orders.view)], {"LEDGER": ledger})
    alice, bob = make_user("alice"), make_user("bob")
    as_alice, as_bob = {"Authorization": f"Token {token_for(alice)}"}, {"Authorization": f"Token {token_for(bob)}"}
    a = site.post("/api/orders", ORDER, key="order-1", **as_alice)
    b = site.post("/api/orders", ORDER, key="order-1", **as_bob)
    a_again = site.post("/api/orders", ORDER, key="order-1", **as_alice)
    assert (a.status_code, a.content, a["Location"]) == (201, b'{"id":1,"sku":"tea","qty":2}', "/api/orders/1")
    assert (b.status_code, b.content, b["Location"]) == (201, b'{"id":2,"sku":"tea","qty":2}', "/api/orders/2")
    assert wire(a_again) == wire(a)
    assert orders.runs == [str(alice.pk), str(bob.pk)]
    assert ledger.lookup(str(alice.pk), "order-1").body_bytes == a.content
    assert ledger.lookup(str(bob.pk), "order-1").body_bytes == b.content


def test_drf_answers_carry_exactly_the_middlewares_headers(ledger):
    orders = DrfOrders()
    site = Site([path("api/orders", orders.view)], {"LEDGER": ledger, "REPLAYED_HEADER": True})
    token = {"Authorization": f"Token {token_for(make_user())}"}
    first = site.post("/api/orders", ORDER, **token)
    again = site.post("/api/orders", ORDER, **token)
    # DRF's own Allow and Vary are not replayable, so the first answer does not carry them either.
    assert list(first.items()) == [
        ("content-type", "application/json"),
        ("location", "/api/orders/1"),
        ("content-length", "28"),
    ]
    assert list(again.items()) == [*list(first.items())[:2], ("idempotent-replayed", "true"), ("content-length", "28")]


def test_drf_refusing_a_request_claims_nothing(ledger):
    orders = DrfOrders()
    site = Site([path("api/orders", orders.view)], {"LEDGER": ledger})
    anonymous = site.post("/api/orders", ORDER)
    wrong_token = site.post("/api/orders", ORDER, Authorization="Token nope")
    assert (anonymous.status_code, json.loads(anonymous.content)) == (
        401,
        {"detail": "Authentication credentials were not provided."},
    )
    assert (wrong_token.status_code, json.loads(wrong_token.content)) == (401, {"detail": "Invalid token."})
    assert orders.attempts == 0 and ledger.operator.stats().total == 0


def test_drf_view_open_to_anonymous_users_answers_the_contracts_401(ledger):
    orders = DrfOrders(open_to_anonymous=True)
    site = Site([path("api/orders", orders.view)], {"LEDGER": ledger})
    reply = site.post("/api/orders", ORDER)
    assert (reply.status_code, list(reply.items()), reply.content) == (
        401,
        [("content-type", "application/json"), ("content-length", str(len(UNAUTHENTICATED)))],
        UNAUTHENTICATED,
    )
    assert orders.attempts == 0 and ledger.operator.stats().total == 0


def test_a_drf_validation_error_is_the_stored_answer_and_is_replayed(ledger):
    orders = DrfOrders()
    site = Site([path("api/orders", orders.view)], {"LEDGER": ledger})
    token = {"Authorization": f"Token {token_for(make_user())}"}
    first = site.post("/api/orders", b'{"sku":"tea","qty":0}', **token)
    again = site.post("/api/orders", b'{"sku":"tea","qty":0}', **token)
    assert (first.status_code, json.loads(first.content)) == (
        400,
        {"qty": ["Ensure this value is greater than or equal to 1."]},
    )
    assert wire(again) == wire(first)
    assert (orders.attempts, orders.runs) == (1, [])


@pytest.mark.parametrize(("release", "left"), [(False, "pending"), (True, None)], ids=["kept", "released"])
def test_a_drf_handler_that_raises_leaves_or_releases_its_reservation(ledger, release, left):
    orders = DrfOrders()
    orders.fail = True
    site = Site([path("api/orders", orders.view)], {"LEDGER": ledger, "RELEASE_ON_ERROR": release})
    user = make_user()
    with pytest.raises(RuntimeError, match="the mutation failed"):
        site.post("/api/orders", ORDER, Authorization=f"Token {token_for(user)}")
    row = ledger.lookup(str(user.pk), "k-1")
    assert (row.status.value if row else None) == left


@pytest.mark.parametrize(("release", "left"), [(False, "pending"), (True, None)], ids=["kept", "released"])
def test_a_view_that_raises_gets_djangos_500_and_leaves_or_releases_its_reservation(ledger, release, left):
    from django.apps import apps

    def view(request: Any) -> HttpResponse:
        raise RuntimeError("the mutation failed")

    idemctl = {"LEDGER": ledger, "PRINCIPAL": header_principal, "RELEASE_ON_ERROR": release}
    site = Site([path("orders", view)], idemctl, raise_request_exception=False)
    assert apps.get_app_config("idemctl").name == "idemctl.django"
    assert site.post("/orders", ORDER, X_User="acct_A").status_code == 500
    row = ledger.lookup("acct_A", "k-1")
    assert (row.status.value if row else None) == left  # the 500 was never stored as the answer
    assert site.post("/orders", ORDER, X_User="acct_A").status_code == (500 if release else 409)


WITHOUT_THE_APP = """
import django
from django.conf import settings
from django.http import HttpResponse
from django.test import Client
from django.urls import path
from idemctl import Ledger

def view(request):
    raise RuntimeError("the mutation failed")

urlpatterns = [path("orders", view)]
settings.configure(
    SECRET_KEY="x", ALLOWED_HOSTS=["testserver"], ROOT_URLCONF=__name__, INSTALLED_APPS=[],
    MIDDLEWARE=["idemctl.django.IdempotencyMiddleware"],
    IDEMCTL={"LEDGER": "ledger.db", "PRINCIPAL": lambda request: "acct_A"},
)
django.setup()
Ledger.open("ledger.db").init()
client = Client(raise_request_exception=False)
post = lambda: client.post("/orders", b"{}", content_type="application/json", HTTP_IDEMPOTENCY_KEY="k-1").status_code
print(post(), post(), Ledger.open("ledger.db").lookup("acct_A", "k-1").status.value)
"""


@pytest.mark.slow
def test_without_the_app_in_installed_apps_the_middleware_still_learns_that_a_view_raised(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IDEMCTL_", "DJANGO_"))}
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_THE_APP], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["500", "409", "pending"]


def test_a_drf_view_without_the_mixin_sees_djangos_user_and_the_log_says_what_to_add(ledger, caplog):
    orders = DrfOrders(mixin=False)
    site = Site([path("api/orders", orders.view)], {"LEDGER": ledger})
    token = {"Authorization": f"Token {token_for(make_user())}"}
    with caplog.at_level("WARNING", logger="idemctl.django"):
        reply = site.post("/api/orders", ORDER, **token)
    assert (reply.status_code, reply.content) == (401, UNAUTHENTICATED)
    assert orders.attempts == 0
    assert "Add idemctl.django.IdempotencyMixin to the view" in caplog.text


def test_marks_on_viewset_actions_and_on_drf_function_views(ledger):
    d = drf()
    runs: list[str] = []

    class Things(IdempotencyMixin, d.ViewSet):  # type: ignore[misc, valid-type]
        authentication_classes = ()
        permission_classes = (d.AllowAny,)

        def create(self, request: Any) -> Any:
            runs.append("create")
            return d.Response({"made": len(runs)}, status=201)

        @idempotency_key_optional
        def partial_update(self, request: Any, pk: str) -> Any:
            runs.append("update")
            return d.Response({"updated": pk})

    @idempotency_exempt
    @d.api_view(["POST"])
    def hook(request: Any) -> Any:
        runs.append("hook")
        return d.Response({"ok": True})

    things = Things.as_view({"post": "create"})
    thing = Things.as_view({"patch": "partial_update"})
    site = Site(
        [path("things", things), path("things/<str:pk>", thing), path("hook", hook)],
        {"LEDGER": ledger, "PRINCIPAL": header_principal},
    )
    assert (site.post("/things", key=None, X_User="acct_A").content) == KEY_REQUIRED
    assert site.request("PATCH", "/things/7", b"{}", {"X-User": "acct_A"}).status_code == 200
    assert site.request("PATCH", "/things/7", b"{}", {"X-User": "acct_A"}).status_code == 200
    assert site.post("/hook", key=None).status_code == 200
    assert site.post("/things", key="t-1", X_User="acct_A").status_code == 201
    assert site.post("/things", key="t-1", X_User="acct_A").status_code == 201
    assert runs == ["update", "update", "hook", "create"]
    assert ledger.operator.stats().total == 1


# -- per-view marks and exempt paths -------------------------------------------------------
def test_marked_views_and_exempt_paths(ledger):
    runs: list[str] = []

    def answering(name: str, status: int = 200) -> Any:
        def view(request: Any, **kwargs: Any) -> HttpResponse:
            runs.append(name)
            return HttpResponse(name.encode(), status=status)

        return view

    class Ping(View):
        @idempotency_key_optional
        def post(self, request: Any) -> HttpResponse:
            runs.append("ping")
            return HttpResponse(b"pong")

    @idempotency_exempt
    class Login(View):
        def post(self, request: Any) -> HttpResponse:
            runs.append("login")
            return HttpResponse(b"welcome")

    site = Site(
        [
            path("login", Login.as_view()),
            path("ping", Ping.as_view()),
            path("session", idempotency_exempt(answering("session"))),
            path("hooks/free", answering("free")),
            path("hooks/strict", idempotency_key_required(answering("strict"))),
            path("callbacks/<str:ref>", answering("callback")),
            path("orders", answering("order", 201)),
        ],
        {
            "LEDGER": ledger,
            "PRINCIPAL": header_principal,
            "EXEMPT_PATHS": [
                "/hooks/",
                re.compile(r"/callbacks/\d+\Z"),
                lambda request: "HTTP_X_INTERNAL" in request.META,
            ],
        },
    )

    def keyless(path_: str, **headers: str) -> Any:
        return site.post(path_, key=None, X_User="acct_A", **headers)

    assert [
        keyless(p).status_code for p in ("/login", "/session", "/ping", "/ping", "/hooks/free", "/callbacks/7")
    ] == [200] * 6
    assert keyless("/orders", X_Internal="1").status_code == 201
    assert (keyless("/hooks/strict").content, keyless("/callbacks/x").content, keyless("/orders").content) == (
        KEY_REQUIRED,
    ) * 3
    assert runs == ["login", "session", "ping", "ping", "free", "callback", "order"]
    assert ledger.operator.stats().total == 0
    # A key-optional view with a key is protected as usual.
    assert site.post("/ping", key="p-1", X_User="acct_A").content == b"pong"
    assert site.post("/ping", key="p-1", X_User="acct_A").content == b"pong"
    assert runs.count("ping") == 3 and ledger.operator.stats().total == 1


# -- bodies --------------------------------------------------------------------------------
def _wsgi_answer(app: Any, ledger: Ledger, key: str) -> tuple[str, list[tuple[str, str]], bytes]:
    mw = WsgiMiddleware(app, ledger, principal=lambda environ: "acct_A")
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/blobs",
        "SCRIPT_NAME": "",
        "QUERY_STRING": "",
        "CONTENT_LENGTH": "0",
        "HTTP_IDEMPOTENCY_KEY": key,
        "wsgi.input": io.BytesIO(b""),
    }
    seen: dict[str, Any] = {}
    body = b"".join(mw(environ, lambda status, headers, exc_info=None: seen.update(status=status, headers=headers)))
    return seen["status"], seen["headers"], body


def test_a_streamed_response_is_collected_whole_and_sent_as_the_wsgi_middleware_sends_it(ledger):
    closed: list[str] = []
    expected = b"".join(bytes([i, 0xFF, 0x00]) * 100 for i in range(5))

    def chunks() -> Any:
        try:
            for i in range(5):
                yield bytes([i, 0xFF, 0x00]) * 100
        finally:
            closed.append("closed")

    def view(request: Any) -> StreamingHttpResponse:
        response = StreamingHttpResponse(chunks(), status=201, content_type="application/octet-stream")
        response["Location"] = "/blobs/1"
        return response

    def wsgi_app(environ: Any, start_response: Any) -> Any:
        start_response("201 Created", [("Content-Type", "application/octet-stream"), ("Location", "/blobs/1")])
        return chunks()

    site = Site([path("blobs", view)], {"LEDGER": ledger, "PRINCIPAL": header_principal})
    first = site.post("/blobs", b"", X_User="acct_A")
    again = site.post("/blobs", b"", X_User="acct_A")
    assert (first.status_code, first.streaming, first.content) == (201, False, expected)
    assert wire(again) == wire(first) and closed == ["closed"]
    status, headers, body = _wsgi_answer(wsgi_app, ledger, "k-wsgi")
    assert (status, headers, body) == (f"{first.status_code} {first.reason_phrase}", list(first.items()), first.content)


def test_a_file_response_is_sent_whole_its_file_closed_and_the_request_finishes_once(ledger, tmp_path):
    from django.core.signals import request_finished
    from django.http import FileResponse

    (tmp_path / "receipt.bin").write_bytes(b"\x00receipt\xff" * 1000)
    opened: list[Any] = []
    finished: list[object] = []

    def view(request: Any) -> FileResponse:
        opened.append(open(tmp_path / "receipt.bin", "rb"))
        return FileResponse(opened[-1], status=201, content_type="application/octet-stream")

    def note(sender: object, **kwargs: Any) -> None:
        finished.append(sender)

    site = Site([path("receipts", view)], {"LEDGER": ledger, "PRINCIPAL": header_principal})
    request_finished.connect(note)
    try:
        first = site.post("/receipts", b"", X_User="acct_A")
    finally:
        request_finished.disconnect(note)
    assert (first.status_code, first.streaming, first.content) == (201, False, b"\x00receipt\xff" * 1000)
    assert opened[0].closed and len(finished) == 1
    assert wire(site.post("/receipts", b"", X_User="acct_A")) == wire(first) and len(opened) == 1


def test_a_multipart_upload_behind_csrf_checks_is_fingerprinted_and_replayed(ledger):
    stored: list[bytes] = []

    def upload(request: Any) -> HttpResponse:
        stored.append(request.FILES["doc"].read())
        return HttpResponse(b"stored", status=201)

    site = Site([path("upload", upload)], {"LEDGER": ledger}, enforce_csrf_checks=True)
    site.client.force_login(make_user())
    secret = "a" * 32  # the CSRF secret the browser holds in its cookie and repeats in the form
    site.client.cookies["csrftoken"] = secret

    def send(content: bytes) -> Any:
        doc = SimpleNamespace(name="doc.txt", read=lambda: content)
        body = encode_multipart("BoUnDaRyStRiNg", {"csrfmiddlewaretoken": secret, "doc": doc})
        return site.request("POST", "/upload", body, {"Content-Type": MULTIPART_CONTENT, "Idempotency-Key": "up-1"})

    first, again, other = send(b"page one"), send(b"page one"), send(b"page two")
    assert (first.status_code, first.content) == (201, b"stored")
    assert wire(again) == wire(first)
    assert (other.status_code, other.content) == (409, b'{"error":"idempotency_key_reused"}')
    assert stored == [b"page one"]


def test_a_chunked_body_django_cannot_read_is_411_before_any_claim(ledger):
    orders = Orders()
    site = Site([path("orders", orders.view)], {"LEDGER": ledger, "PRINCIPAL": header_principal})
    reply = site.request(
        "POST", "/orders", b"", {"Idempotency-Key": "c-1", "X-User": "acct_A", "Transfer-Encoding": "chunked"}
    )
    status, _, body = responses.length_required()
    assert (reply.status_code, reply.content) == (status, body) == (411, body)
    assert orders.runs == [] and ledger.operator.stats().total == 0


def test_a_body_over_max_body_bytes_is_413_before_any_claim(ledger):
    orders = Orders()
    site = Site([path("orders", orders.view)], {"LEDGER": ledger, "PRINCIPAL": header_principal, "MAX_BODY_BYTES": 4})
    reply = site.post("/orders", b"12345", X_User="acct_A")
    assert (reply.status_code, json.loads(reply.content)["limit_bytes"]) == (413, 4)
    assert orders.runs == [] and ledger.operator.stats().total == 0


# -- settings ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ({"LEDGR": "x.db"}, "unknown entries ['LEDGR']"),
        ({"POLICY": {"pending_ttl": 5}}, 'IDEMCTL["POLICY"]'),
        ({"POLICY": {"pending_ttl_ms": 0}}, "pending_ttl_ms must be > 0"),
        ({"PROTECTED_METHODS": "POST"}, "protected_methods must be a set of method names"),
        ({"MAX_BODY_BYTES": -1}, 'IDEMCTL["MAX_BODY_BYTES"] must be an integer >= 0'),
        ({"PRINCIPAL": "tests.adapters.test_django.nobody"}, 'IDEMCTL["PRINCIPAL"]'),
        ({"EXEMPT_PATHS": "/hooks/"}, 'IDEMCTL["EXEMPT_PATHS"] must be a list'),
        ({"REPLAYED_HEADER": "yes"}, 'IDEMCTL["REPLAYED_HEADER"] must be True or False'),
        ({"RELEASE_ON_ERROR": "yes"}, 'IDEMCTL["RELEASE_ON_ERROR"] must be a bool or a callable'),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_a_mistake_in_the_settings_dict_is_refused_naming_the_entry(entries, message):
    with pytest.raises(ImproperlyConfigured, match=re.escape(message)):
        Config.from_mapping(entries)


def test_a_ledger_object_carries_its_own_policy(ledger):
    with pytest.raises(ImproperlyConfigured, match="carries its own policy"):
        Config.from_mapping({"LEDGER": ledger, "POLICY": {"reuse_status": 422}})


def test_the_middleware_refuses_bad_settings_at_startup(ledger):
    site = Site([], {"LEDGER": ledger, "MAX_BODY_BYTES": "1MB"})
    site.install()
    with pytest.raises(ImproperlyConfigured, match="MAX_BODY_BYTES"):
        IdempotencyMiddleware(lambda request: HttpResponse())


def test_the_settings_dict_builds_the_policy_and_the_environment_fills_in_the_rest(tmp_path, monkeypatch):
    clean_env(monkeypatch)
    monkeypatch.setenv("IDEMCTL_DB", str(tmp_path / "from-env.db"))
    monkeypatch.setenv("IDEMCTL_PENDING_TTL", "10s")
    config = Config.from_mapping({"POLICY": {"reuse_status": 422}, "PROTECTED_METHODS": ["POST", "put"]})
    assert config.ledger_target == str(tmp_path / "from-env.db")
    assert (config.policy.pending_ttl_ms, config.policy.reuse_status) == (10_000, 422)
    assert config.policy.protected_methods == frozenset({"POST", "PUT"})
    assert Config.from_mapping({"LEDGER": tmp_path / "named.db"}).ledger_target == str(tmp_path / "named.db")


def test_without_authentication_middleware_the_default_principal_says_what_to_add():
    setup()
    with pytest.raises(ImproperlyConfigured, match="AuthenticationMiddleware"):
        user_principal(RequestFactory().post("/orders"))


# -- the ledger's life ---------------------------------------------------------------------
def test_the_ledger_opens_at_the_first_protected_request_once_per_process(tmp_path, monkeypatch):
    target = str(tmp_path / "lazy.db")
    with Ledger.open(target) as made:
        made.init()
    opened: list[str] = []
    real_open = Ledger.open

    def counting_open(where: Any, **options: Any) -> Ledger:
        opened.append(str(where))
        return real_open(where, **options)

    monkeypatch.setattr(Ledger, "open", counting_open)
    orders = Orders()
    site = Site([path("orders", orders.view)], {"LEDGER": target, "PRINCIPAL": header_principal})
    assert site.request("GET", "/orders").status_code == 201  # the middleware is loaded now
    assert opened == []
    assert site.post("/orders", ORDER, key="k-1", X_User="acct_A").status_code == 201
    assert site.post("/orders", ORDER, key="k-2", X_User="acct_A").status_code == 201
    assert opened == [target]

    # A forked worker opens its own ledger and leaves the inherited one to its parent.
    parent_ledger = idemctl_django.current_config().ledger()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            reply = site.post("/orders", ORDER, key="k-child", X_User="acct_A")
            mine = idemctl_django.current_config().ledger()
            os.write(write, json.dumps([reply.status_code, mine is parent_ledger, opened]).encode())
        finally:
            os._exit(0)
    os.close(write)
    _, exit_status = os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as pipe:
        child = json.loads(pipe.read() or b"null")
    assert (exit_status, child) == (0, [201, False, [target, target]])
    assert site.post("/orders", ORDER, key="k-3", X_User="acct_A").status_code == 201
    assert idemctl_django.current_config().ledger() is parent_ledger and opened == [target]
    assert [ledger_row.row.key for ledger_row in [parent_ledger.operator.get("acct_A", "k-child")]] == ["k-child"]


def test_init_ledger_creates_the_ledger_named_in_settings_and_serves_as_a_post_migrate_receiver(tmp_path):
    target = tmp_path / "made-by-migrate.db"
    Site([], {"LEDGER": str(target)}).install()
    first = init_ledger(sender=None, app_config=None, verbosity=1, interactive=False, using="default")
    assert first.describe().startswith("created")
    assert init_ledger().describe().startswith("already up to date")
    assert target.exists()


def test_the_bounded_sweep_runs_after_an_executed_answer(ledger, clock):
    ledger.claim("acct_A", "old", "fp")
    clock.advance(ledger.policy.retention_ms + 1)
    site = Site([path("orders", Orders().view)], {"LEDGER": ledger, "PRINCIPAL": header_principal})
    assert site.post("/orders", ORDER, key="new", X_User="acct_A").status_code == 201
    assert ledger.lookup("acct_A", "old") is None and ledger.lookup("acct_A", "new") is not None


def test_under_asgi_the_answers_and_the_fingerprint_are_the_wsgi_ones(ledger):
    from django.test import AsyncClient

    orders = Orders()
    site = Site([path("orders", orders.view)], {"LEDGER": ledger, "PRINCIPAL": header_principal})
    by_wsgi = site.post("/orders?x=1", ORDER, key="w-1", X_User="acct_A")
    site.install()
    headers = {"idempotency-key": "a-1", "x-user": "acct_A"}  # ASGI header names, as the client passes them on

    async def post() -> Any:
        return await AsyncClient().post("/orders?x=1", data=ORDER, content_type="application/json", **headers)

    first, again = asyncio.run(post()), asyncio.run(post())
    # The second order of the same view: only its Location and id differ.
    assert (by_wsgi.status_code, by_wsgi["Location"], by_wsgi.content) == (201, "/orders/1", b'{"id": 1}')
    assert (first.status_code, first.reason_phrase, first.content) == (201, "Created", b'{"id": 2}')
    assert list(first.items()) == [(k, "/orders/2" if k == "location" else v) for k, v in by_wsgi.items()]
    assert wire(again) == wire(first) and len(orders.runs) == 2
    assert ledger.lookup("acct_A", "a-1").fingerprint == ledger.lookup("acct_A", "w-1").fingerprint


def test_two_set_cookie_fields_are_replayed_as_two_cookies_never_folded(make_ledger):
    from django.http import HttpResponse as Plain
    from django.urls import path as url

    from idemctl import Policy
    from tests.adapters.django_site import Site

    ledger = make_ledger(policy=Policy(replayable_headers=("content-type", "set-cookie")))

    def view(request):  # type: ignore[no-untyped-def]
        response = Plain(b"made", status=201)
        response.set_cookie("session", "a", path="/")
        response.set_cookie("csrf", "b", path="/")
        return response

    site = Site([url("orders", view)], {"LEDGER": ledger, "PRINCIPAL": lambda request: "acct_A"})
    for _ in range(2):  # the first answer and its replay
        got = site.request("POST", "/orders", b"{}", {"Idempotency-Key": "k-cookies"})
        assert got.status_code == 201
        assert {name: morsel.value for name, morsel in got.cookies.items()} == {"session": "a", "csrf": "b"}
