"""(8)/(10) and (7) in instructions: PostgreSQL's request path counted by
callgrind, one request at a time, so that a change to it can be judged on a
busy machine too (PostgreSQL's own work is in its server processes and is
not counted: these are the client's instructions only).

Segments, each against its floor in the same child:
- ASGI: idemctl's middleware around the bare app, on asyncpg and on
  psycopg's AsyncConnection (``async_driver=psycopg``), against the raw
  statements on asyncpg and on psycopg (bench/inflight.py's floors), each
  request driven to its end on one event loop;
- synchronous: ``Ledger.handle`` against the raw psycopg statements on one
  connection (bench/postgres.py's floor).

A first call is the claim and the fenced completion, a replay the claim
that finds the key taken and reads its row (the floors run exactly those
statements; idemctl runs them with its Python around them).

    python -m bench.pg_instructions   # about 2 minutes; JSON on stdout
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import sys
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

from idemctl.storage.deadlines import TICK_S

from .common import (
    BODY_1K,
    FINGERPRINT,
    HEADERS,
    RESPONSE_HEADERS_JSON,
    STORED_1K,
    Context,
    noop_mutation,
    now_ms,
    package_of,
    package_roots,
)
from .peers_systems import asyncpg_url, call_asgi, create_schema, drop_schema, idemctl_asgi, psycopg_url
from .pg_floors import Floors

DEFAULT_BASE = "postgresql://postgres@127.0.0.1:5432/test"
SEEDS = 20
KINDS = ("first", "replay")
# (door, system): the floors first, each door's floor named "floor".
SEGMENTS = (
    ("asgi", "floor-asyncpg"),
    ("asgi", "floor-psycopg"),
    ("asgi", "idemctl"),
    ("asgi", "idemctl-psycopg"),
    ("sync", "floor"),
    ("sync", "handle"),
)


def _child(base: str, schema: str, n: int, quick: bool, manifest: str) -> None:
    """Under callgrind: every segment, one request at a time."""
    from idemctl import Ledger

    from .instructions import QUICK_WARM_UP, WARM_UP, Segments
    from .postgres import _connect

    url = psycopg_url(base, schema)
    loop = asyncio.new_event_loop()
    ledger = Ledger.open(url)
    ledger.init()
    on_psycopg = Ledger.open(url + "&async_driver=psycopg")
    apps = {"idemctl": idemctl_asgi(ledger), "idemctl-psycopg": idemctl_asgi(on_psycopg)}
    floors = Floors(url, asyncpg_url(base, schema), 2, SEEDS)
    loop.run_until_complete(floors.open())
    raw = _connect(base, schema)
    raw_sql = _raw_statements()

    async def via(app: Any, key: str) -> None:
        status, body = await call_asgi(app, key, lambda: STORED_1K)
        if status != 201 or body != STORED_1K:
            raise AssertionError(f"{key}: {status} {body[:80]!r}")

    def asgi(system: str, kind: str) -> Callable[[str], object]:
        if system.startswith("floor-"):
            go = floors.path(system.removeprefix("floor-"), kind)
            return lambda key: loop.run_until_complete(go(_number(key), key.replace("-", "")))
        app = apps[system]
        if kind == "first":
            return lambda key: loop.run_until_complete(via(app, key))
        return lambda key: loop.run_until_complete(via(app, f"{system}-seed-{_number(key) % SEEDS}"))

    def sync(system: str, kind: str) -> Callable[[str], object]:
        if system == "handle":
            if kind == "first":
                return lambda key: ledger.handle("acct_bench", key, "POST", "/orders", HEADERS, BODY_1K, noop_mutation)
            return lambda key: ledger.handle(
                "acct_bench", f"handle-seed-{_number(key) % SEEDS}", "POST", "/orders", HEADERS, BODY_1K, noop_mutation
            )
        claim, complete, claim_or_read = raw_sql

        def first(key: str) -> None:
            row = {"principal": "acct_bench", "key": key, "token": _number(key) + 1}
            now = now_ms()
            gen = raw.execute(claim, {**row, "fingerprint": FINGERPRINT, "now": now}).fetchall()[0][0]
            done = {"generation": gen, "status": 201, "body": STORED_1K, "headers": RESPONSE_HEADERS_JSON}
            raw.execute(complete, {**row, **done, "now": now + 1}).fetchall()

        def replay(key: str) -> None:
            row = {"principal": "acct_bench", "key": f"handle-seed-{_number(key) % SEEDS}", "token": 1}
            found = raw.execute(claim_or_read, {**row, "fingerprint": FINGERPRINT, "now": now_ms()}).fetchall()
            assert found and found[0][0] is None, "the replay floor claimed a new key"

        return first if kind == "first" else replay

    # The keys every replay finds.
    for i in range(SEEDS):
        for system, app in apps.items():
            loop.run_until_complete(via(app, f"{system}-seed-{i}"))
        for driver in ("asyncpg", "psycopg"):
            loop.run_until_complete(floors.path(driver, "first")(i, "seed"))
        ledger.handle("acct_bench", f"handle-seed-{i}", "POST", "/orders", HEADERS, BODY_1K, noop_mutation)

    counted = Segments(n, QUICK_WARM_UP if quick else WARM_UP)
    for door, system in SEGMENTS:
        for kind in KINDS:
            one = asgi(system, kind) if door == "asgi" else sync(system, kind)
            counted.segment(f"{door}:{system}:{kind}", one, what=f"{door}: {system}, {kind}")
    for app in apps.values():
        loop.run_until_complete(app.wait_idle())
    loop.run_until_complete(ledger.aclose())
    loop.run_until_complete(on_psycopg.aclose())
    loop.run_until_complete(floors.close())
    loop.close()
    ledger.close()
    on_psycopg.close()
    raw.close()
    counted.write(manifest)


def _number(key: str) -> int:
    # A segment's keys: name-w0, name-w1, ..., name-m0, ...
    return int(key.rpartition("-")[2][1:])


def _raw_statements() -> tuple[str, str, str]:
    from idemctl.storage.dialect import POSTGRES
    from idemctl.storage.statements import CLAIM, CLAIM_OR_READ, COMPLETE

    claim, complete, claim_or_read = (POSTGRES.params(s) for s in (CLAIM, COMPLETE, CLAIM_OR_READ))
    return claim, complete, claim_or_read


def count(ctx: Context, base: str) -> dict[str, Any]:
    """Instructions per request of each segment, and each ÷ its door's floor
    (the asyncpg floor for ASGI: the faster driver's, as in the rounds)."""
    from . import instructions

    missing = instructions.available()
    if missing:
        return {"missing": missing}
    n = ctx.size(instructions.FULL_N, instructions.QUICK_N)
    schema = f"idemctl_bench_cg_{os.getpid()}"
    create_schema(base, schema)
    out_dir = os.path.join(ctx.workdir or tempfile.mkdtemp(prefix="idemctl-bench-"), "callgrind-postgres")
    ctx.log(f"  [pg_instructions] callgrind over {n} requests a segment")
    child = ["bench.pg_instructions", "--callgrind-child", base, schema, str(n), "quick" if ctx.quick else "full"]
    try:
        rows = instructions.rows_against_floors(
            out_dir,
            child,
            ":",
            lambda door, kind: f"{door}:{'floor-asyncpg' if door == 'asgi' else 'floor'}:{kind}",
            parts_of=("asgi:idemctl:first", "asgi:idemctl:replay"),
        )
    finally:
        drop_schema(base, schema)
    counted = census(base, 3 if ctx.quick else CENSUS_N)
    return {"requests_per_segment": n, "rows": rows, "census": counted}


CENSUS_N = 20


def census(base: str, n: int = CENSUS_N) -> dict[str, dict[str, float]]:
    """Python functions entered per ASGI request (first call, replay) on
    asyncpg, by package, and the event loop's turns: what callgrind's
    instructions are spent running (a generator's or coroutine's resumption
    counts as an entry). Counted with sys.setprofile, in this process, on a schema of its own."""
    from collections import Counter

    from idemctl import Ledger

    out: dict[str, dict[str, float]] = {}

    roots = package_roots([(name, name) for name in ("idemctl", "asyncpg", "asyncio")])
    rest = "the rest (the bench's caller and app, selectors, ...)"

    async def run() -> None:
        ledger = Ledger.open(url)
        ledger.init()
        app = idemctl_asgi(ledger)

        async def via(key: str) -> None:
            status, _ = await call_asgi(app, key, lambda: STORED_1K)
            if status != 201:
                raise AssertionError(f"{key}: {status}")

        floors = Floors(url, asyncpg_url(base, schema), 2, SEEDS)
        await floors.open()
        for i in range(SEEDS):
            await via(f"census-seed-{i}")
            await floors.path("asyncpg", "first")(i, "seed")
        for system, kind in [(system, kind) for system in ("idemctl", "floor-asyncpg") for kind in KINDS]:
            entered: Counter[str] = Counter()
            turns = 0
            one: Callable[[int], Awaitable[None]]
            if system == "idemctl":
                one = (lambda i: via(f"census-{i}")) if kind == "first" else (lambda i: via(f"census-seed-{i % SEEDS}"))
            else:
                raw = floors.path("asyncpg", kind)
                one = functools.partial(raw, tag="census")

            def profile(frame: Any, event: str, arg: Any) -> None:
                nonlocal turns
                if event == "call":
                    entered[package_of(frame.f_code.co_filename, roots, rest)] += 1
                    turns += frame.f_code.co_name == "_run_once"

            # Nothing of the last segment's left on the loop: its sweeps, and
            # the deadline watcher, which ends a tick after the last statement.
            await app.wait_idle()
            await asyncio.sleep(3 * TICK_S)
            sys.setprofile(profile)
            try:
                for i in range(n):
                    await one(i)
            finally:
                sys.setprofile(None)
            counts = {k: round(v / n, 1) for k, v in entered.most_common()}
            out[f"{system}:{kind}"] = {**counts, "event-loop turns": round(turns / n, 1)}
        await floors.close()
        await app.wait_idle()
        await ledger.aclose()
        ledger.close()

    schema = f"idemctl_bench_census_{os.getpid()}"
    url = psycopg_url(base, schema)
    create_schema(base, schema)
    try:
        asyncio.run(run())
    finally:
        drop_schema(base, schema)
    return out


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--callgrind-child"]:  # base, schema, n, quick|full, manifest: run by count()
        _child(argv[1], argv[2], int(argv[3]), argv[4] == "quick", argv[5])
        return
    base = os.environ.get("IDEMCTL_BENCH_POSTGRES_URL", DEFAULT_BASE)
    ctx = Context(workdir=tempfile.mkdtemp(prefix="idemctl-bench-"), quick="--quick" in argv, log=_stderr)
    print(json.dumps(count(ctx, base), indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
