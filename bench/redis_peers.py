"""idemctl on Redis beside idemkit's RedisBackend and the raw redis-py
floor, on one standalone redis-server started here (tests/redis_servers.py),
each through WSGI middleware with the same app, keys and 1 KiB answer.

    python -m bench.redis_peers              # merged into bench/results/latest.json, docs/performance.md rendered
    python -m bench.redis_peers --n 500 --no-merge

The floor is what any Redis ledger must send: a first call is a claim and a
completion (SET NX, then SET XX, two round trips), a replay one GET. Each
system's median per request is given as a ratio to the floor measured in
the same run. idemkit's middleware runs its asyncio backend through its own
bridge; idemctl's WSGI door calls redis-py's synchronous client."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from . import report
from .peers_systems import PRINCIPAL, STORED_1K, call_wsgi, wsgi_app


def _median_us(n: int, one: Callable[[int], object]) -> float:
    times = []
    for i in range(n):
        started = time.perf_counter()
        one(i)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def measure(url: str, n: int) -> dict[str, dict[str, float]]:
    import redis

    from idemctl import Ledger
    from idemctl.wsgi import IdempotencyMiddleware

    results: dict[str, dict[str, float]] = {}
    client = redis.Redis.from_url(url)

    def floor_first(i: int) -> None:
        client.set(f"floor:{i}", b"pending", nx=True, px=86_400_000)
        client.set(f"floor:{i}", STORED_1K, xx=True, px=86_400_000)

    def floor_replay(i: int) -> None:
        client.get(f"floor:{i}")

    results["floor"] = {"first": _median_us(n, floor_first), "replay": _median_us(n, floor_replay)}

    ledger = Ledger.open(f"{url}?prefix=bench")
    ledger.init()
    ours = IdempotencyMiddleware(wsgi_app, ledger, principal=lambda environ: PRINCIPAL)

    def ours_call(i: int) -> None:
        status, _, body = call_wsgi(ours, f"ours-{i}", lambda: STORED_1K)
        assert status == 201 and body == STORED_1K, status

    results["idemctl"] = {"first": _median_us(n, ours_call), "replay": _median_us(n, ours_call)}
    ledger.close()

    try:
        from idemkit import HttpConfig, RedisBackend, WSGIIdempotencyMiddleware
    except ImportError:
        print("idemkit is not installed (pip install -e '.[bench]'): its row is left out", file=sys.stderr)
    else:
        backend = RedisBackend.from_url(url)
        config = HttpConfig(scope=lambda req: req.environ.get("REMOTE_USER"), lease_ttl_seconds=30.0)
        kit = WSGIIdempotencyMiddleware(wsgi_app, backend=backend, config=config)

        def kit_call(i: int) -> None:
            status, _, body = call_wsgi(kit, f"kit-{i}", lambda: STORED_1K)
            assert status == 201 and body == STORED_1K, status

        results["idemkit"] = {"first": _median_us(n, kit_call), "replay": _median_us(n, kit_call)}
    client.close()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.redis_peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1000, help="requests per measurement (default 1000)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-merge", action="store_true", help="print the table; leave latest.json and the page alone")
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.redis_servers import Standalone, missing

    reason = missing()
    if reason is not None:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    server = Standalone().start()
    started = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
    try:
        results = measure(server.url, args.n)
        version = server.server.cli("info", "server").split("redis_version:")[1].split()[0]
    finally:
        server.stop()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    res = {
        "started_utc": started,
        "commit": commit.stdout.strip() or "?",
        "load": "/".join(f"{x:.1f}" for x in os.getloadavg()),
        "n": args.n,
        "server": version,
        "results": results,
    }
    if args.json:
        print(json.dumps(res))
    else:
        print("\n".join(report.redis_peers_table(res)))
    if args.no_merge:
        return 0
    from .common import LATEST, PAGE

    with open(LATEST, encoding="utf-8") as f:
        latest = json.load(f)
    latest["benchmarks"]["redis_peers"] = res
    with open(LATEST, "w", encoding="utf-8") as f:
        json.dump(latest, f, indent=1, sort_keys=False)
        f.write("\n")
    report.write_page(PAGE, latest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
