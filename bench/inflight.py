"""(8)/(10) ASGI + PostgreSQL with requests in flight: idemctl's and idemkit's
ASGI middleware on the same PostgreSQL, the same app, the same 1 KiB
requests and answers, driven in-process on one event loop with 1, 10 and 50
requests in flight (that many callers, each sending its next request as soon
as its last is answered), against two raw async floors: idemctl's own
statements (a first call: the claim and the fenced completion; a replay: the
claim that finds the key and reads its row in the same statement) on
psycopg's AsyncConnection from an AsyncConnectionPool, and on asyncpg, each
with as many connections as idemctl's pool. The faster floor is the limit
every ratio is taken against. idemctl runs around a bare ASGI app and around
a FastAPI app, on the driver it chooses (asyncpg when installed), and around
the bare app on psycopg's store (async_driver=psycopg). Every variant runs
once per round, in rotating order, so that drift hits all of them; the
figure is the median round.

Profile: where the time of idemctl's requests and the floor's goes at 10
in flight (cProfile's internal time by package), after the rounds.

Instructions: the same paths one request at a time under callgrind
(bench/pg_instructions.py), with the synchronous `handle` beside them.

Event-loop lag: a ticker coroutine sleeping 1 ms on the same loop, while 50
first calls are in flight through idemctl's middleware, with the ledger's
statements awaited on the loop, then handed to the default executor."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from idemctl import Ledger

from . import pg_instructions
from .common import STORED_1K, Context, package_of, package_roots, percentile, spread
from .peers_systems import (
    asyncpg_url,
    call_asgi,
    deprovision,
    idemctl_asgi,
    idemkit_asgi,
    idemkit_asgi_on,
    missing,
    new_tag,
    principal_header,
    provision,
    psycopg_url,
    spec_for,
    versions,
)
from .pg_floors import DRIVERS, Floors

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


# The profile's groups: each package's own folder, wherever it is installed
# (a checkout folder may itself be named idemctl or redis).
PACKAGES = (
    ("idemctl", "idemctl"),
    ("psycopg_pool", "psycopg_pool"),
    ("psycopg", "psycopg"),
    ("asyncpg", "asyncpg"),
    ("redis", "redis-py"),
    ("asyncio", "asyncio"),
    ("bench", "the bench's caller and app"),
)


def _group(filename: str, name: str, roots: Sequence[tuple[str, str]]) -> str:
    if filename == "~":
        return "waiting for the server (epoll)" if "epoll" in name or "select" in name else "C calls and the rest"
    return package_of(filename, roots, "other Python")


async def _profile(n: int, level: int, one: Go, first: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """Where the time of `n` requests at `level` in flight goes (cProfile,
    internal time by package; `first`: (module name, group) pairs for
    packages besides the usual ones, or parts of them), and idemctl's own
    heaviest functions."""
    import cProfile
    import pstats

    roots = package_roots([*first, *PACKAGES])
    ours_root = next((root for root, group in package_roots(PACKAGES[:1])), None)
    profiler = cProfile.Profile()
    profiler.enable()
    await _in_flight(n, level, one)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    total = sum(tt for (_, _, tt, _, _) in stats.values()) or 1.0
    groups: dict[str, float] = {}
    ours: list[tuple[float, str]] = []
    for (filename, line, name), (_, _, tt, _, _) in stats.items():
        group = _group(filename, name, roots)
        groups[group] = groups.get(group, 0.0) + tt
        if ours_root is not None and filename.startswith(ours_root):
            ours.append((tt, f"{filename[len(ours_root) :]}:{line}({name})"))
    ours.sort(reverse=True)
    return {
        "us_per_request": round(total / n * 1e6, 1),
        "share": {g: round(t / total, 3) for g, t in sorted(groups.items(), key=lambda kv: -kv[1])},
        "idemctl_top": [{"function": f, "us_per_request": round(t / n * 1e6, 1)} for t, f in ours[:8]],
    }


# The systems measured against the drivers' floors (pg_floors.py): idemctl's
# ASGI middleware around a bare ASGI app and around a FastAPI app (on the
# driver idemctl chooses, asyncpg when installed), the same on psycopg's
# asynchronous store (async_driver=psycopg: the path before asyncpg), and
# idemkit's ASGI middleware around the same two apps.
KINDS = ("first", "replay")


def fastapi_app() -> Any:
    """A FastAPI app answering the measured request as the bare app does."""
    from fastapi import FastAPI, Request, Response

    from .common import REQUEST_PATH
    from .peers_systems import HANDLER_KEY

    app = FastAPI()

    async def create_order(request: Request) -> Response:
        await request.body()
        return Response(request.scope[HANDLER_KEY](), status_code=201, media_type="application/json")

    # Resolved here: the module's annotations are strings FastAPI would look up in its globals.
    create_order.__annotations__ = {"request": Request, "return": Response}
    app.post(REQUEST_PATH)(create_order)
    return app


async def _measure(ctx: Context, specs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from idemctl.asgi import IdempotencyMiddleware

    n, reps, seeds = ctx.size(600, 30), ctx.size(7, 1), ctx.size(100, 10)
    spec = specs["idemctl"]
    url = psycopg_url(spec["pg_base"], spec["schema"])
    ledger = Ledger.open(url)
    ledger.init()
    # The same ledger (its own schema) on psycopg's asynchronous store.
    on_psycopg = Ledger.open(url + "&async_driver=psycopg")
    ours = idemctl_asgi(ledger)
    systems: dict[str, Any] = {
        "idemctl": ours,
        "idemctl_fastapi": IdempotencyMiddleware(fastapi_app(), ledger, principal=principal_header),
        "idemctl_psycopg": idemctl_asgi(on_psycopg),
    }
    pool_size = ledger.store.engine.pool_max_size  # type: ignore[attr-defined]
    floors = Floors(url, asyncpg_url(spec["pg_base"], spec["schema"]), pool_size, seeds)
    await floors.open()
    kit = kit_backend = None
    if "idemkit" in specs:
        kit, kit_backend = idemkit_asgi(specs["idemkit"], pool_size)
        systems["idemkit"] = kit
        # Each FastAPI row sets idemctl beside idemkit around the same app.
        systems["idemkit_fastapi"] = idemkit_asgi_on(kit_backend, specs["idemkit"]["ttl_s"], fastapi_app())
    try:

        async def via(app: Any, key: str) -> None:
            status, body = await call_asgi(app, key, lambda: STORED_1K)
            if status != 201 or body != STORED_1K:
                raise AssertionError(f"{key}: {status} {body[:80]!r}")

        # `tag` names the round and level: every first call has a key of its own.
        paths: dict[str, Callable[[int, str], Awaitable[None]]] = {}
        for name, app in systems.items():
            for i in range(seeds):
                await via(app, f"{name}-seed-{i}")

            # Functions, not lambdas, so that their arguments have types; the
            # defaults bind this system's app and name, as the lambdas did.
            def first(i: int, tag: str, app: Any = app, name: str = name) -> Awaitable[None]:
                return via(app, f"{name}-{tag}-{i}")

            def replay(i: int, tag: str, app: Any = app, name: str = name) -> Awaitable[None]:
                return via(app, f"{name}-seed-{i % seeds}")

            paths[f"{name}_first"] = first
            paths[f"{name}_replay"] = replay
        for driver in DRIVERS:
            for i in range(seeds):
                await floors.path(driver, "first")(i, "seed")  # the keys the replay floor finds
            for kind in KINDS:
                paths[f"{driver}_{kind}"] = floors.path(driver, kind)

        bases = [*DRIVERS, *systems]
        names = [f"{base}_{kind}@{level}" for level in LEVELS for base in bases for kind in KINDS]
        rates: dict[str, list[float]] = {name: [] for name in names}
        # This process's CPU time per request (user and system), where one
        # request in flight leaves the client waiting on the server: what
        # each system adds to a request's wall time there.
        cpu_us: dict[str, list[float]] = {name: [] for name in names if name.endswith("@1")}
        for rep in range(reps):
            ctx.log(f"  [inflight] round {rep + 1}/{reps}")
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                path, level_text = name.split("@")
                go = paths[path]
                tag = f"{rep}-{level_text}"

                def one(i: int, go: Callable[[int, str], Awaitable[None]] = go, tag: str = tag) -> Awaitable[None]:
                    return go(i, tag)

                started = time.process_time()
                rates[name].append(await _in_flight(n, int(level_text), one))
                if name in cpu_us:
                    cpu_us[name].append((time.process_time() - started) / n * 1e6)
                await ours.wait_idle()
        profile = {
            "first": await _profile(n, 10, lambda i: via(ours, f"idemctl-profile-{i}")),
            "replay": await _profile(n, 10, lambda i: via(ours, f"idemctl-seed-{i % seeds}")),
        }
        for driver in DRIVERS:
            for kind in KINDS:
                go = floors.path(driver, kind)

                def profiled(i: int, go: Callable[[int, str], Awaitable[None]] = go) -> Awaitable[None]:
                    return go(i, "profile")

                profile[f"{driver}_{kind}"] = await _profile(n, 10, profiled)
        await ours.wait_idle()
        lag = await _lag_under(50, n, lambda i: via(ours, f"idemctl-lag-{i}"))
        await ours.wait_idle()
        # The same with the ledger's statements handed to the default
        # executor, as before the asynchronous store existed.
        own_store = ledger.async_store
        ledger.async_store = lambda: None  # type: ignore[method-assign]
        lag_threads = await _lag_under(50, n, lambda i: via(ours, f"idemctl-lag-threads-{i}"))
        ledger.async_store = own_store  # type: ignore[method-assign]
        async_store = ledger.async_store()  # opened by now: the rounds ran on this loop
        out: dict[str, Any] = {
            "rounds": reps,
            "requests_per_round": n,
            "pool_max_size": pool_size,
            "driver": type(async_store.engine).__name__ if async_store else "",
            "levels": {},
            "lag_50_first_ms": lag,
            "lag_50_first_threads_ms": lag_threads,
            "profile_10_in_flight": profile,
        }
        for level in LEVELS:
            row: dict[str, Any] = {}
            for kind in KINDS:
                cell: dict[str, Any] = {}
                for driver in DRIVERS:
                    cell[f"floor_{driver}"] = spread(rates[f"{driver}_{kind}@{level}"], 1)
                if level == 1:
                    cell["cpu_us"] = {base: spread(cpu_us[f"{base}_{kind}@1"], 0) for base in bases}
                # The limit: the faster driver's floor (its median), each
                # round's figure divided by that round's limit.
                limit = max(DRIVERS, key=lambda d: cell[f"floor_{d}"]["median"])
                floor = rates[f"{limit}_{kind}@{level}"]
                cell["limit"] = limit
                cell["floor"] = spread(floor, 1)
                for system in systems:
                    mine = rates[f"{system}_{kind}@{level}"]
                    cell[system] = spread(mine, 1)
                    cell[f"{system}_vs_floor"] = spread([a / b for a, b in zip(mine, floor, strict=True)])
                if kit is not None:
                    for system, peer in (("idemctl", "idemkit"), ("idemctl_fastapi", "idemkit_fastapi")):
                        mine, theirs = rates[f"{system}_{kind}@{level}"], rates[f"{peer}_{kind}@{level}"]
                        cell[f"{system}_vs_idemkit"] = spread([a / b for a, b in zip(mine, theirs, strict=True)])
                row[kind] = cell
            out["levels"][str(level)] = row
        return out
    finally:
        for system in systems.values():
            if hasattr(system, "wait_idle"):
                await system.wait_idle()
        await ledger.aclose()
        ledger.close()
        await on_psycopg.aclose()
        on_psycopg.close()
        await floors.close()
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
        # The same request paths in instructions, which hold on a busy machine too.
        out["instructions"] = pg_instructions.count(ctx, specs["idemctl"]["pg_base"])
    finally:
        for spec in specs.values():
            try:
                deprovision(spec)
            except Exception as exc:
                ctx.log(f"  [inflight] cleanup of {spec['system']} failed: {exc}")
    return {"versions": versions(), "gaps": gaps, **out}
