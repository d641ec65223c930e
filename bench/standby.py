"""What clients get while a synchronous standby is gone, measured on a real
primary and streaming standby (bench/replica.py) with
`synchronous_standby_names = '*'`.

Client threads send POSTs through the WSGI middleware, one at a time, for a
fixed time in each phase: with the standby streaming, after it was stopped
(`pg_ctl stop -m immediate`), and after it was started again. After each new
key a client retries a key answered 201 earlier (a replay) and its last key
refused with 503 (whose claim committed on the primary alone). Counted per
phase and kind of request: answers by status and the time to answer.

    python -m bench.standby                       # commit_timeout unset (10 s)
    python -m bench.standby --commit-timeout 2    # the tables in docs/topologies.md: both"""

from __future__ import annotations

import argparse
import io
import logging
import statistics
import threading
import time
from collections import Counter, defaultdict
from typing import Any

from idemctl import Ledger, Policy
from idemctl.wsgi import IdempotencyMiddleware

from .replica import ReplicaPair

PRINCIPAL = "acct_standby"
BODY = b'{"amount": 100}'


def _orders(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    start_response("201 Created", [("content-type", "application/json")])
    return [b'{"id": 1}']


def _post(app: IdempotencyMiddleware, key: str) -> tuple[int, float]:
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/orders",
        "QUERY_STRING": "",
        "SERVER_NAME": "bench",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(BODY)),
        "HTTP_IDEMPOTENCY_KEY": key,
        "REMOTE_USER": PRINCIPAL,
        "wsgi.input": io.BytesIO(BODY),
        "wsgi.errors": io.StringIO(),
        "wsgi.url_scheme": "http",
        "wsgi.multithread": True,
    }
    seen: list[str] = []

    def start_response(status: str, headers: Any, exc_info: Any = None) -> Any:
        seen.append(status)

    started = time.monotonic()
    for _ in app(environ, start_response):
        pass
    return int(seen[0].split()[0]), time.monotonic() - started


class Phase:
    def __init__(self, name: str) -> None:
        self.name = name
        self.statuses: dict[str, Counter[int]] = defaultdict(Counter)
        self.times: dict[str, list[float]] = defaultdict(list)
        self.lock = threading.Lock()

    def add(self, kind: str, status: int, elapsed: float) -> None:
        with self.lock:
            self.statuses[kind][status] += 1
            self.times[kind].append(elapsed)


def _client(app: IdempotencyMiddleware, n: int, phase: Phase, until: float, answered: list[str]) -> None:
    refused: str | None = None
    i = 0
    while time.monotonic() < until:
        key = f"{phase.name}-{n}-{i}"
        i += 1
        status, elapsed = _post(app, key)
        phase.add("new key", status, elapsed)
        if status == 201:
            answered.append(key)
        elif status == 503:
            refused = key
        if answered:
            status, elapsed = _post(app, answered[(n + i) % len(answered)])
            phase.add("retry of an answered key", status, elapsed)
        if refused is not None:
            status, elapsed = _post(app, refused)
            phase.add("retry of a refused key", status, elapsed)


def _run_phase(app: IdempotencyMiddleware, name: str, clients: int, seconds: float, answered: list[str]) -> Phase:
    phase = Phase(name)
    until = time.monotonic() + seconds
    threads = [threading.Thread(target=_client, args=(app, n, phase, until, answered)) for n in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return phase


def measure(commit_timeout_s: float | None, clients: int, seconds: float) -> list[Phase]:
    with ReplicaPair.start(synchronous=True) as pair:
        query = "" if commit_timeout_s is None else f"commit_timeout={commit_timeout_s:g}"
        with Ledger.open(pair.url(query=query), policy=Policy(pending_ttl_ms=30_000)) as ledger:
            ledger.init()
            app = IdempotencyMiddleware(_orders, ledger, principal=lambda env: env.get("REMOTE_USER"))
            answered: list[str] = []
            phases = [_run_phase(app, "present", clients, seconds, answered)]
            pair.stop_standby()
            # Long enough for each client to be refused at least twice.
            bound = ledger.store.engine.commit_timeout_s  # type: ignore[attr-defined]
            phases.append(_run_phase(app, "gone", clients, max(seconds, 2 * bound + 1), list(answered)))
            pair.start_standby()
            phases.append(_run_phase(app, "back", clients, seconds, answered))
    return phases


def render(phases: list[Phase], label: str) -> str:
    lines = [
        label,
        "",
        "| standby | request | requests | 201 | 409 | 503 | median time to answer | longest |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    kinds = ("new key", "retry of an answered key", "retry of a refused key")
    for phase in phases:
        for kind in kinds:
            counts, times = phase.statuses.get(kind), phase.times.get(kind)
            if not counts or not times:
                continue
            other = sum(counts.values()) - counts[201] - counts[409] - counts[503]
            lines.append(
                f"| {phase.name} | {kind} | {sum(counts.values())} | {counts[201]} | {counts[409]} | "
                f"{counts[503]}{f' (+{other} other)' if other else ''} | {_ms(statistics.median(times))} | "
                f"{_ms(max(times))} |"
            )
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit-timeout", type=float, action="append", help="seconds; repeat for several runs")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    # The 503s' WARNING lines (and the pool's on each replaced connection)
    # are what the table counts.
    logging.getLogger("idemctl").setLevel(logging.ERROR)
    logging.getLogger("psycopg").setLevel(logging.ERROR)
    reason = ReplicaPair.unavailable()
    if reason:
        raise SystemExit(f"cannot start a primary and standby here: {reason}")
    for timeout in args.commit_timeout or [None]:
        phases = measure(timeout, args.clients, args.seconds)
        label = f"commit_timeout={timeout:g}" if timeout is not None else "commit_timeout unset (10 s, the default)"
        print(render(phases, f"{label}, {args.clients} clients, standby stopped with pg_ctl stop -m immediate"))
        print()


if __name__ == "__main__":
    main()
