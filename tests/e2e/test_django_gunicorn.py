"""End to end: examples/django_project under a real `gunicorn -w 4`, over
HTTP. The DRF endpoint authenticates with tokens; the plain view with a
session cookie and Django's CSRF token."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.e2e.django_server import PASSWORD, USERS, DjangoGunicornServer

# The module's servers are started once: its tests stay on one worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_django_gunicorn")]

UNAUTHENTICATED = {"error": "unauthenticated", "message": "No authenticated principal for this request."}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    with DjangoGunicornServer(tmp_path_factory.mktemp("django"), workers=4) as srv:
        yield srv


def token(user: str) -> dict[str, str]:
    return {"Authorization": f"Token {USERS[user]}"}


def post(
    url: str, key: str | None, body: dict[str, object], headers: dict[str, str], path: str = "/orders"
) -> requests.Response:
    sent = {"Content-Type": "application/json", **headers}
    if key is not None:
        sent["Idempotency-Key"] = key
    return requests.post(url + path, data=json.dumps(body), headers=sent, timeout=30)


def wire(reply: requests.Response) -> tuple[int, list[tuple[str, str]], bytes]:
    # Date and Server are gunicorn's, added to every answer; the rest is the app's.
    headers = [(k, v) for k, v in reply.raw.headers.items() if k.lower() not in ("date", "server")]
    return reply.status_code, headers, reply.content


def stampede(srv: DjangoGunicornServer, key: str, sku: str, n: int) -> list[requests.Response]:
    barrier = threading.Barrier(n)

    def one(_: int) -> requests.Response:
        barrier.wait(10)
        return post(srv.url, key, {"sku": sku, "qty": 1}, token("alice"))

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_a_stampede_of_50_identical_requests_runs_once_and_every_2xx_is_byte_identical(server):
    replies = stampede(server, "stampede-1", "stampede", 50)
    assert {r.status_code for r in replies} <= {201, 409}
    created = [wire(r) for r in replies if r.status_code == 201]
    assert created and created == [created[0]] * len(created)
    for reply in replies:
        if reply.status_code == 409:
            assert reply.json() == {"error": "idempotency_key_in_progress", "retry_after_ms": 30000}
    assert server.count_orders("stampede") == 1
    again = post(server.url, "stampede-1", {"sku": "stampede", "qty": 1}, token("alice"))
    assert wire(again) == created[0]


def test_workers_forked_from_a_preloaded_master_each_open_their_own_ledger(tmp_path):
    with DjangoGunicornServer(tmp_path, workers=4, preload=True) as srv:
        replies = stampede(srv, "preload-1", "preload", 20)
        created = [wire(r) for r in replies if r.status_code == 201]
        assert {r.status_code for r in replies} <= {201, 409}
        assert created and created == [created[0]] * len(created)
        assert srv.count_orders("preload") == 1


def test_drf_token_auth_resolves_the_principal_and_two_users_with_the_same_key_never_meet(server):
    alice = post(server.url, "shared-1", {"sku": "shared", "qty": 1}, token("alice"))
    bob = post(server.url, "shared-1", {"sku": "shared", "qty": 1}, token("bob"))
    assert (alice.status_code, alice.json()["account"]) == (201, "alice")
    assert (bob.status_code, bob.json()["account"]) == (201, "bob")
    assert alice.json()["id"] != bob.json()["id"] and server.count_orders("shared") == 2
    with server.ledger() as ledger:
        assert ledger.lookup(server.user_id("alice"), "shared-1").body_bytes == alice.content
        assert ledger.lookup(server.user_id("bob"), "shared-1").body_bytes == bob.content
    assert post(server.url, "shared-1", {"sku": "shared", "qty": 1}, token("bob")).content == bob.content


def test_anonymous_requests_are_401_and_claim_nothing(server):
    # DRF refuses before anything is claimed; the plain view gets the contract's 401.
    with server.ledger() as ledger:
        rows_before = ledger.operator.stats().total
    api = post(server.url, "anon-1", {"sku": "anon"}, {})
    session = requests.Session()
    csrf = session.get(server.url + "/session", timeout=10).json()["csrf"]
    browser = session.post(
        server.url + "/session/orders",
        data=json.dumps({"sku": "anon"}),
        headers={"Content-Type": "application/json", "Idempotency-Key": "anon-2", "X-CSRFToken": csrf},
        timeout=10,
    )
    assert (api.status_code, api.json()) == (401, {"detail": "Authentication credentials were not provided."})
    assert (browser.status_code, browser.json()) == (401, UNAUTHENTICATED)
    assert server.count_orders("anon") == 0
    with server.ledger() as ledger:
        assert ledger.operator.stats().total == rows_before


def test_a_signed_in_browser_creates_one_order_per_key_through_the_plain_view(server):
    session = requests.Session()
    csrf = session.get(server.url + "/session", timeout=10).json()["csrf"]
    signed_in = session.post(
        server.url + "/session",
        data=json.dumps({"username": "bob", "password": PASSWORD}),
        headers={"Content-Type": "application/json", "X-CSRFToken": csrf},
        timeout=10,
    )
    csrf = signed_in.json()["csrf"]  # signing in rotates it
    headers = {"Content-Type": "application/json", "Idempotency-Key": "web-1", "X-CSRFToken": csrf}
    first = session.post(server.url + "/session/orders", data=json.dumps({"sku": "web"}), headers=headers, timeout=10)
    again = session.post(server.url + "/session/orders", data=json.dumps({"sku": "web"}), headers=headers, timeout=10)
    assert (first.status_code, first.json()["account"], first.headers["location"]) == (
        201,
        "bob",
        f"/orders/{first.json()['id']}",
    )
    assert wire(again) == wire(first)
    assert server.count_orders("web") == 1
    with server.ledger() as ledger:
        assert ledger.lookup(server.user_id("bob"), "web-1").response_status == 201
