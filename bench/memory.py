"""(6) Memory of a long-running worker: one process handles 100 000 requests
with 16 KiB request bodies and 16 KiB stored answers (the body cap), calling
`after_response` after each, and samples its own resident set size every
tenth of the run. It must not grow: the figure is the RSS at the end against
the RSS after the first tenth (the warm floor of the same process)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from idemctl import Ledger

from .common import HEADERS, Context
from .proc import FORK

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

# What the worker sends back: (requests, RSS in MiB) samples, and whether the replay matched.
WorkerResult = tuple[list[tuple[int, float]], bool]

BODY_16K = bytes(range(256)) * 64  # 16 KiB, not valid UTF-8: stored as a BLOB
ANSWER_16K = (b"a" * 1023 + b"\n") * 16  # 16 KiB of text, the largest body that is stored


def _rss_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _worker(path: str, requests: int, out: Queue[WorkerResult]) -> None:
    ledger = Ledger.open(path, synchronous="NORMAL")
    answer = (201, {"content-type": "text/plain"}, ANSWER_16K)
    samples: list[tuple[int, float]] = []
    step = max(1, requests // 10)
    handle, after = ledger.handle, ledger.after_response
    for i in range(requests):
        result = handle("acct_mem", f"m-{i}", "POST", "/upload", HEADERS, BODY_16K, lambda body: answer)
        after(result)
        if (i + 1) % step == 0:
            samples.append((i + 1, round(_rss_mib(), 2)))
    replay = handle("acct_mem", "m-0", "POST", "/upload", HEADERS, BODY_16K, lambda body: answer)
    ledger.close()
    out.put((samples, replay.body == ANSWER_16K))


def run(ctx: Context) -> dict[str, Any]:
    requests = ctx.size(100_000, 2_000)
    path = ctx.path("memory.db")
    Ledger.open(path).init()
    out: Queue[WorkerResult] = FORK.Queue()
    proc = FORK.Process(target=_worker, args=(path, requests, out))
    proc.start()
    samples, replay_ok = out.get(timeout=1800)
    proc.join(30)
    if not replay_ok:
        raise AssertionError("the 16 KiB answer did not replay byte for byte")
    first, last = samples[0][1], samples[-1][1]
    size = os.path.getsize(path) + (os.path.getsize(path + "-wal") if os.path.exists(path + "-wal") else 0)
    os.unlink(path)
    return {
        "requests": requests,
        "synchronous": "NORMAL",
        "samples": [{"requests": n, "rss_mib": r} for n, r in samples],
        "rss_after_first_tenth_mib": first,
        "rss_at_end_mib": last,
        "growth_mib": round(last - first, 2),
        "ratio_end_to_first_tenth": round(last / first, 3),
        "ledger_file_mib": round(size / 2**20, 1),
    }
