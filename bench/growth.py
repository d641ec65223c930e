"""(4) Growth: claim latency with 10^4, 10^5 and 10^6 rows already in the
table, against the raw claim on the same file at the same size.

One file grows through the three sizes (rows already past retention, as a
backlog is). At each size, `Ledger.claim` and the raw `INSERT … RETURNING`
alternate in blocks of fresh random keys, under FULL and under NORMAL; the
figure is the mean latency of a block, the ratio ours/floor per repetition
(lower is better; 1.0 is the floor)."""

from __future__ import annotations

import random
from typing import Any

from idemctl import Ledger

from .backlog import DAY_MS, add_rows, init_ledger
from .common import FINGERPRINT, RAW_CLAIM, Context, now_ms, raw_connect, spread, timed


def _measure(path: str, synchronous: str, reps: int, n: int, seed: int) -> dict[str, Any]:
    ledger = Ledger.open(path, synchronous=synchronous)
    # The same claim without the fair writer queue: how much of the gap to
    # the raw statement is the queue's flock and how much is Python.
    unqueued = Ledger.open(path, synchronous=synchronous, write_queue=False)
    raw = raw_connect(path, synchronous)
    rnd = random.Random(seed)
    ours: list[float] = []
    floor: list[float] = []
    no_queue: list[float] = []
    # Untimed warm-up of both paths: the first statements after a bulk load
    # pay for reading the file back into the page cache.
    warm = now_ms()
    for _ in range(min(n, 50)):
        raw.execute(
            RAW_CLAIM,
            {
                "principal": "acct_growth",
                "key": "%032x" % rnd.getrandbits(128),
                "fingerprint": FINGERPRINT,
                "token": 1,
                "now": warm,
            },
        ).fetchall()
        ledger.claim("acct_growth", "%032x" % rnd.getrandbits(128), FINGERPRINT, now=warm)
        unqueued.claim("acct_growth", "%032x" % rnd.getrandbits(128), FINGERPRINT, now=warm)
    for rep in range(reps):
        keys_a = ["%032x" % rnd.getrandbits(128) for _ in range(n)]
        keys_b = ["%032x" % rnd.getrandbits(128) for _ in range(n)]
        keys_c = ["%032x" % rnd.getrandbits(128) for _ in range(n)]
        now = now_ms()

        def run_floor() -> None:
            for k in keys_a:
                raw.execute(
                    RAW_CLAIM,
                    {"principal": "acct_growth", "key": k, "fingerprint": FINGERPRINT, "token": 1, "now": now},
                ).fetchall()

        def run_ours() -> None:
            for k in keys_b:
                ledger.claim("acct_growth", k, FINGERPRINT, now=now)

        def run_unqueued() -> None:
            for k in keys_c:
                unqueued.claim("acct_growth", k, FINGERPRINT, now=now)

        if rep % 2:
            ours.append(timed(run_ours) / n * 1e6)
            floor.append(timed(run_floor) / n * 1e6)
        else:
            floor.append(timed(run_floor) / n * 1e6)
            ours.append(timed(run_ours) / n * 1e6)
        no_queue.append(timed(run_unqueued) / n * 1e6)
    ledger.close()
    unqueued.close()
    raw.close()
    return {
        "floor_us": spread(floor, 1),
        "claim_us": spread(ours, 1),
        "ratio": spread([a / b for a, b in zip(ours, floor)]),
        "claim_no_queue_us": spread(no_queue, 1),
        "extra_us": spread([a - b for a, b in zip(ours, floor)], 1),
    }


def run(ctx: Context) -> dict[str, Any]:
    sizes = [10**4, 10**5, 10**6] if not ctx.quick else [300, 1000, 3000]
    reps = ctx.size(5, 2)
    n_full, n_normal = ctx.size(300, 20), ctx.size(1000, 20)
    path = ctx.path("backlog.db")
    init_ledger(path)
    expired_at = now_ms() - 2 * DAY_MS - 10**7  # all past the 24 h retention
    loaded = 0
    out: dict[str, Any] = {"sizes": []}
    for i, size in enumerate(sizes):
        elapsed = timed(lambda: add_rows(path, size - loaded, seed=1000 + i, updated_at=expired_at + loaded))
        loaded = size
        ctx.log(f"  growth: {size} rows loaded in {elapsed:.1f} s")
        entry: dict[str, Any] = {"rows": size, "load_s": round(elapsed, 2)}
        for sync, n in (("FULL", n_full), ("NORMAL", n_normal)):
            entry[sync.lower()] = _measure(path, sync, reps, n, seed=size)
        out["sizes"].append(entry)
    ctx.shared["backlog_path"] = path
    ctx.shared["backlog_rows"] = loaded
    return out
