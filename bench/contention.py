"""(3) Contention: 1, 2 and 4 worker processes on one ledger file, each
sending requests with distinct keys as fast as it can for a fixed time.

Each request is what the middleware does per request: `handle` (claim,
no-op mutation, fenced completion, 1 KiB stored) then `after_response` (one
bounded sweep batch). Reported per configuration: total throughput (median and
min-max over one-second windows), its ratio to one process with the same
settings, latency p50/p99/max, requests over 100 ms and over 1 s, errors, and
requests per worker (equal counts mean writers took fair turns).

Run with the writer queue (the default: writers wait for an flock of
`<db>-idemctl.lock` in the kernel) and without it (SQLite's busy handler only),
to show what the queue changes."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import TYPE_CHECKING, Any

from idemctl import Ledger

from .common import BODY_1K, HEADERS, Context, latency_summary, noop_mutation, spread

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

FORK = mp.get_context("fork")
# What a worker sends back: its index, latencies, finish times (seconds) and errors by type name.
WorkerResult = tuple[int, list[float], list[float], dict[str, int]]


def _worker(
    path: str, synchronous: str, queue: bool, index: int, start_at: float, seconds: float, out: Queue[WorkerResult]
) -> None:
    if path.startswith(("postgresql://", "mysql://")):
        ledger = Ledger.open(path)
    else:
        ledger = Ledger.open(path, synchronous=synchronous, write_queue=queue)
    handle, after = ledger.handle, ledger.after_response
    latencies: list[float] = []
    finished: list[float] = []
    errors: dict[str, int] = {}
    while time.time() < start_at:
        time.sleep(0.0005)
    t_start = time.perf_counter() + (start_at - time.time())
    deadline = t_start + seconds
    i = 0
    clock = time.perf_counter
    while True:
        t0 = clock()
        if t0 >= deadline:
            break
        try:
            after(handle("acct_bench", f"w{index}-{i}", "POST", "/orders", HEADERS, BODY_1K, noop_mutation))
        except Exception as exc:  # counted, never hidden: errors are a result
            name = type(exc).__name__
            errors[name] = errors.get(name, 0) + 1
        t1 = clock()
        latencies.append(t1 - t0)
        finished.append(t1 - t_start)
        i += 1
    ledger.close()
    out.put((index, latencies, finished, errors))


def measure(path: str, synchronous: str, queue: bool, workers: int, seconds: float) -> dict[str, Any]:
    Ledger.open(path).init()
    out = FORK.Queue()
    start_at = time.time() + 0.3 + 0.05 * workers
    procs = [
        FORK.Process(target=_worker, args=(path, synchronous, queue, w, start_at, seconds, out)) for w in range(workers)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join(30)
    latencies = [v for r in results for v in r[1]]
    windows = max(1, int(seconds))
    width = seconds / windows
    counts = [0] * windows
    for r in results:
        for t in r[2]:
            counts[min(windows - 1, int(t / width))] += 1
    errors: dict[str, int] = {}
    for r in results:
        for k, v in r[3].items():
            errors[k] = errors.get(k, 0) + v
    return {
        "synchronous": synchronous,
        "write_queue": queue,
        "workers": workers,
        "seconds": seconds,
        "requests": len(latencies),
        "throughput": spread([c / width for c in counts], 1),
        "latency": latency_summary(latencies),
        "errors": errors,
        "error_count": sum(errors.values()),
        "per_worker": [len(r[1]) for r in sorted(results)],
    }


def run(ctx: Context) -> dict[str, Any]:
    seconds = 10.0 if not ctx.quick else 0.4
    configs = [("FULL", True), ("FULL", False), ("NORMAL", True), ("NORMAL", False)]
    out: dict[str, Any] = {"seconds_per_config": seconds, "configs": []}
    for synchronous, queue in configs:
        single = None
        for workers in (1, 2, 4):
            path = ctx.path(f"contention-{synchronous.lower()}-{'q' if queue else 'noq'}-{workers}.db")
            res = measure(path, synchronous, queue, workers, seconds)
            if workers == 1:
                single = res
            assert single is not None  # workers start at 1
            res["ratio_to_single"] = spread([a / single["throughput"]["median"] for a in res["throughput"]["values"]])
            res["ratio_to_single"]["total"] = round(res["requests"] / single["requests"], 3)
            ctx.log(
                f"  contention {synchronous} queue={'on' if queue else 'off'} x{workers}: "
                f"{res['requests'] / seconds:.0f} req/s, p99 {res['latency']['p99_ms']} ms, "
                f"max {res['latency']['max_ms']} ms, >1s {res['latency']['over_1s']}, errors {res['error_count']}"
            )
            out["configs"].append(res)
    return out
