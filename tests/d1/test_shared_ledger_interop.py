"""idemctl and the recipe's Worker on one D1 database, on workerd.

An answer the Worker cannot replay: D1 hands a BLOB to a Worker as an array
of numbers, and the recipe's replay of one sends a 200 with something else
(the numbers as text, or an empty body). So idemctl stores a non-UTF-8 answer as the oversize
sentinel wherever the Worker reads the ledger: through d1:// (D1's HTTP API
carries no bytes anyway) and on the D1 database's local file. Every replay,
the Worker's and idemctl's, then fails loudly with a 500.

The lock window: on the local file, a write transaction of idemctl makes
the Worker's D1 calls fail at once (SQLITE_BUSY, a 500). idemctl's write
transactions there are bounded (a sweep batch at a time, with a pause
between batches): a request that meets one gets a 500, and its client's
retry goes through; a completion that meets one leaves its row pending,
so the retry gets 409 in_progress until the TTL passes
(docs/d1.md, "Sharing a local file with a Worker")."""

from __future__ import annotations

import json
import sqlite3
import threading
import time

import pytest

from idemctl import Ledger, Policy
from idemctl.fingerprint import fingerprint

from .runtime import Runtime

pytestmark = pytest.mark.slow

PAUSE_S = 0.02
BINARY = b"\xff\xfe\x00not utf-8\x80"


def worker_fingerprint(body: bytes) -> str:
    # What the recipe's Worker computes for Runtime.post("/orders", body).
    return fingerprint("POST", "/orders", {"content-type": "application/json"}, body)


def test_a_binary_answer_through_d1_is_stored_as_the_sentinel_and_the_worker_replays_a_500(runtime: Runtime) -> None:
    ledger = Ledger.open(runtime.ledger_url)
    ledger.init()
    body = b'{"n": 1}'
    reservation = ledger.claim("acct_1", "bin-1", worker_fingerprint(body))
    done = ledger.complete(reservation, 200, {"content-type": "application/octet-stream"}, BINARY)
    assert (done.stored, done.status, done.oversize) == (True, 500, True)
    row = ledger.operator.get("acct_1", "bin-1").row
    assert (row.response_status, row.response_body) == (500, None)
    status, _, replayed = runtime.post("/orders", body, key="bin-1")
    assert (status, replayed) == (500, b"")
    # idemctl's own replay of it: the not-stored answer, as for an oversize body.
    again = ledger.begin("acct_1", "bin-1", "POST", "/orders", {"content-type": "application/json"}, body)
    assert again.status == 500
    assert json.loads(again.body)["error"] == "idempotency_response_not_stored"
    ledger.close()


def test_on_the_d1_file_idemctl_stores_no_blob_the_worker_cannot_replay(runtime: Runtime) -> None:
    Ledger.open(runtime.ledger_url).init()
    ledger = Ledger.open(runtime.sqlite)  # the D1 database's own file, as wrangler dev keeps it
    body = b'{"n": 2}'
    reservation = ledger.claim("acct_1", "bin-2", worker_fingerprint(body))
    assert ledger.complete(reservation, 200, {}, BINARY).oversize
    with sqlite3.connect(runtime.sqlite) as conn:
        stored = conn.execute(
            "SELECT response_status, typeof(response_body) FROM idempotency_keys WHERE key = 'bin-2'"
        ).fetchall()
    assert stored == [(500, "null")]
    assert runtime.post("/orders", body, key="bin-2")[::2] == (500, b"")
    ledger.close()
    # A SQLite file that is not D1's keeps storing such an answer as a BLOB.


def test_a_blob_written_by_another_tool_is_what_breaks_the_workers_replay(runtime: Runtime) -> None:
    Ledger.open(runtime.ledger_url).init()
    body = b'{"n": 3}'
    with sqlite3.connect(runtime.sqlite) as conn:
        conn.execute(
            "INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, response_status,"
            " response_body, response_headers, created_at, updated_at)"
            " VALUES ('acct_1', 'bin-3', ?, 'completed', 1, 200, ?, '{}', 1796000000000, ?)",
            (worker_fingerprint(body), BINARY, int(time.time() * 1000)),
        )
    status, _, replayed = runtime.post("/orders", body, key="bin-3")
    # The defect idemctl avoids: the recipe answers 200 with something else
    # than the answer (this workerd: the byte values as decimal text; others
    # fail inside the Response and send an empty body).
    assert status == 200
    assert replayed in (b"", ",".join(str(b) for b in BINARY).encode())


def test_a_sweep_of_the_d1_file_blocks_the_worker_only_a_batch_at_a_time(runtime: Runtime) -> None:
    Ledger.open(runtime.ledger_url).init()
    now = int(time.time() * 1000)
    backlog = 20_000
    with sqlite3.connect(runtime.sqlite) as conn:
        conn.executemany(
            "INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, response_status,"
            " response_body, response_headers, created_at, updated_at)"
            " VALUES ('acct_old', ?, 'fp', 'completed', 1, 201, 'x', '{}', ?, ?)",
            [(f"old-{i}", now - 7200_000 + i, now - 7200_000 + i) for i in range(backlog)],
        )
    outcomes: dict[str, list[int]] = {}
    bodies: set[bytes] = set()
    stop = threading.Event()

    def traffic() -> None:
        n = 0
        while not stop.is_set():
            key = f"live-{n}"
            for _ in range(20):  # the client retries a 500 (a request the lock refused)
                status, _, body = runtime.post("/orders", b"{}", key=key)
                outcomes.setdefault(key, []).append(status)
                if status != 500:
                    break
                bodies.add(body[:200])
                time.sleep(0.05)
            n += 1

    ledger = Ledger.open(runtime.sqlite, policy=Policy(retention_ms=3600_000))
    thread = threading.Thread(target=traffic, daemon=True)
    thread.start()
    held = []
    try:
        while True:
            started = time.perf_counter()
            result = ledger.operator.sweep(batch=ledger.operator.drain_batch)
            held.append(time.perf_counter() - started)
            if result.keys_deleted == 0:
                break
            time.sleep(PAUSE_S)  # `idemctl sweep --pause`: the Worker's turn between batches
    finally:
        stop.set()
        thread.join(timeout=60)
        ledger.close()
    with sqlite3.connect(runtime.sqlite) as conn:
        left = conn.execute("SELECT count(*) FROM idempotency_keys WHERE principal = 'acct_old'").fetchone()[0]
    assert left == 0
    assert len(held) >= backlog // 250
    # Each batch holds the lock for a bounded time (250 rows), not the backlog's.
    assert max(held) < 2.0, held
    assert outcomes
    # What the Worker's clients see meanwhile: 201; a 500 when a statement
    # met the lock (D1 does not wait for it); after a 500, a 409
    # in_progress when it was the completion that met it: the row stays
    # pending until the TTL, and then a takeover runs the mutation again.
    for key, statuses in outcomes.items():
        assert set(statuses) <= {201, 500, 409}, (key, statuses)
        assert statuses[-1] in (201, 409), (key, statuses)
        if statuses[-1] == 409:
            assert statuses[0] == 500, (key, statuses)
    assert all(b"D1_ERROR" in body for body in bodies), bodies
    assert any(b"SQLITE_BUSY" in body for body in bodies), bodies
    finished = [key for key, statuses in outcomes.items() if statuses[-1] == 201]
    for key in finished[:5]:  # its retry replays: it ran once
        assert runtime.post("/orders", b"{}", key=key)[0] == 201
