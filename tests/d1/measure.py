"""Measures what docs/d1.md reports, on the D1 test runtime (not a test):

    python -m tests.d1.measure           # latency and the client
    python -m tests.d1.measure --calls   # API calls per CLI command

- the request path on d1://: a first call (claim + completion, two API
  calls) and a replay (claim attempt + lookup, two calls), median and p95,
  beside one bare API call (`SELECT 1`) and the recipe's own Worker
  answering a first call and a replay over the same loopback;
- the client: one `SELECT 1` through idemctl's httpx client and through
  Cloudflare's SDK (`cloudflare`, if installed), and each one's import time
  in a fresh interpreter."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from idemctl import Ledger
from idemctl.storage.d1 import D1Engine

from .runtime import ACCOUNT, DATABASE, TOKEN, Runtime, start, wipe


def timed(fn: Callable[[], object], n: int) -> tuple[float, float]:
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    samples.sort()
    return statistics.median(samples) * 1000, samples[int(len(samples) * 0.95) - 1] * 1000


def cpu_us(fn: Callable[[], object], n: int) -> float:
    """This process's CPU time per call (the client's own work, not the wait)."""
    started = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - started) / n * 1e6


def import_ms(module: str) -> float:
    code = f"import time; t = time.perf_counter(); import {module}; print((time.perf_counter() - t) * 1000)"
    runs = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)]
    runs += [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)]
    return min(runs)


def command_calls(runtime: Runtime) -> None:
    """The API calls each CLI command makes (the stand-in counts them)."""
    engine = D1Engine(runtime.ledger_url)
    env = dict(os.environ, IDEMCTL_DB=runtime.ledger_url)

    def run(*args: str) -> None:
        before = runtime.faults()["calls"]
        done = subprocess.run([sys.executable, "-m", "idemctl", *args], env=env, capture_output=True, text=True)
        print(f"{' '.join(args):40s} exit {done.returncode}, {runtime.faults()['calls'] - before} calls")

    run("init", "--dry-run")
    run("init")
    insert = (
        "INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, response_status,"
        " response_body, response_headers, created_at, updated_at)"
        " VALUES ('old', :k, 'fp', 'completed', 1, 201, 'x', '{}', 1000, 1000)"
    )
    engine.write_turn([(insert, {"k": f"k{i}"}) for i in range(600)])
    for i in range(3):
        runtime.post("/orders", b"{}", key=f"w{i}")
    for args in (
        ("inspect", "w1", "-p", "acct_1"),
        ("pending",),
        ("fenced",),
        ("stats",),
        ("sweep", "--dry-run"),
        ("sweep", "--retention", "1h"),
        ("purge", "w2", "-p", "acct_1", "--yes"),
        ("doctor",),
    ):
        run(*args)
    with tempfile.TemporaryDirectory() as scratch:
        run("copy", "--to", os.path.join(scratch, "copy.db"), "--init")


def main() -> None:
    runtime = start()
    try:
        wipe(runtime)
        os.environ.update(runtime.env())
        if sys.argv[1:] == ["--calls"]:
            command_calls(runtime)
            return
        ledger = Ledger.open(runtime.ledger_url)
        ledger.init()
        n = 200
        bare = timed(lambda: ledger.store.engine.read("SELECT 1", {}), n)
        counter = iter(range(10**9))

        def first() -> None:
            key = f"m-{next(counter)}"
            ledger.handle("acct_1", key, "POST", "/orders", {}, b"{}", lambda body: (201, {}, b"{}"))

        first_call = timed(first, n)
        ledger.handle("acct_1", "replayed", "POST", "/orders", {}, b"{}", lambda body: (201, {}, b"{}"))
        replay = timed(
            lambda: ledger.handle("acct_1", "replayed", "POST", "/orders", {}, b"{}", lambda body: (201, {}, b"")), n
        )
        worker_first = timed(lambda: runtime.post("/orders", b"{}", key=f"w-{next(counter)}"), n)
        runtime.post("/orders", b"{}", key="w-replayed")
        worker_replay = timed(lambda: runtime.post("/orders", b"{}", key="w-replayed"), n)
        api = ledger.store.engine.api  # type: ignore[attr-defined]
        before = api.calls
        first()
        firsts = api.calls - before
        before = api.calls
        ledger.handle("acct_1", "replayed", "POST", "/orders", {}, b"{}", lambda body: (201, {}, b""))
        replays = api.calls - before
        print(f"API calls: a first call {firsts}, a replay {replays}")
        print(f"bare API call (SELECT 1):       median {bare[0]:.2f} ms, p95 {bare[1]:.2f} ms")
        print(f"idemctl first call (2 calls):   median {first_call[0]:.2f} ms, p95 {first_call[1]:.2f} ms")
        print(f"idemctl replay (2 calls):       median {replay[0]:.2f} ms, p95 {replay[1]:.2f} ms")
        print(f"recipe Worker first call:       median {worker_first[0]:.2f} ms, p95 {worker_first[1]:.2f} ms")
        print(f"recipe Worker replay:           median {worker_replay[0]:.2f} ms, p95 {worker_replay[1]:.2f} ms")
        print(f"import httpx: {import_ms('httpx'):.0f} ms")
        try:
            import cloudflare
        except ImportError:
            print("cloudflare SDK not installed")
            return
        client = cloudflare.Cloudflare(api_token=TOKEN, base_url=runtime.base, max_retries=0)
        sdk = timed(lambda: list(client.d1.database.raw(DATABASE, account_id=ACCOUNT, sql="SELECT 1")), n)
        print(f"SDK call (SELECT 1):            median {sdk[0]:.2f} ms, p95 {sdk[1]:.2f} ms")
        engine = ledger.store.engine
        ours = cpu_us(lambda: engine.read("SELECT 1", {}), n)
        theirs = cpu_us(lambda: list(client.d1.database.raw(DATABASE, account_id=ACCOUNT, sql="SELECT 1")), n)
        print(f"client CPU per call: idemctl/httpx {ours:.0f} us, SDK {theirs:.0f} us ({theirs / ours:.2f}x)")
        print(f"import cloudflare + first d1 call's modules: {import_ms('cloudflare.resources.d1'):.0f} ms")
        print(f"import idemctl.storage: {import_ms('idemctl.storage'):.0f} ms")
        print(f"import idemctl.storage.d1: {import_ms('idemctl.storage.d1'):.0f} ms")
    finally:
        runtime.stop()


if __name__ == "__main__":
    main()
