"""Child processes: peak RSS of one child (os.wait4), a WAL-size sampler, and
the concurrent claiming process used while sweeping."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any

from idemctl import Ledger

from .common import BODY_1K, HEADERS, latency_summary, noop_mutation

if TYPE_CHECKING:
    from multiprocessing.queues import Queue
    from multiprocessing.synchronize import Event

FORK = mp.get_context("fork")
# What the claimer sends back: its latencies (seconds) and errors by type name.
ClaimerResult = tuple[list[float], dict[str, int]]


def run_measured(argv: list[str], *, timeout: float = 900) -> dict[str, Any]:
    """Run a command to completion; its wall time, exit code, stdout, stderr
    tail and peak resident set size in MiB (its own, through bench/rss.py)."""
    launcher = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "rss.py")]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen([*launcher, *argv], stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        elapsed = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stderr = err.read().decode("utf-8", "replace")
        body, _, last = stderr.rstrip("\n").rpartition("\n")
        peak_kib = int(last.split("=", 1)[1]) if last.startswith("BENCH_PEAK_RSS_KIB=") else -1
        return {
            "argv": [os.path.basename(argv[0]), *argv[1:]],
            "exit_code": code,
            "seconds": round(elapsed, 3),
            "peak_rss_mib": round(peak_kib / 1024, 1),  # Linux reports KiB
            "stdout": out.read().decode("utf-8", "replace"),
            "stderr_tail": body[-400:],
        }


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "idemctl", *args]


class WalSampler:
    """Samples the size of `<db>-wal` every few milliseconds in a thread."""

    def __init__(self, path: str, every_s: float = 0.02) -> None:
        self.path = path + "-wal"
        self.every_s = every_s
        self.max_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.max_bytes = max(self.max_bytes, os.path.getsize(self.path))
            except OSError:
                pass
            self._stop.wait(self.every_s)

    def __enter__(self) -> WalSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.max_bytes = max(self.max_bytes, os.path.getsize(self.path))
        except OSError:
            pass


def _claimer(target: str, interval_s: float, stop: Event, out: Queue[ClaimerResult]) -> None:
    ledger = Ledger.open(target)
    latencies: list[float] = []
    errors: dict[str, int] = {}
    i = 0
    next_at = time.perf_counter()
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            ledger.handle("acct_claimer", f"claimer-{i}", "POST", "/orders", HEADERS, BODY_1K, noop_mutation)
        except Exception as exc:  # counted: an error here is a result
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
        latencies.append(time.perf_counter() - t0)
        i += 1
        next_at += interval_s
        delay = next_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        else:
            next_at = time.perf_counter()
    ledger.close()
    out.put((latencies, errors))


class Claimer:
    """A separate process sending one request every `interval_s` (distinct
    keys, `Ledger.handle` only) until stopped; its latencies and errors."""

    def __init__(self, target: str, interval_s: float = 0.005) -> None:
        self._stop = FORK.Event()
        self._out: Queue[ClaimerResult] = FORK.Queue()
        self._proc = FORK.Process(target=_claimer, args=(target, interval_s, self._stop, self._out))
        self.result: dict[str, Any] = {}

    def __enter__(self) -> Claimer:
        self._proc.start()
        time.sleep(0.3)  # let it open its connection and settle
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        latencies, errors = self._out.get(timeout=120)
        self._proc.join(30)
        self.result = latency_summary(latencies)
        self.result["errors"] = errors
        self.result["error_count"] = sum(errors.values())
