"""End to end: examples/flask_app.py behind IdempotencyMiddleware, served by a
real gunicorn (pre-forked sync workers, and threaded workers) on 127.0.0.1,
driven over real HTTP. Side effects are counted in the example's own orders
database; worker crashes and stalls are real SIGKILLs and real waits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from idemctl import State, Status
from tests.e2e.gunicorn_server import GunicornServer

# The module's servers are started once: its tests stay on one worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_wsgi_gunicorn")]

ACCOUNT_A = {"X-Api-Key": "demo-key-A"}
ACCOUNT_B = {"X-Api-Key": "demo-key-B"}
# What differs between two byte-identical answers: when and by whom they were sent.
TRANSPORT_HEADERS = {"date", "server", "connection"}
MAX_BODY = 65_536


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> GunicornServer:
    """Long TTL, 4 pre-forked sync workers; the ledger is opened in the master
    before the fork (--preload), so every worker must open its own connections."""
    with GunicornServer(
        tmp_path_factory.mktemp("gunicorn-sync"),
        workers=4,
        preload=True,
        env={"ORDERS_MAX_BODY_BYTES": str(MAX_BODY)},
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def threaded_server(tmp_path_factory) -> GunicornServer:
    """Long TTL, 2 worker processes with 8 threads each."""
    with GunicornServer(tmp_path_factory.mktemp("gunicorn-threads"), workers=2, threads=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def short_ttl_server(tmp_path_factory) -> GunicornServer:
    """A 2 s pending TTL, so takeovers happen within a test."""
    with GunicornServer(tmp_path_factory.mktemp("gunicorn-short-ttl"), workers=3, pending_ttl_ms=2000) as srv:
        yield srv


def post_order(srv: GunicornServer, key: str, sku: str, *, qty: int = 1, account=ACCOUNT_A, timeout: float = 30):
    return requests.post(
        srv.url + "/orders",
        data=json.dumps({"sku": sku, "qty": qty}, separators=(",", ":")),
        headers={**account, "Idempotency-Key": key, "Content-Type": "application/json"},
        timeout=timeout,
    )


def wire(response: requests.Response) -> tuple:
    """Everything of an answer a client can see, less the transport headers."""
    headers = [(k, v) for k, v in response.raw.headers.items() if k.lower() not in TRANSPORT_HEADERS]
    return response.status_code, response.reason, headers, response.content


def wait_until_stale(srv: GunicornServer, principal: str, key: str) -> None:
    with srv.ledger() as ledger:
        view = ledger.operator.get(principal, key)
        assert view is not None and view.row.status is Status.PENDING
        assert view.takeover_in_ms is not None
        time.sleep(view.takeover_in_ms / 1000 + 0.05)
        assert ledger.operator.get(principal, key).state is State.PENDING_STALE


def idemctl_inspect(srv: GunicornServer, key: str, principal: str) -> dict:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "idemctl",
            "inspect",
            key,
            "--principal",
            principal,
            "--db",
            str(srv.ledger_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("which", ["server", "threaded_server"], ids=["sync-workers", "threaded-workers"])
def test_fifty_concurrent_requests_with_one_key_run_the_mutation_once_and_agree(request, which):
    srv: GunicornServer = request.getfixturevalue(which)
    key, sku = f"concurrent-{which}", f"sku-concurrent-{which}"
    srv.hold(key)  # the one attempt that owns the key stalls until the first 409 is in
    results: list[requests.Response] = []
    lock = threading.Lock()
    start = threading.Barrier(50)

    def client() -> None:
        start.wait(30)
        response = post_order(srv, key, sku)
        with lock:
            results.append(response)

    with ThreadPoolExecutor(50) as pool:
        futures = [pool.submit(client) for _ in range(50)]
        owner = srv.held_pid(key)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with lock:
                conflicts = sum(r.status_code == 409 for r in results)
            if conflicts >= 1:
                break
            time.sleep(0.01)
        srv.release(key, owner)
        for f in futures:
            f.result(60)

    late_retry = post_order(srv, key, sku)
    assert srv.count_orders(sku) == 1
    ok = [r for r in results if 200 <= r.status_code < 300]
    busy = [r for r in results if r.status_code == 409]
    assert len(ok) + len(busy) == 50
    assert len(ok) >= 1 and len(busy) >= 1
    ok.append(late_retry)
    first = wire(ok[0])
    assert first[0:2] == (201, "Created")
    assert all(wire(r) == first for r in ok)
    assert json.loads(first[3])["sku"] == sku
    for r in busy:
        assert r.headers["Retry-After"] == "30"
        assert r.headers["Content-Type"] == "application/json"
        assert r.content == b'{"error":"idempotency_key_in_progress","retry_after_ms":30000}'


def test_a_worker_killed_mid_mutation_is_taken_over_as_generation_2_after_the_ttl(short_ttl_server):
    srv = short_ttl_server
    key, sku = "killed-1", "sku-killed"
    srv.hold(key)
    outcome: dict = {}

    def doomed() -> None:
        try:
            outcome["response"] = post_order(srv, key, sku)
        except requests.ConnectionError as exc:
            outcome["error"] = exc

    first = threading.Thread(target=doomed)
    first.start()
    os.kill(srv.held_pid(key), signal.SIGKILL)
    first.join(30)
    assert "error" in outcome, "the client of the killed worker got no answer"

    retry = post_order(srv, key, sku)
    assert (retry.status_code, retry.headers["Retry-After"]) == (409, "2")
    assert retry.content == b'{"error":"idempotency_key_in_progress","retry_after_ms":2000}'
    assert srv.count_orders(sku) == 0

    wait_until_stale(srv, "acct_A", key)
    taken_over = post_order(srv, key, sku)
    assert taken_over.status_code == 201
    assert srv.count_orders(sku) == 1
    replay = post_order(srv, key, sku)
    assert wire(replay) == wire(taken_over)
    assert srv.count_orders(sku) == 1

    with srv.ledger() as ledger:
        view = ledger.operator.get("acct_A", key)
    assert (view.row.status, view.row.generation) == (Status.COMPLETED, 2)
    assert view.row.body_bytes == taken_over.content

    shown = idemctl_inspect(srv, key, "acct_A")
    assert (shown["status"], shown["generation"], shown["takeovers"]) == ("completed", 2, 1)
    assert shown["response"]["status"] == 201
    assert shown["response"]["body"] == taken_over.text
    assert shown["fenced_out"] == []


def test_a_stalled_worker_that_finishes_after_a_takeover_is_fenced_out_and_replays_serve_the_new_owner(
    short_ttl_server,
):
    srv = short_ttl_server
    key, sku = "stalled-1", "sku-stalled"
    srv.hold(key)
    late: dict = {}
    first = threading.Thread(target=lambda: late.setdefault("response", post_order(srv, key, sku)))
    first.start()
    stalled_pid = srv.held_pid(key)

    wait_until_stale(srv, "acct_A", key)
    new_owner = post_order(srv, key, sku)
    assert new_owner.status_code == 201

    srv.release(key, stalled_pid)  # the old owner wakes up and completes too late
    first.join(30)
    stale_answer = late["response"]
    # It still answers its own client with what it computed: a second order.
    assert stale_answer.status_code == 201
    assert stale_answer.json()["id"] != new_owner.json()["id"]
    assert srv.count_orders(sku) == 2

    replay = post_order(srv, key, sku)
    assert wire(replay) == wire(new_owner)
    with srv.ledger() as ledger:
        view = ledger.operator.get("acct_A", key)
        events = list(ledger.operator.fenced(principal="acct_A", key=key))
    assert (view.row.status, view.row.generation) == (Status.COMPLETED, 2)
    assert view.row.body_bytes == new_owner.content
    assert [(e.superseded_generation, e.current_generation, e.computed_status) for e in events] == [(1, 2, 201)]

    shown = idemctl_inspect(srv, key, "acct_A")
    assert shown["generation"] == 2
    assert [(e["superseded_generation"], e["current_generation"]) for e in shown["fenced_out"]] == [(1, 2)]


def test_same_key_with_a_different_body_is_409_reused(server):
    first = post_order(server, "reuse-1", "sku-reuse")
    assert first.status_code == 201
    other = post_order(server, "reuse-1", "sku-reuse", qty=2)
    assert other.status_code == 409
    assert other.content == b'{"error":"idempotency_key_reused"}'
    assert server.count_orders("sku-reuse") == 1


def test_two_principals_with_the_same_key_are_independent(server):
    a = post_order(server, "shared-key", "sku-principals", account=ACCOUNT_A)
    b = post_order(server, "shared-key", "sku-principals", account=ACCOUNT_B)
    assert (a.status_code, b.status_code) == (201, 201)
    assert (a.json()["account"], b.json()["account"]) == ("acct_A", "acct_B")
    assert a.json()["id"] != b.json()["id"]
    assert server.count_orders("sku-principals") == 2
    assert wire(post_order(server, "shared-key", "sku-principals", account=ACCOUNT_B)) == wire(b)
    assert wire(post_order(server, "shared-key", "sku-principals", account=ACCOUNT_A)) == wire(a)


def test_binary_request_and_response_bodies_round_trip_byte_for_byte(server):
    order = post_order(server, "bin-order", "sku-binary").json()
    blob = bytes(range(256)) * 16 + b"\xff\xfe\xc3\x28"
    headers = {**ACCOUNT_A, "Idempotency-Key": "bin-attach", "Content-Type": "application/octet-stream"}
    url = f"{server.url}/orders/{order['id']}/attachments"
    first = requests.post(url, data=blob, headers=headers, timeout=30)
    retry = requests.post(url, data=blob, headers=headers, timeout=30)
    assert first.status_code == 201 and first.content == blob
    assert first.headers["Content-Type"] == "application/octet-stream"
    assert wire(retry) == wire(first)
    assert server.count_attachments(order["id"]) == 1


def test_a_chunked_upload_is_read_to_the_end_and_replayed(server):
    order = post_order(server, "chunked-order", "sku-chunked").json()
    pieces = [b"\x00\x01piece-%d" % i for i in range(40)]
    headers = {**ACCOUNT_A, "Idempotency-Key": "chunked-attach", "Content-Type": "application/octet-stream"}
    url = f"{server.url}/orders/{order['id']}/attachments"
    first = requests.post(url, data=iter(pieces), headers=headers, timeout=30)  # Transfer-Encoding: chunked
    retry = requests.post(url, data=iter(pieces), headers=headers, timeout=30)
    assert first.status_code == 201 and first.content == b"".join(pieces)
    assert wire(retry) == wire(first)
    assert server.count_attachments(order["id"]) == 1


def test_a_204_and_its_replay_have_no_body(server):
    order = post_order(server, "to-cancel", "sku-cancel").json()
    headers = {**ACCOUNT_A, "Idempotency-Key": "cancel-1"}
    first = requests.delete(f"{server.url}/orders/{order['id']}", headers=headers, timeout=30)
    retry = requests.delete(f"{server.url}/orders/{order['id']}", headers=headers, timeout=30)
    assert wire(first) == (204, "No Content", [], b"")
    assert wire(retry) == wire(first)
    current = requests.get(f"{server.url}/orders/{order['id']}", headers=ACCOUNT_A, timeout=30)
    assert current.json()["status"] == "cancelled"


def test_a_body_over_the_limit_is_413_and_nothing_is_claimed(server):
    response = requests.post(
        server.url + "/orders",
        data=b"{" + b" " * MAX_BODY + b"}",
        headers={**ACCOUNT_A, "Idempotency-Key": "too-big", "Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 413
    assert response.json()["limit_bytes"] == MAX_BODY
    with server.ledger() as ledger:
        assert ledger.operator.get("acct_A", "too-big") is None


def test_an_unknown_api_key_is_401_and_a_missing_idempotency_key_is_400(server):
    anonymous = requests.post(
        server.url + "/orders", json={"sku": "x"}, headers={"Idempotency-Key": "anon-1"}, timeout=30
    )
    assert anonymous.status_code == 401 and anonymous.json()["error"] == "unauthenticated"
    keyless = requests.post(server.url + "/orders", json={"sku": "x"}, headers=ACCOUNT_A, timeout=30)
    assert (keyless.status_code, keyless.content) == (400, b'{"error":"idempotency_key_required"}')
    assert server.count_orders("x") == 0


def test_reads_pass_through_without_a_key(server):
    created = post_order(server, "read-1", "sku-read").json()
    listing = requests.get(server.url + "/orders", headers=ACCOUNT_A, timeout=30)
    assert listing.status_code == 200
    assert created in listing.json()["orders"]
