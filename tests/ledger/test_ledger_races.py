"""Concurrency claims, proven with real OS processes and threads on one real
database: each key's mutation runs exactly once."""

from __future__ import annotations

import collections
import multiprocessing as mp
import random
import sqlite3
import threading

import pytest

from idemctl import Ledger, Outcome, fingerprint, wall_clock_ms

# The PostgreSQL tests run through PgBouncer (session and transaction pooling) too.
THROUGH_PGBOUNCER = True

PROCESSES = 8
KEYS = 200
HEADERS = {"Content-Type": "application/json"}


def _effects_db(path: str) -> None:
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE IF NOT EXISTS effects (key TEXT NOT NULL, pid INTEGER NOT NULL)")
    conn.commit()
    conn.close()


def _record_effect(effects_path: str, key: str, pid: int) -> None:
    # The side effect lives in its own database, as a real mutation's would.
    conn = sqlite3.connect(effects_path, timeout=60, isolation_level=None)
    conn.execute("INSERT INTO effects VALUES (?, ?)", (key, pid))
    conn.close()


def _claim_racer(target: str, effects_path: str, keys: list[str], seed: int, start, results) -> None:
    import os

    ledger = Ledger.open(target, synchronous="NORMAL")
    order = list(keys)
    random.Random(seed).shuffle(order)
    pid = os.getpid()
    counts: collections.Counter[str] = collections.Counter()
    start.wait(60)
    for key in order:
        body = f'{{"order":"{key}"}}'.encode()

        def mutate(b: bytes, key: str = key) -> tuple[int, dict[str, str], bytes]:
            _record_effect(effects_path, key, pid)
            return 201, {"Content-Type": "application/json"}, b'{"created":"' + key.encode() + b'"}'

        try:
            answer = ledger.handle("acct_race", key, "POST", "/orders", HEADERS, body, mutate)
        except Exception as exc:  # any error at all is a failure of the claim
            counts[f"error:{type(exc).__name__}:{exc}"] += 1
            continue
        counts[f"{answer.outcome.value}:{answer.status}"] += 1
        if answer.status == 201 and answer.body != b'{"created":"' + key.encode() + b'"}':
            counts["wrong-body"] += 1
    ledger.close()
    results.put(dict(counts))


def _takeover_racer(target: str, effects_path: str, key: str, start, results) -> None:
    import os

    ledger = Ledger.open(target, synchronous="NORMAL")
    pid = os.getpid()
    start.wait(60)

    def mutate(b: bytes) -> tuple[int, dict[str, str], bytes]:
        _record_effect(effects_path, key, pid)
        return 201, {}, b"taken"

    try:
        answer = ledger.handle("acct_race", key, "POST", "/orders", HEADERS, b"{}", mutate)
        results.put((answer.outcome.value, answer.status, answer.generation))
    except Exception as exc:
        results.put(("error", repr(exc), None))
    ledger.close()


@pytest.mark.slow
def test_eight_processes_racing_on_200_keys_run_each_mutation_exactly_once(ledger_target, ledger, tmp_path):
    effects = str(tmp_path / "effects.db")
    _effects_db(effects)
    keys = [f"order-{i:03d}" for i in range(KEYS)]
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_claim_racer, args=(ledger_target, effects, keys, seed, start, results))
        for seed in range(PROCESSES)
    ]
    for p in procs:
        p.start()
    start.set()
    totals: collections.Counter[str] = collections.Counter()
    for _ in procs:
        totals.update(results.get(timeout=240))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0

    conn = sqlite3.connect(effects)
    per_key = dict(conn.execute("SELECT key, count(*) FROM effects GROUP BY key").fetchall())
    conn.close()
    assert per_key == {k: 1 for k in keys}
    # Nothing but executions, replays and in-progress 409s.
    assert set(totals) <= {"executed:201", "replayed:201", "in_progress:409"}, totals
    assert totals["executed:201"] == KEYS
    assert sum(totals.values()) == KEYS * PROCESSES
    stats = ledger.stats()
    assert (stats.total, stats.completed, stats.taken_over) == (KEYS, KEYS, 0)


@pytest.mark.slow
def test_processes_finding_the_same_stale_row_exactly_one_takes_over_as_generation_2(ledger_target, ledger, tmp_path):
    effects = str(tmp_path / "effects.db")
    _effects_db(effects)
    key = "stale-order"
    # A reservation whose worker died a minute ago.
    ledger.claim("acct_race", key, fingerprint("POST", "/orders", HEADERS, b"{}"), now=wall_clock_ms() - 60_000)
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    results = ctx.Queue()
    procs = [ctx.Process(target=_takeover_racer, args=(ledger_target, effects, key, start, results)) for _ in range(6)]
    for p in procs:
        p.start()
    start.set()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    winners = [o for o in outcomes if o[0] == Outcome.TAKEN_OVER.value]
    assert winners == [(Outcome.TAKEN_OVER.value, 201, 2)]
    losers = sorted(o[:2] for o in outcomes if o not in winners)
    assert all(o in (("in_progress", 409), ("replayed", 201)) for o in losers), outcomes
    conn = sqlite3.connect(effects)
    assert conn.execute("SELECT count(*) FROM effects").fetchone()[0] == 1
    conn.close()
    row = ledger.lookup("acct_race", key)
    assert (row.generation, row.status.value, row.response_body) == (2, "completed", "taken")


def test_sixteen_threads_on_one_key_run_the_mutation_once(ledger):
    barrier = threading.Barrier(16)
    calls = []
    lock = threading.Lock()
    outcomes = []

    def mutate(b):
        with lock:
            calls.append(b)
        return 201, {}, b"once"

    def worker():
        barrier.wait()
        a = ledger.handle("acct", "same", "POST", "/orders", {}, b"x", mutate)
        with lock:
            outcomes.append((a.outcome, a.status))

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(calls) == 1
    assert outcomes.count((Outcome.EXECUTED, 201)) == 1
    assert all(o in ((Outcome.EXECUTED, 201), (Outcome.REPLAYED, 201), (Outcome.IN_PROGRESS, 409)) for o in outcomes)
