"""MariaDB Galera: the ledger on a three-node cluster against one plain node,
in one run on this machine (`python -m bench.galera`, about a minute; needs
galera-4, mariadb-server and rsync, as the tests do).

Every server is started by tests/galera.py in a temporary directory with the
same settings (innodb_flush_log_at_trx_commit=2 on each), so the ratios
compare topologies, not configurations. Each row drives THREADS client
threads for SECONDS: a client sends a new key to its first node and, as
soon as it is answered, the same request to its second node (a retry that
must replay). Rows:

* plain node: one MariaDB server without Galera, both sends to it;
* Galera, one writer node: both sends to node 1;
* Galera, spread: client i sends first to node i mod 3, then to the next;
* Galera, spread, wsrep_sync_wait=0: the same with causal reads turned off
  in the URL, which is what idemctl did before it set them.

Then the race: RACE_KEYS keys, each sent to the three nodes at once.

Reported per row: requests, app runs, keys run twice, errors by type
(exceptions by class, and answers other than the expected executed/replayed
by outcome), throughput, and throughput / the plain node's."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from idemctl import Ledger, Outcome

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.galera import GaleraCluster, missing  # noqa: E402

THREADS = 6
SECONDS = 8.0
RACE_KEYS = 200
HEADERS = {"content-type": "application/json"}
BODY = b'{"amount": 100}'


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: Counter[str] = Counter()
        self.requests = 0
        self.errors: Counter[str] = Counter()

    def app(self, key: str) -> Any:
        def run(body: bytes) -> tuple[int, dict[str, str], bytes]:
            with self.lock:
                self.runs[key] += 1
            return 201, HEADERS, json.dumps({"key": key, "run": uuid.uuid4().hex}).encode()

        return run

    def send(self, ledger: Ledger, key: str, expected: Outcome) -> None:
        try:
            answer = ledger.handle("acct_A", key, "POST", "/payments", HEADERS, BODY, self.app(key))
            problem = None if answer.outcome is expected else f"{answer.status} {answer.outcome.value}"
        except Exception as exc:
            problem = type(exc).__name__
        with self.lock:
            self.requests += 1
            if problem is not None:
                self.errors[problem] += 1

    def row(self, name: str, seconds: float) -> dict[str, Any]:
        return {
            "topology": name,
            "requests": self.requests,
            "runs": sum(self.runs.values()),
            "double_runs": sum(1 for n in self.runs.values() if n > 1),
            "errors": dict(self.errors),
            "throughput_rps": round(self.requests / seconds, 1),
        }


def drive(name: str, urls: list[str], pairs: list[tuple[int, int]], seconds: float) -> dict[str, Any]:
    ledgers = [Ledger.open(url) for url in urls]
    ledgers[0].init()
    tally = Tally()
    stop = threading.Event()
    prefix = uuid.uuid4().hex[:8]

    def client(i: int, first: int, second: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            key = f"{prefix}-{i}-{n}"
            tally.send(ledgers[first], key, Outcome.EXECUTED)
            tally.send(ledgers[second], key, Outcome.REPLAYED)

    threads = [threading.Thread(target=client, args=(i, a, b)) for i, (a, b) in enumerate(pairs)]
    started = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    for ledger in ledgers:
        ledger.close()
    return tally.row(name, elapsed)


def race(urls: list[str], keys: int) -> dict[str, Any]:
    ledgers = [Ledger.open(url) for url in urls]
    ledgers[0].init()
    tally = Tally()
    barrier = threading.Barrier(len(ledgers))
    prefix = uuid.uuid4().hex[:8]
    outcomes: Counter[str] = Counter()

    def client(ledger: Ledger) -> None:
        for i in range(keys):
            key = f"race-{prefix}-{i}"
            barrier.wait()
            try:
                answer = ledger.handle("acct_A", key, "POST", "/payments", HEADERS, BODY, tally.app(key))
                label = answer.outcome.value
            except Exception as exc:
                label = type(exc).__name__
                with tally.lock:
                    tally.errors[label] += 1
            with tally.lock:
                tally.requests += 1
                outcomes[label] += 1

    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(ledger,)) for ledger in ledgers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    row = tally.row(f"Galera race: each key to 3 nodes at once ({keys} keys)", time.monotonic() - started)
    row["outcomes"] = dict(outcomes)
    for ledger in ledgers:
        ledger.close()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=SECONDS)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "galera.json")
    args = parser.parse_args()
    reason = missing()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    rows = []
    plain = GaleraCluster(galera=False).start()
    try:
        plain.create_database("bench")
        rows.append(drive("plain node", [plain.nodes[0].url("bench")], [(0, 0)] * THREADS, args.seconds))
    finally:
        plain.stop()
    cluster = GaleraCluster().start()
    try:
        for n, (name, query, pairs) in enumerate(
            [
                ("Galera, one writer node", "", [(0, 0)] * THREADS),
                ("Galera, spread over 3 nodes", "", [(i % 3, (i + 1) % 3) for i in range(THREADS)]),
                (
                    "Galera, spread, wsrep_sync_wait=0",
                    "wsrep_sync_wait=0",
                    [(i % 3, (i + 1) % 3) for i in range(THREADS)],
                ),
            ]
        ):
            database = f"bench{n}"
            cluster.create_database(database)
            rows.append(drive(name, [node.url(database, query) for node in cluster.nodes], pairs, args.seconds))
        cluster.create_database("race")
        rows.append(race([node.url("race") for node in cluster.nodes], RACE_KEYS))
    finally:
        cluster.stop()
    base = rows[0]["throughput_rps"]
    for row in rows:
        # The race is paced by its barrier, not by the servers: no ratio.
        row["vs_plain"] = round(row["throughput_rps"] / base, 2) if base and "outcomes" not in row else None
    args.out.write_text(json.dumps({"threads": THREADS, "seconds": args.seconds, "rows": rows}, indent=1) + "\n")
    print("| topology | requests | runs | double runs | errors by type | req/s | ÷ plain node |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for row in rows:
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(row["errors"].items())) or "none"
        print(
            f"| {row['topology']} | {row['requests']} | {row['runs']} | {row['double_runs']} | {errors} "
            f"| {row['throughput_rps']} | {row['vs_plain'] if row['vs_plain'] is not None else '–'} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
