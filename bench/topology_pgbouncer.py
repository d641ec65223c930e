"""PgBouncer in front of PostgreSQL, in each pool mode, against the server
itself in the same run: `python -m bench.topologies pgbouncer`.

Each topology gets a fresh schema (reached by the URL's
``options=-csearch_path=…``, as an application would) and the same
workload: THREADS threads of one process share one ledger, and each sends
every one of KEYS keys once, in its own order, so every key is one first
call and THREADS - 1 replays or waiting duplicates. The mutation counts its
runs per key. The topologies take turns, REPEATS rounds. Reported per
topology, summed over the rounds: requests, mutation runs, keys run more
than once (double runs), errors by type; and the median round's requests
per second ÷ the direct server's median. PgBouncer runs with its default configuration (apart from
where it listens, trust authentication and the pool mode), started by the
test suite's tests/pgbouncer.py on a free port; one row also sets
the usual workaround ``ignore_startup_parameters = options``."""

from __future__ import annotations

import argparse
import collections
import contextlib
import secrets
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from idemctl import Ledger

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"
THREADS, KEYS, REPEATS = 8, 500, 3
HEADERS = {"content-type": "application/json"}

# (row label, PgBouncer pool mode or None for the server itself, ignore
# startup options, extra URL query)
TOPOLOGIES: list[tuple[str, str | None, bool, str]] = [
    ("direct", None, False, ""),
    ("PgBouncer session", "session", False, ""),
    ("PgBouncer session, pooler=session", "session", False, "pooler=session"),
    ("PgBouncer transaction", "transaction", False, ""),
    ("PgBouncer transaction, ignore_startup_parameters=options", "transaction", True, ""),
    ("PgBouncer statement", "statement", False, ""),
]


@contextlib.contextmanager
def _schema(server: str) -> Iterator[str]:
    import psycopg

    name = f"bench_topo_{secrets.token_hex(4)}"
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f'CREATE SCHEMA "{name}"')
    try:
        yield name
    finally:
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def _workload(url: str, threads: int, keys: int) -> dict[str, Any]:
    runs: collections.Counter[str] = collections.Counter()
    errors: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    names = [f"order-{i:04d}" for i in range(keys)]
    with Ledger.open(url) as ledger:
        start = threading.Barrier(threads + 1)

        def worker(seed: int) -> None:
            order = names[seed * keys // threads :] + names[: seed * keys // threads]
            start.wait()
            for key in order:

                def mutate(body: bytes, key: str = key) -> tuple[int, dict[str, str], bytes]:
                    with lock:
                        runs[key] += 1
                    return 201, HEADERS, b'{"id":"' + key.encode() + b'"}'

                try:
                    ledger.handle("acct_bench", key, "POST", "/orders", HEADERS, b'{"sku":"x"}', mutate)
                except Exception as exc:
                    with lock:
                        errors[type(exc).__name__] += 1

        pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        start.wait()
        began = time.perf_counter()
        for t in pool:
            t.join()
        elapsed = time.perf_counter() - began
        pooler = getattr(ledger.store.engine, "pooler", None)
    return {
        "requests": threads * keys,
        "runs": sum(runs.values()),
        "keys_run": len(runs),
        "double_runs": sum(1 for n in runs.values() if n > 1),
        "errors": dict(errors),
        "seconds": elapsed,
        "per_second": threads * keys / elapsed,
        "pooler": pooler,
    }


def run(
    server: str = DEFAULT_URL, threads: int = THREADS, keys: int = KEYS, repeats: int = REPEATS
) -> list[dict[str, Any]]:
    from tests.pgbouncer import running_pgbouncer

    rounds: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    with contextlib.ExitStack() as stack:
        bouncers: dict[tuple[str, bool], Any] = {}
        for label, mode, ignore, query in TOPOLOGIES * repeats:
            base = server
            if mode is not None:
                if (mode, ignore) not in bouncers:
                    bouncers[mode, ignore] = stack.enter_context(running_pgbouncer(mode, server, ignore_options=ignore))
                base = bouncers[mode, ignore].url(server.split("?", 1)[0].rsplit("/", 1)[1])
            with _schema(server) as schema:
                # The schema is made on the server itself: statement pooling refuses init's transaction.
                with Ledger.open(f"{server}?options=-csearch_path%3D{schema}") as ledger:
                    ledger.init()
                url = f"{base}?options=-csearch_path%3D{schema}" + (f"&{query}" if query else "")
                result = _workload(url, threads, keys)
            rounds[label].append(result)
            print(f"  {label}: {result}", file=sys.stderr)
    rows = []
    for label, results in rounds.items():
        errors: collections.Counter[str] = collections.Counter()
        for r in results:
            errors.update(r["errors"])
        rows.append(
            {
                "topology": label,
                "pooler": results[-1]["pooler"],
                **{k: sum(r[k] for r in results) for k in ("requests", "runs", "keys_run", "double_runs")},
                "errors": dict(errors),
                "per_second": statistics.median(r["per_second"] for r in results),
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    direct = next(r["per_second"] for r in rows if r["topology"] == "direct")
    out = [
        "| topology | idemctl mode | requests | runs | double runs | errors | requests/s | ÷ direct |",
        "|---|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        errors = ", ".join(f"{name} {n}" for name, n in sorted(r["errors"].items())) or "0"
        out.append(
            f"| {r['topology']} | {r['pooler']} | {r['requests']} | {r['runs']} | {r['double_runs']} | {errors} "
            f"| {r['per_second']:.0f} | {r['per_second'] / direct:.2f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.topologies pgbouncer", description=__doc__)
    parser.add_argument("--url", default=DEFAULT_URL, help="the PostgreSQL server (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=THREADS)
    parser.add_argument("--keys", type=int, default=KEYS)
    parser.add_argument("--repeats", type=int, default=REPEATS)
    args = parser.parse_args(argv)
    rows = run(args.url, args.threads, args.keys, args.repeats)
    print(
        f"{args.threads} threads × {args.keys} keys, each key sent by every thread once; "
        f"{args.repeats} rounds, the topologies taking turns\n"
    )
    print(table(rows))
