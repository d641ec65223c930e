"""(9) Group commit: 1, 4, 16 and 32 threads of one process, each claiming
and completing distinct keys as fast as it can, under `synchronous=FULL`,
with and without `group_commit`, at two levels:

- ledger: `Ledger.claim`, then `Ledger.complete` storing 1 KiB (the two
  write statements of a request, with idemctl's Python around them);
- engine: the floor's own statement pair sent through the ledger's engine
  (`engine.write`), which is what group commit itself changes, with next to
  no Python per request.

Floor: the raw statement pair (claim + fenced completion) on one thread, one
plain connection, measured in every round; every throughput is a multiple of
the floor of its own round. Rounds alternate which mode goes first. Reported
per level, thread count and mode: pairs/s ÷ floor, latency of a pair
(p50/p99/max over all rounds, and p99 per round), and for group commit the
mean number of statements per commit."""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from idemctl import Ledger
from idemctl.storage.sqlite import SqliteEngine

from .common import (
    FINGERPRINT,
    HEADERS,
    RAW_CLAIM,
    RAW_COMPLETE,
    RESPONSE_HEADERS_JSON,
    STORED_1K,
    Context,
    create_schema,
    latency_summary,
    now_ms,
    percentile,
    raw_connect,
    raw_pair,
    spread,
)

THREADS = (1, 4, 16, 32)
LEVELS = ("engine", "ledger")
STORED_TEXT = STORED_1K.decode()


def floor(path: str, seconds: float) -> float:
    """Raw pairs/s on one thread: the single-thread per-request floor."""
    create_schema(path)
    conn = raw_connect(path, "FULL")
    n = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while time.perf_counter() < deadline:
        raw_pair(conn, "acct_floor", f"k{n}", now_ms())
        n += 1
    elapsed = time.perf_counter() - t0
    conn.close()
    return n / elapsed


def measure(
    path: str, level: str, threads: int, group_commit: bool, seconds: float, synchronous: str = "FULL"
) -> dict[str, Any]:
    with Ledger.open(path) as setup:
        setup.init()
    ledger = Ledger.open(path, synchronous=synchronous, group_commit=group_commit)
    engine = ledger.store.engine
    assert isinstance(engine, SqliteEngine)
    latencies: list[list[float]] = [[] for _ in range(threads)]
    errors: dict[str, int] = {}
    start = threading.Barrier(threads + 1)
    window: dict[str, float] = {}

    def ledger_pair(key: str) -> None:
        reservation = ledger.claim("acct_bench", key, FINGERPRINT)
        assert reservation is not None
        ledger.complete(reservation, 201, HEADERS, STORED_1K)

    def engine_pair(key: str) -> None:
        # raw_pair's statements and parameters, through the engine.
        now = now_ms()
        row = {"principal": "acct_bench", "key": key, "token": now}
        gen = engine.write(RAW_CLAIM, {**row, "fingerprint": FINGERPRINT, "now": now})[0][0]
        done = {"generation": gen, "status": 201, "body": STORED_TEXT, "headers": RESPONSE_HEADERS_JSON, "now": now + 1}
        engine.write(RAW_COMPLETE, {**row, **done})

    pair = ledger_pair if level == "ledger" else engine_pair

    def work(i: int) -> None:
        own = latencies[i]
        clock = time.perf_counter
        start.wait()
        deadline = window["deadline"]
        n = 0
        while True:
            t0 = clock()
            if t0 >= deadline:
                break
            try:
                pair(f"t{i}-{n}")
            except Exception as exc:  # counted, never hidden
                name = type(exc).__name__
                errors[name] = errors.get(name, 0) + 1
            own.append(clock() - t0)
            n += 1

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    window["deadline"] = time.perf_counter() + seconds
    start.wait()
    t_start = time.perf_counter()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - t_start
    ledger.close()
    flat = [v for own in latencies for v in own]
    return {
        "pairs": len(flat),
        "pairs_per_s": len(flat) / elapsed,
        "latencies": flat,
        "errors": errors,
        "batches": engine.batches_committed if group_commit else None,
        "statements": engine.statements_committed if group_commit else None,
    }


def run(ctx: Context) -> dict[str, Any]:
    rounds = ctx.size(5, 1)
    seconds = 1.0 if not ctx.quick else 0.15
    floors: list[float] = []
    keys = [(level, t, g) for level in LEVELS for t in THREADS for g in (False, True)]
    raw: dict[tuple[str, int, bool], list[dict[str, Any]]] = {k: [] for k in keys}
    ceiling: dict[int, list[float]] = {1: [], THREADS[-1]: []}
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for threads in THREADS:
            # A floor next to each thread count: the disk's speed drifts
            # within a round (not least with the writeback of the last run).
            f = floor(ctx.path("group-commit-floor.db"), seconds)
            floors.append(f)
            for level in LEVELS:
                for group_commit in order:
                    path = ctx.path(f"group-commit-{level}-{threads}-{int(group_commit)}.db")
                    res = measure(path, level, threads, group_commit, seconds)
                    res["floor"] = f
                    raw[(level, threads, group_commit)].append(res)
                    batch = f", mean batch {res['statements'] / max(1, res['batches']):.1f}" if group_commit else ""
                    ctx.log(
                        f"  group commit {'on ' if group_commit else 'off'} {level} x{threads} round {r + 1}: "
                        f"{res['pairs_per_s']:.0f} pairs/s = {res['pairs_per_s'] / f:.2f}× floor ({f:.0f}/s), "
                        f"p99 {percentile(sorted(res['latencies']), 99) * 1000:.1f} ms{batch}"
                    )
        # What the ledger's Python alone allows, with no fsync to wait for.
        for threads in ceiling:
            path = ctx.path(f"group-commit-ceiling-{threads}.db")
            ceiling[threads].append(measure(path, "ledger", threads, False, seconds, "OFF")["pairs_per_s"])
    per_round = len(THREADS)
    round_floors = [statistics.median(floors[i : i + per_round]) for i in range(0, len(floors), per_round)]
    configs = []
    for level, threads, group_commit in keys:
        runs = raw[(level, threads, group_commit)]
        errors: dict[str, int] = {}
        for x in runs:
            for name, count in x["errors"].items():
                errors[name] = errors.get(name, 0) + count
        entry: dict[str, Any] = {
            "level": level,
            "threads": threads,
            "group_commit": group_commit,
            "pairs_per_s": spread([x["pairs_per_s"] for x in runs], 1),
            "ratio_to_floor": spread([x["pairs_per_s"] / x["floor"] for x in runs]),
            "latency": latency_summary([v for x in runs for v in x["latencies"]]),
            "p99_ms_per_round": spread([percentile(sorted(x["latencies"]), 99) * 1000 for x in runs]),
            "errors": errors,
            "error_count": sum(errors.values()),
        }
        if group_commit:
            off = raw[(level, threads, False)]
            entry["statements_per_commit"] = round(
                sum(x["statements"] for x in runs) / max(1, sum(x["batches"] for x in runs)), 2
            )
            entry["ratio_to_off"] = spread([on["pairs_per_s"] / o["pairs_per_s"] for on, o in zip(runs, off)])
            entry["p99_ratio_to_off"] = spread(
                [
                    percentile(sorted(on["latencies"]), 99) / percentile(sorted(o["latencies"]), 99)
                    for on, o in zip(runs, off)
                ]
            )
        configs.append(entry)
    return {
        "rounds": rounds,
        "seconds_per_config": seconds,
        "synchronous": "FULL",
        "floor_pairs_per_s": spread(floors, 1),
        "configs": configs,
        # synchronous=OFF, no group commit; divided by the median floor of the same round.
        "ledger_ceiling_off": [
            {
                "threads": t,
                "pairs_per_s": spread(v, 1),
                "ratio_to_floor": spread([x / f for x, f in zip(v, round_floors)]),
            }
            for t, v in ceiling.items()
        ],
    }
