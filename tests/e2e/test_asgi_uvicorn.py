"""End to end: the FastAPI orders example under a real `uvicorn --workers 4`,
driven over HTTP with httpx."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.uvicorn_server import UvicornServer

# The module's servers are started once: its tests stay on one worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_asgi_uvicorn")]

ORDER = json.dumps({"sku": "tea", "qty": 2}, separators=(",", ":")).encode()
A = {"X-Api-Key": "demo-key-A", "Content-Type": "application/json"}


def post(
    url: str, key: str | None, body: bytes = ORDER, headers: dict[str, str] = A, path: str = "/orders"
) -> httpx.Response:
    sent = dict(headers)
    if key is not None:
        sent["Idempotency-Key"] = key
    return httpx.post(url + path, content=body, headers=sent, timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    with UvicornServer(tmp_path_factory.mktemp("uvicorn"), workers=4) as srv:
        yield srv


def wire(reply: httpx.Response) -> tuple[int, list[tuple[str, str]], bytes]:
    # Date and Server are the server's, added to every answer; the rest is idemctl's.
    headers = [(k, v) for k, v in reply.headers.multi_items() if k not in ("date", "server")]
    return reply.status_code, headers, reply.content


def test_a_stampede_of_50_identical_requests_runs_the_mutation_once(server):
    sku = "stampede"
    body = json.dumps({"sku": sku, "qty": 1}).encode()
    barrier = threading.Barrier(50)

    def one(_: int) -> httpx.Response:
        barrier.wait(10)
        return post(server.url, "stampede-1", body)

    with ThreadPoolExecutor(50) as pool:
        replies = list(pool.map(one, range(50)))
    statuses = sorted({r.status_code for r in replies})
    assert set(statuses) <= {201, 409}
    created = [wire(r) for r in replies if r.status_code == 201]
    assert created and all(c == created[0] for c in created)
    for r in replies:
        if r.status_code == 409:
            assert r.json() == {"error": "idempotency_key_in_progress", "retry_after_ms": 30000}
    assert server.count_orders(sku) == 1
    again = post(server.url, "stampede-1", body)
    assert wire(again) == created[0]


def test_the_contract_statuses_over_http(server):
    assert (post(server.url, None).status_code, post(server.url, None).json()) == (
        400,
        {"error": "idempotency_key_required"},
    )
    bad = post(server.url, "k", headers={"X-Api-Key": "nope", "Content-Type": "application/json"})
    assert (bad.status_code, bad.json()["error"]) == (401, "unauthenticated")
    first = post(server.url, "statuses-1")
    assert first.status_code == 201 and first.headers["location"] == f"/orders/{first.json()['id']}"
    reused = post(server.url, "statuses-1", json.dumps({"sku": "coffee", "qty": 1}).encode())
    assert (reused.status_code, reused.content) == (409, b'{"error":"idempotency_key_reused"}')
    # FastAPI's own validation runs first: a 422 claims nothing, the fixed retry runs.
    invalid = post(server.url, "statuses-2", b'{"sku":"","qty":0}')
    assert invalid.status_code == 422
    with server.ledger() as ledger:
        assert ledger.operator.get("acct_A", "statuses-2") is None
    assert post(server.url, "statuses-2").status_code == 201


def test_a_streamed_answer_and_a_binary_body_replay_byte_for_byte(server):
    streamed = post(server.url, "stream-1", b"", path="/stream")
    expected = b"".join(bytes([i, 0xFF, 0x00]) * 100 for i in range(5))
    assert (streamed.status_code, streamed.content) == (201, expected)
    assert wire(post(server.url, "stream-1", b"", path="/stream")) == wire(streamed)

    order = post(server.url, "binary-order").json()["id"]
    blob = bytes(range(256)) * 4
    headers = {"X-Api-Key": "demo-key-A", "Content-Type": "application/octet-stream"}
    first = post(server.url, "binary-1", blob, headers=headers, path=f"/orders/{order}/attachments")
    again = post(server.url, "binary-1", blob, headers=headers, path=f"/orders/{order}/attachments")
    assert (first.status_code, first.content) == (201, blob)
    assert wire(again) == wire(first)


def test_a_client_that_leaves_mid_mutation_gets_the_replay_when_it_retries(server):
    key = "leaves-1"
    server.hold(key)
    raw = socket.create_connection(("127.0.0.1", server.port))
    request = (
        f"POST /orders HTTP/1.1\r\nHost: x\r\nX-Api-Key: demo-key-A\r\nIdempotency-Key: {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(ORDER)}\r\n\r\n"
    ).encode() + ORDER
    raw.sendall(request)
    pid = server.held_pid(key)
    raw.close()  # the client gives up while the mutation runs
    time.sleep(0.2)
    server.release(key, pid)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        retry = post(server.url, key)
        if retry.status_code != 409:
            break
        time.sleep(0.05)
    assert retry.status_code == 201
    assert post(server.url, key).content == retry.content
    with server.ledger() as ledger:
        row = ledger.operator.get("acct_A", key).row
    assert (row.status.value, row.generation) == ("completed", 1)


def test_a_killed_worker_leaves_409_until_the_ttl_then_one_takeover(tmp_path):
    with UvicornServer(tmp_path, workers=2, pending_ttl="2s") as srv:
        key, sku = "killed-1", "killed"
        body = json.dumps({"sku": sku, "qty": 1}).encode()
        srv.hold(key)
        threading.Thread(target=lambda: _ignore(lambda: post(srv.url, key, body)), daemon=True).start()
        pid = srv.held_pid(key)
        os.kill(pid, signal.SIGKILL)
        early = post(srv.url, key, body)
        assert (early.status_code, early.headers["retry-after"]) == (409, "2")
        time.sleep(2.2)
        taken = post(srv.url, key, body)
        assert taken.status_code == 201
        assert post(srv.url, key, body).content == taken.content
        assert srv.count_orders(sku) == 1
        with srv.ledger() as ledger:
            assert ledger.operator.get("acct_A", key).row.generation == 2


def test_the_event_loop_answers_while_another_process_holds_the_ledger_lock(tmp_path):
    """A protected request waits for the SQLite write lock in a worker
    thread; an unprotected GET on the same single worker is answered while
    the lock is still held (it would wait behind the lock if the loop did)."""
    with UvicornServer(tmp_path, workers=1, env={"IDEMCTL_BUSY_TIMEOUT": "5s"}) as srv:
        holder = sqlite3.connect(srv.ledger_path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        released = threading.Event()
        blocked: list[httpx.Response] = []
        writer = threading.Thread(target=lambda: blocked.append(post(srv.url, "locked-1")))
        writer.start()
        try:
            time.sleep(0.3)  # the POST is now waiting for the lock in a thread
            got = httpx.get(srv.url + "/orders", headers=A, timeout=10)
            answered_while_locked = not released.is_set() and not blocked
        finally:
            released.set()
            holder.execute("ROLLBACK")
            holder.close()
            writer.join(20)
        assert got.status_code == 200 and answered_while_locked
        assert blocked[0].status_code == 201  # it went through once the lock was free


def test_a_locked_ledger_fails_closed_with_503(tmp_path):
    with UvicornServer(tmp_path, workers=1, env={"IDEMCTL_BUSY_TIMEOUT": "200ms"}) as srv:
        holder = sqlite3.connect(srv.ledger_path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            reply = post(srv.url, "unavailable-1")
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert (reply.status_code, reply.headers["retry-after"], reply.json()["error"]) == (
            503,
            "1",
            "idempotency_ledger_unavailable",
        )
        assert srv.count_orders("tea") == 0


def _ignore(fn):  # type: ignore[no-untyped-def]
    try:
        fn()
    except httpx.HTTPError:
        pass


def test_the_example_serves_a_postgresql_ledger_across_workers(tmp_path, postgres_server, monkeypatch):
    from tests.helpers import postgres_test_schema

    for url in postgres_test_schema(postgres_server, monkeypatch):
        with UvicornServer(tmp_path, workers=2, env={"IDEMCTL_DB": url}) as srv:
            body = json.dumps({"sku": "pg-stampede", "qty": 1}).encode()
            with ThreadPoolExecutor(20) as pool:
                replies = list(pool.map(lambda _: post(srv.url, "pg-1", body), range(20)))
            created = [wire(r) for r in replies if r.status_code == 201]
            assert {r.status_code for r in replies} <= {201, 409} and created
            assert all(c == created[0] for c in created)
            assert srv.count_orders("pg-stampede") == 1
