"""(8)/(10) ASGI + PostgreSQL with requests in flight: idemctl's and idemkit's
ASGI middleware on the same PostgreSQL, the same app, the same 1 KiB
requests and answers, driven in-process on one event loop with 1, 10 and 50
requests in flight (that many callers, each sending its next request as soon
as its last is answered), against the raw async floor: psycopg's
AsyncConnection from an AsyncConnectionPool of the same size as idemctl's,
running the statements idemctl runs (a first call: the claim and the fenced
completion; a replay: the claim that finds the key and reads its row in the
same statement). Every variant runs once per round, in rotating order, so that
drift hits all of them; the figure is the median round.

Profile: where the time of idemctl's requests and the floor's goes at 10
in flight (cProfile's internal time by package), after the rounds.

Event-loop lag: a ticker coroutine sleeping 1 ms on the same loop, while 50
first calls are in flight through idemctl's middleware, with the ledger's
statements awaited on the loop, then handed to the default executor."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from idemctl import Ledger

from .common import FINGERPRINT, RESPONSE_HEADERS_JSON, STORED_1K, Context, percentile, spread
from .peers_systems import (
    PRINCIPAL,
    call_asgi,
    deprovision,
    idemctl_asgi,
    idemkit_asgi,
    missing,
    new_tag,
    provision,
    psycopg_url,
    spec_for,
    versions,
)

LEVELS = (1, 10, 50)
TICK_S = 0.001
Go = Callable[[int], Awaitable[object]]


async def _in_flight(n: int, level: int, one: Go) -> float:
    """`n` requests by `level` callers at once; requests per second."""
    counter = iter(range(n))

    async def caller() -> None:
        for i in counter:
            await one(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(level)))
    return n / (time.perf_counter() - t0)


async def _lag_under(level: int, n: int, one: Go) -> dict[str, float]:
    lags: list[float] = []
    done = False

    async def ticker() -> None:
        while not done:
            t0 = time.perf_counter()
            await asyncio.sleep(TICK_S)
            lags.append((time.perf_counter() - t0 - TICK_S) * 1000)

    tick = asyncio.ensure_future(ticker())
    await _in_flight(n, level, one)
    done = True
    await tick
    lags.sort()
    return {"p50_ms": percentile(lags, 50), "p99_ms": percentile(lags, 99), "max_ms": lags[-1] if lags else 0.0}


def _group(filename: str, name: str, first: Sequence[tuple[str, str]] = ()) -> str:
    if filename == "~" and ("epoll" in name or "select" in name):
        return "waiting for the server (epoll)"
    for part, group in (
        *first,
        ("/idemctl/", "idemctl"),
        ("/psycopg_pool/", "psycopg_pool"),
        ("/psycopg/", "psycopg"),
        ("-packages/redis/", "redis-py"),  # site- or dist-packages: not a checkout's folder named redis
        ("/asyncio/", "asyncio"),
        ("/bench/", "the bench's caller and app"),
    ):
        if part in filename:
            return group
    return "C calls and the rest" if filename == "~" else "other Python"


async def _profile(n: int, level: int, one: Go, first: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """Where the time of `n` requests at `level` in flight goes (cProfile,
    internal time by package; `first`: (path part, group) pairs tried before
    the usual ones), and idemctl's own heaviest functions."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    await _in_flight(n, level, one)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    total = sum(tt for (_, _, tt, _, _) in stats.values()) or 1.0
    groups: dict[str, float] = {}
    ours: list[tuple[float, str]] = []
    for (filename, line, name), (_, _, tt, _, _) in stats.items():
        group = _group(filename, name, first)
        groups[group] = groups.get(group, 0.0) + tt
        if "/idemctl/" in filename:
            ours.append((tt, f"{filename.rsplit('/idemctl/', 1)[-1]}:{line}({name})"))
    ours.sort(reverse=True)
    return {
        "us_per_request": round(total / n * 1e6, 1),
        "share": {g: round(t / total, 3) for g, t in sorted(groups.items(), key=lambda kv: -kv[1])},
        "idemctl_top": [{"function": f, "us_per_request": round(t / n * 1e6, 1)} for t, f in ours[:8]],
    }


async def _measure(ctx: Context, specs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    import psycopg
    from psycopg_pool import AsyncConnectionPool

    from idemctl.storage.dialect import POSTGRES
    from idemctl.storage.statements import CLAIM, CLAIM_OR_READ, COMPLETE

    sql_claim, sql_complete, sql_claim_or_read = (POSTGRES.params(s) for s in (CLAIM, COMPLETE, CLAIM_OR_READ))
    n, reps, seeds = ctx.size(600, 30), ctx.size(5, 1), ctx.size(100, 10)
    spec = specs["idemctl"]
    ledger = Ledger.open(psycopg_url(spec["pg_base"], spec["schema"]))
    ledger.init()
    ours = idemctl_asgi(ledger)
    pool_size = ledger.store.engine.pool_max_size  # type: ignore[attr-defined]
    floor_pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] = AsyncConnectionPool(
        psycopg_url(spec["pg_base"], spec["schema"]),
        kwargs={"autocommit": True},
        min_size=0,
        max_size=pool_size,
        open=False,
    )
    await floor_pool.open()
    kit = kit_backend = None
    if "idemkit" in specs:
        kit, kit_backend = idemkit_asgi(specs["idemkit"])
    try:
        # `tag` names the round and level: every first call has a key of its own.
        async def floor_first(i: int, tag: str) -> None:
            row = {"principal": PRINCIPAL, "key": f"raw-{tag}-{i}", "token": i + 1}
            now = int(time.time() * 1000)
            async with floor_pool.connection() as conn:
                cur = await conn.execute(sql_claim, {**row, "fingerprint": FINGERPRINT, "now": now})
                gen = (await cur.fetchall())[0][0]
            done = {"generation": gen, "status": 201, "body": STORED_1K, "headers": RESPONSE_HEADERS_JSON, "now": now}
            async with floor_pool.connection() as conn:
                await (await conn.execute(sql_complete, {**row, **done})).fetchall()

        async def floor_replay(i: int, tag: str) -> None:
            row = {"principal": PRINCIPAL, "key": f"raw-seed-{i % seeds}"}
            now = int(time.time() * 1000)
            async with floor_pool.connection() as conn:
                claim = {**row, "token": 1, "fingerprint": FINGERPRINT, "now": now}
                found = await (await conn.execute(sql_claim_or_read, claim)).fetchall()
            assert found and found[0][0] is None, "the floor's replay claimed a new key"

        async def via(app: Any, key: str) -> None:
            status, body = await call_asgi(app, key, lambda: STORED_1K)
            if status != 201 or body != STORED_1K:
                raise AssertionError(f"{key}: {status} {body[:80]!r}")

        paths: dict[str, Callable[[int, str], Awaitable[None]]] = {}
        systems: dict[str, Any] = {"idemctl": ours}
        if kit is not None:
            systems["idemkit"] = kit
        for name, app in systems.items():
            for i in range(seeds):
                await via(app, f"{name}-seed-{i}")
            paths[f"{name}_first"] = lambda i, tag, app=app, name=name: via(app, f"{name}-{tag}-{i}")
            paths[f"{name}_replay"] = lambda i, tag, app=app, name=name: via(app, f"{name}-seed-{i % seeds}")
        for i in range(seeds):
            await floor_first(i, "seed")  # the keys raw-seed-i the replay floor finds
        paths["floor_first"] = floor_first
        paths["floor_replay"] = floor_replay

        names = [
            f"{base}_{kind}@{level}" for level in LEVELS for base in ("floor", *systems) for kind in ("first", "replay")
        ]
        rates: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(reps):
            ctx.log(f"  [inflight] round {rep + 1}/{reps}")
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                path, level = name.split("@")
                go = paths[path]
                tag = f"{rep}-{level}"
                rates[name].append(await _in_flight(n, int(level), lambda i, go=go, tag=tag: go(i, tag)))
                await ours.wait_idle()
        profile = {
            "first": await _profile(n, 10, lambda i: via(ours, f"idemctl-profile-{i}")),
            "replay": await _profile(n, 10, lambda i: via(ours, f"idemctl-seed-{i % seeds}")),
            "floor_first": await _profile(n, 10, lambda i: floor_first(i, "profile")),
            "floor_replay": await _profile(n, 10, lambda i: floor_replay(i, "profile")),
        }
        await ours.wait_idle()
        lag = await _lag_under(50, n, lambda i: via(ours, f"idemctl-lag-{i}"))
        await ours.wait_idle()
        # The same with the ledger's statements handed to the default
        # executor, as before the asynchronous store existed.
        own_store = ledger.async_store
        ledger.async_store = lambda: None
        lag_threads = await _lag_under(50, n, lambda i: via(ours, f"idemctl-lag-threads-{i}"))
        ledger.async_store = own_store
        out: dict[str, Any] = {
            "rounds": reps,
            "requests_per_round": n,
            "pool_max_size": pool_size,
            "levels": {},
            "lag_50_first_ms": lag,
            "lag_50_first_threads_ms": lag_threads,
            "profile_10_in_flight": profile,
        }
        for level in LEVELS:
            row: dict[str, Any] = {}
            for kind in ("first", "replay"):
                floor = rates[f"floor_{kind}@{level}"]
                cell: dict[str, Any] = {"floor": spread(floor, 1)}
                for system in systems:
                    mine = rates[f"{system}_{kind}@{level}"]
                    cell[system] = spread(mine, 1)
                    cell[f"{system}_vs_floor"] = spread([a / b for a, b in zip(mine, floor)])
                if "idemkit" in systems:
                    cell["idemctl_vs_idemkit"] = spread(
                        [a / b for a, b in zip(rates[f"idemctl_{kind}@{level}"], rates[f"idemkit_{kind}@{level}"])]
                    )
                row[kind] = cell
            out["levels"][str(level)] = row
        return out
    finally:
        await ours.wait_idle()
        await ledger.aclose()
        ledger.close()
        await floor_pool.close()
        if kit_backend is not None:
            await kit_backend.aclose()


def run(ctx: Context) -> dict[str, Any]:
    gaps = missing()
    if "idemctl" in gaps:
        return {"missing": gaps["idemctl"]}
    tag = new_tag()
    specs = {name: spec_for(name, tag, 30.0, purpose="inflight") for name in ("idemctl", "idemkit") if name not in gaps}
    try:
        for spec in specs.values():
            provision(spec)
        out = asyncio.run(_measure(ctx, specs))
    finally:
        for spec in specs.values():
            try:
                deprovision(spec)
            except Exception as exc:
                ctx.log(f"  [inflight] cleanup of {spec['system']} failed: {exc}")
    return {"versions": versions(), "gaps": gaps, **out}
