"""What a Redis failover does to the ledger, measured on a real primary, its
replica and a Sentinel (tests/redis_servers.py, started here on free ports).

Writer threads run `Ledger.handle` through the Sentinel's URL, each on keys
of its own, one request at a time, retrying on 503 and 409 with the same
key; each mutation counts its runs. Mid-load the replica is paused
(SIGSTOP) and its replication link cut (CLIENT KILL TYPE replica) `--lag`
seconds before the primary is killed (SIGKILL), so the primary acknowledges
completions the replica never receives; the replica resumes and the
Sentinel promotes it. Once the pending TTL has passed,
every key any writer used is sent once more, as a client that retries
everything would.

    python -m bench.redis_failover              # the table in docs/topologies.md
    python -m bench.redis_failover --settings async --writers 2

Counted per setting:
- acknowledged: answers `handle` returned stored before the crash;
- lost: of those, rows missing or still pending on the promoted replica;
- double runs: keys whose mutation ran more than once in all;
- 503s, and the longest stretch a writer saw them."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from idemctl import Ledger, Policy, StorageError
from idemctl.outcomes import Status

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.redis_servers import WithSentinel, missing

PRINCIPAL = "acct_failover"
TTL_MS = 2000
POLICY = Policy(pending_ttl_ms=TTL_MS, retention_ms=3_600_000)

SETTINGS = {
    "async": ("asynchronous replication (default)", "", ()),
    "wait": ("wait_replicas=1 (WAIT before a completion is acknowledged)", "?wait_replicas=1&wait_timeout_ms=500", ()),
    "fsync": (
        "appendonly yes, appendfsync always (replication still asynchronous)",
        "",
        ("appendonly", "yes", "appendfsync", "always"),
    ),
}


@dataclass
class Tally:
    runs: Counter[str] = field(default_factory=Counter)
    acknowledged: set[str] = field(default_factory=set)
    refused: int = 0
    longest_refusal_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


def writer(ledger: Ledger, n: int, tally: Tally, stop: threading.Event, crashed: threading.Event) -> None:
    i = 0
    while not stop.is_set():
        key = f"w{n}-{i}"
        first_refusal: float | None = None
        while not stop.is_set():

            def mutation(body: bytes, key: str = key) -> tuple[int, dict[str, str], bytes]:
                with tally.lock:
                    tally.runs[key] += 1
                return 201, {}, key.encode()

            try:
                answer = ledger.handle(PRINCIPAL, key, "POST", "/pay", {}, b"{}", mutation)
            except StorageError:
                answer = None
            if answer is not None and answer.status != 503 and answer.status != 409:
                if first_refusal is not None:
                    tally.longest_refusal_s = max(tally.longest_refusal_s, time.monotonic() - first_refusal)
                if not crashed.is_set() and answer.status == 201:
                    tally.acknowledged.add(key)
                break
            if answer is None or answer.status == 503:
                tally.refused += 1
                first_refusal = first_refusal or time.monotonic()
            time.sleep(0.02)
        i += 1


def run(setting: str, writers: int, lag_s: float, load_s: float) -> dict[str, object]:
    label, query, config = SETTINGS[setting]
    servers = WithSentinel().start()
    try:
        for server in (servers.primary, servers.replica):
            for name, value in zip(config[::2], config[1::2], strict=True):
                server.cli("config", "set", name, value)
        url = servers.url + query
        ledger = Ledger.open(url, policy=POLICY, busy_timeout_ms=1000)
        ledger.init()
        time.sleep(0.5)  # the marker reaches the replica
        tally, stop, crashed = Tally(), threading.Event(), threading.Event()
        threads = [threading.Thread(target=writer, args=(ledger, n, tally, stop, crashed)) for n in range(writers)]
        for t in threads:
            t.start()
        time.sleep(load_s)
        # Cut the replication link with the replica paused (it cannot
        # reconnect): for `lag_s` the primary acknowledges completions that
        # never reach it; then the primary dies and the replica resumes.
        os.kill(servers.replica.process.pid, signal.SIGSTOP)
        servers.primary.cli("client", "kill", "type", "replica")
        time.sleep(lag_s)
        crashed.set()
        servers.primary.kill()
        os.kill(servers.replica.process.pid, signal.SIGCONT)
        time.sleep(load_s + 3)  # the Sentinel promotes the replica; writers carry on
        stop.set()
        for t in threads:
            t.join()
        time.sleep(TTL_MS / 1000 + 0.2)
        keys = sorted(tally.runs)
        lost = 0
        for key in sorted(tally.acknowledged):
            row = ledger.lookup(PRINCIPAL, key)
            lost += row is None or row.status is not Status.COMPLETED
        for key in keys:  # the final retry of every key

            def again(body: bytes, key: str = key) -> tuple[int, dict[str, str], bytes]:
                with tally.lock:
                    tally.runs[key] += 1
                return 201, {}, key.encode()

            for _ in range(50):
                answer = ledger.handle(PRINCIPAL, key, "POST", "/pay", {}, b"{}", again)
                if answer.status not in (409, 503):
                    break
                time.sleep(0.1)
        ledger.close()
        return {
            "setting": setting,
            "label": label,
            "keys": len(keys),
            "acknowledged": len(tally.acknowledged),
            "lost": lost,
            "double_runs": sum(1 for k in keys if tally.runs[k] > 1),
            "refused_503": tally.refused,
            "longest_503_s": round(tally.longest_refusal_s, 2),
        }
    finally:
        if os.environ.get("BENCH_SENTINEL_LOG"):
            print((servers.folder / "sentinel.log").read_text()[-3000:], file=sys.stderr)
        servers.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.redis_failover", description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", default="async,wait,fsync", help=f"comma-separated: {', '.join(SETTINGS)}")
    p.add_argument("--writers", type=int, default=4)
    p.add_argument("--lag", type=float, default=0.3, help="seconds the replica is cut off before the crash")
    p.add_argument("--load", type=float, default=2.0, help="seconds of load before the pause, and after the crash")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    reason = missing()
    if reason is not None:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    rows = [run(s, args.writers, args.lag, args.load) for s in args.settings.split(",")]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print("| setting | keys | acknowledged | lost | mutations run twice | 503s (longest stretch) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['label']} | {r['keys']} | {r['acknowledged']} | {r['lost']} | {r['double_runs']} "
            f"| {r['refused_503']} ({r['longest_503_s']} s) |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
