"""(10) Peers, side by side: idemkit on the same PostgreSQL through its WSGI
and ASGI middleware, and Powertools for AWS Lambda (`idempotent_function`,
Redis persistence layer) as a NON-durable reference: Redis here runs without
persistence, so a restart forgets every key.

Throughput: first calls and replays of the same request (1 KiB body, 1 KiB
stored answer) through each system's real entry point, driven in-process by
the same callers (bench/peers_systems.py), every variant once per round in
rotating order so that drift hits all of them. Each figure is also given as
a ratio to a floor measured in the same round: for PostgreSQL the raw psycopg
claim + fenced completion (a primary-key SELECT for replays), as (7) sends
them; for Redis a raw SET NX of the in-progress record + SET of the completed
one, of Powertools' sizes (a GET for replays). Latency percentiles are over
every request of every round.

Correctness facts (bench/peers_facts.py), with short TTLs: race duplicates,
recovery after a SIGKILL, a late writer after a takeover."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from idemctl import Ledger

from . import peers_facts
from .common import FINGERPRINT, RESPONSE_HEADERS_JSON, STORED_1K, Context, latency_summary, spread
from .peers_systems import (
    PRINCIPAL,
    IdemctlWsgi,
    IdemkitWsgi,
    Powertools,
    Reply,
    _counted,
    build,
    call_asgi,
    deprovision,
    idemctl_asgi,
    idemctl_function,
    idemkit_asgi,
    missing,
    new_tag,
    pg_base,
    provision,
    psycopg_url,
    redis_url,
    spec_for,
    versions,
)

# The rows of the table, in the order of each round before rotation: ours
# next to the peer on the same store and path.
ROWS: list[dict[str, Any]] = [
    {"id": "idemctl_wsgi", "system": "idemctl", "label": "idemctl, WSGI `IdempotencyMiddleware`", "floor": "postgres"},
    {"id": "idemkit_wsgi", "system": "idemkit", "label": "idemkit, `WSGIIdempotencyMiddleware`", "floor": "postgres"},
    {"id": "idemctl_asgi", "system": "idemctl", "label": "idemctl, ASGI `IdempotencyMiddleware`", "floor": "postgres"},
    {"id": "idemkit_asgi", "system": "idemkit", "label": "idemkit, ASGI `IdempotencyMiddleware`", "floor": "postgres"},
    {
        "id": "idemctl_function",
        "system": "idemctl",
        "label": "idemctl, `Ledger.idempotent` (a function)",
        "floor": "postgres",
    },
    {"id": "powertools", "system": "powertools", "label": "Powertools, `idempotent_function`", "floor": "redis"},
]
LATENCY_MS = ("p50_ms", "p99_ms", "max_ms")
Round = Callable[[int], Awaitable[list[float]]]


def _timed_loop(n: int, one: Callable[[int], object]) -> list[float]:
    lat = []
    for i in range(n):
        t0 = time.perf_counter()
        one(i)
        lat.append(time.perf_counter() - t0)
    return lat


def _in_thread(n: int, one: Callable[[int], object]) -> Round:
    """A round of blocking calls, off the loop: idemkit's WSGI bridge refuses
    to run on a thread whose event loop is running."""

    async def go(rep: int) -> list[float]:
        return await asyncio.get_running_loop().run_in_executor(None, _timed_loop, n, lambda i: one(rep * n + i))

    return go


def _on_loop(n: int, one: Callable[[int], Awaitable[object]]) -> Round:
    async def go(rep: int) -> list[float]:
        lat = []
        for i in range(n):
            t0 = time.perf_counter()
            await one(rep * n + i)
            lat.append(time.perf_counter() - t0)
        return lat

    return go


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


async def _throughput(ctx: Context, specs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    import psycopg
    import redis

    from idemctl.storage.dialect import POSTGRES
    from idemctl.storage.statements import CLAIM, COMPLETE, LOOKUP

    sql_claim, sql_complete, sql_lookup = (POSTGRES.params(s) for s in (CLAIM, COMPLETE, LOOKUP))
    n, n_replay, reps, seeds = ctx.size(200, 15), ctx.size(500, 30), ctx.size(7, 2), ctx.size(100, 10)
    closers: list[Callable[[], object]] = []
    loop = asyncio.get_running_loop()
    try:
        ours = IdemctlWsgi(specs["idemctl"])
        closers.append(ours.close)
        ledger: Ledger = ours.ledger
        raw = psycopg.connect(psycopg_url(specs["idemctl"]["pg_base"], specs["idemctl"]["schema"]), autocommit=True)
        raw.execute("SET lock_timeout = 5000")
        closers.append(raw.close)
        asgi_ours = idemctl_asgi(ledger)
        fn_ours = idemctl_function(ledger)

        def raw_pair(i: int) -> None:
            row = {"principal": PRINCIPAL, "key": f"raw-{i}", "token": i + 1}
            now = int(time.time() * 1000)
            gen = raw.execute(sql_claim, {**row, "fingerprint": FINGERPRINT, "now": now}).fetchall()[0][0]
            done = {
                "generation": gen,
                "status": 201,
                "body": STORED_1K,
                "headers": RESPONSE_HEADERS_JSON,
                "now": now + 1,
            }
            raw.execute(sql_complete, {**row, **done}).fetchall()

        def raw_lookup(i: int) -> None:
            raw.execute(sql_lookup, {"principal": PRINCIPAL, "key": f"seed-idemctl_wsgi-{i % seeds}"}).fetchall()

        rounds: dict[str, Round] = {
            "floor_postgres_first": _in_thread(n, raw_pair),
            "floor_postgres_replay": _in_thread(n_replay, raw_lookup),
        }

        def ours_fn_call(key: str) -> Reply:
            run, ran = _counted(None)
            out = fn_ours(request=Powertools.payload(key), handler=run)
            return Reply("ran" if ran else "replayed", out["status"], out["body"].encode("latin-1"))

        async def ours_asgi_call(key: str) -> tuple[int, bytes]:
            return await call_asgi(asgi_ours, key, lambda: STORED_1K)

        # Each path: its door, and its call, blocking or awaited (the other None).
        paths: dict[
            str, tuple[str, Callable[[str], object] | None, Callable[[str], Awaitable[tuple[int, bytes]]] | None]
        ] = {
            "idemctl_wsgi": ("wsgi", lambda key: ours.call(key), None),
            "idemctl_asgi": ("asgi", None, ours_asgi_call),
            "idemctl_function": ("fn", ours_fn_call, None),
        }
        if "idemkit" in specs:
            kit = IdemkitWsgi(specs["idemkit"])
            closers.append(kit.close)
            asgi_kit, kit_backend = idemkit_asgi(specs["idemkit"])

            async def kit_asgi_call(key: str) -> tuple[int, bytes]:
                return await call_asgi(asgi_kit, key, lambda: STORED_1K)

            paths["idemkit_wsgi"] = ("wsgi", lambda key: kit.call(key), None)
            paths["idemkit_asgi"] = ("asgi", None, kit_asgi_call)
        if "powertools" in specs:
            pt = Powertools(specs["powertools"])
            closers.append(pt.close)
            rclient = redis.Redis.from_url(specs["powertools"]["redis_url"])
            closers.append(rclient.close)
            prefix = specs["powertools"]["prefix"]
            expiry = int(time.time()) + 3600
            # Powertools' two records, byte for byte in size: in progress, then completed.
            in_progress = json.dumps({"status": "INPROGRESS", "expiration": expiry})
            completed = json.dumps(
                {
                    "data": json.dumps({"status": 201, "body": STORED_1K.decode()}, sort_keys=True),
                    "status": "COMPLETED",
                    "expiration": expiry,
                }
            )

            def redis_name(i: int, kind: str) -> str:
                return f"{prefix}-floor#{hashlib.md5(f'{kind}-{i}'.encode()).hexdigest()}"

            def redis_pair(i: int) -> None:
                name = redis_name(i, "raw")
                _expect(bool(rclient.set(name, in_progress, ex=3600, nx=True)), "raw SET NX found the key taken")
                rclient.set(name, completed, ex=3600)

            def redis_get(i: int) -> None:
                rclient.get(redis_name(i % seeds, "seed"))

            for i in range(seeds):
                rclient.set(redis_name(i, "seed"), completed, ex=3600)
            rounds["floor_redis_first"] = _in_thread(n, redis_pair)
            rounds["floor_redis_replay"] = _in_thread(n_replay, redis_get)
            paths["powertools"] = ("fn", lambda key: pt.call(key), None)

        # Completed keys to replay, made through each path itself (the same
        # fingerprint); then, once per path outside the timing, a first call
        # runs and its retry is replayed.
        for rid, (_, blocking, awaiting) in paths.items():
            for i in range(seeds):
                if blocking is not None:
                    await loop.run_in_executor(None, blocking, f"seed-{rid}-{i}")
                else:
                    assert awaiting is not None
                    await awaiting(f"seed-{rid}-{i}")
            for expected in ("ran", "replayed"):
                if blocking is not None:
                    reply = await loop.run_in_executor(None, blocking, f"check-{rid}")
                    _expect(getattr(reply, "kind", None) == expected, f"{rid}: {expected} expected, got {reply!r}")
                else:
                    assert awaiting is not None
                    status, body = await awaiting(f"check-{rid}")
                    _expect(status == 201 and body == STORED_1K, f"{rid}: {status} {body[:80]!r}")
            # Functions, not lambdas, so that their arguments have types; the
            # defaults bind this path's call and id, as the lambdas did.
            if blocking is not None:
                b = blocking

                def b_first(i: int, b: Callable[[str], object] = b, rid: str = rid) -> object:
                    return b(f"{rid}-{i}")

                def b_replay(i: int, b: Callable[[str], object] = b, rid: str = rid) -> object:
                    return b(f"seed-{rid}-{i % seeds}")

                rounds[f"{rid}_first"] = _in_thread(n, b_first)
                rounds[f"{rid}_replay"] = _in_thread(n_replay, b_replay)
            else:
                assert awaiting is not None
                a = awaiting

                def a_first(i: int, a: Callable[[str], Awaitable[object]] = a, rid: str = rid) -> Awaitable[object]:
                    return a(f"{rid}-{i}")

                def a_replay(i: int, a: Callable[[str], Awaitable[object]] = a, rid: str = rid) -> Awaitable[object]:
                    return a(f"seed-{rid}-{i % seeds}")

                rounds[f"{rid}_first"] = _on_loop(n, a_first)
                rounds[f"{rid}_replay"] = _on_loop(n_replay, a_replay)

        order = ["floor_postgres"] + [r["id"] for r in ROWS if r["id"] in paths and r["floor"] == "postgres"]
        order += ["floor_redis", "powertools"] if "powertools" in paths else []
        names = [f"{base}_{kind}" for base in order for kind in ("first", "replay")]
        rates: dict[str, list[float]] = {name: [] for name in names}
        latencies: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(reps):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                t0 = time.perf_counter()
                lat = await rounds[name](rep)
                rates[name].append(len(lat) / (time.perf_counter() - t0))
                latencies[name] += lat
        if "idemkit" in specs:
            await kit_backend.aclose()
        await asgi_ours.wait_idle()

        def figure(name: str, floor: str) -> dict[str, Any]:
            lat = latency_summary(latencies[name])
            return {
                "ops_per_s": spread(rates[name], 1),
                "ratio": spread([a / b for a, b in zip(rates[name], rates[floor])]),
                "latency": {k: lat[k] for k in ("count", *LATENCY_MS)},
            }

        floors = {}
        for floor in ("postgres", "redis"):
            if f"floor_{floor}_first" in rates:
                floors[floor] = {
                    kind: {
                        "ops_per_s": spread(rates[f"floor_{floor}_{kind}"], 1),
                        "latency": {
                            k: v
                            for k, v in latency_summary(latencies[f"floor_{floor}_{kind}"]).items()
                            if k in ("count", *LATENCY_MS)
                        },
                    }
                    for kind in ("first", "replay")
                }
        rows = []
        for row in ROWS:
            if row["id"] not in paths:
                continue
            fl = f"floor_{row['floor']}"
            rows.append(
                {
                    **row,
                    "durable": row["system"] != "powertools",
                    "first": figure(f"{row['id']}_first", f"{fl}_first"),
                    "replay": figure(f"{row['id']}_replay", f"{fl}_replay"),
                }
            )
        return {
            "rounds": reps,
            "requests_per_round": {"first": n, "replay": n_replay, "replay_keys": seeds},
            "floors": floors,
            "rows": rows,
        }
    finally:
        for close in reversed(closers):
            try:
                close()
            except Exception as exc:  # a failed close must not hide the figures or the other cleanups
                ctx.log(f"  [peers] close failed: {exc}")


def _facts(ctx: Context, tag: str, gaps: dict[str, str]) -> dict[str, Any]:
    ttl = ctx.size(2, 1)
    out: dict[str, Any] = {}
    for name in ("idemctl", "idemkit", "powertools"):
        if name in gaps:
            continue
        # A duplicate that finds idemkit's key claimed waits for it (10 s by
        # default); the recovery poll keeps that wait short so that it
        # measures the lease, not the wait.
        spec = spec_for(name, tag, ttl, purpose="facts")
        provision(spec)
        try:
            system = build(spec)
            try:
                race = peers_facts.race(system)
                late = peers_facts.late_writer(system, ttl)
            finally:
                system.close()
            recovery = peers_facts.recovery({**spec, "wait_s": 0.1 if name == "idemkit" else None})
            facts: dict[str, Any] = {"race": race, "recovery": recovery, "late_writer": late}
            if name == "powertools":
                facts["replay_with_validation"] = peers_facts.replay_with_validation(spec)
            if name == "idemkit":
                facts["in_progress_wait_s"] = {"default": 10.0, "race": 10.0, "recovery": 0.1}
            out[name] = facts
            ctx.log(
                f"  [peers] {name}: race {race['executions']} run(s) of {race['threads']}, "
                f"recovery {recovery['recovered_s']} s (TTL {ttl} s), late writer stored {late['stored_after_a']}"
            )
        finally:
            deprovision(spec)
    return out


def _servers(gaps: dict[str, str]) -> dict[str, Any]:
    import psycopg

    out: dict[str, Any] = {}
    with psycopg.connect(pg_base(), autocommit=True, connect_timeout=5) as conn:
        out["postgres"] = {
            name: conn.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[index]
            for name in ("server_version", "synchronous_commit", "fsync")
        }
    if "powertools" not in gaps:
        import redis

        client = redis.Redis.from_url(redis_url(), decode_responses=True)
        try:
            config = {**client.config_get("save"), **client.config_get("appendonly")}
            out["redis"] = {
                "version": client.info("server")["redis_version"],
                "save": config.get("save", ""),
                "appendonly": config.get("appendonly", ""),
                "persistence": bool(config.get("save")) or config.get("appendonly") == "yes",
            }
        finally:
            client.close()
    return out


def run(ctx: Context) -> dict[str, Any]:
    gaps = missing()
    if "idemctl" in gaps:
        return {"missing": gaps["idemctl"]}
    if "idemkit" in gaps and "powertools" in gaps:
        return {"missing": "no peer is installed: pip install -e '.[bench]'"}
    try:
        servers = _servers(gaps)
    except Exception as exc:
        return {"missing": f"a store is unreachable: {str(exc).splitlines()[0]}"}
    tag = new_tag()
    out: dict[str, Any] = {"versions": versions(), "servers": servers, "gaps": gaps}
    ctx.log("[peers] throughput, alternated rounds")
    specs = {name: spec_for(name, tag, 30.0) for name in ("idemctl", "idemkit", "powertools") if name not in gaps}
    if "powertools" in specs:
        specs["powertools"]["ttl_s"] = 3600  # its default expiry: a replay window, as ours is
    try:
        for spec in specs.values():
            provision(spec)
        out["throughput"] = asyncio.run(_throughput(ctx, specs))
    finally:
        for spec in specs.values():
            try:
                deprovision(spec)
            except Exception as exc:  # the figures stand; the leftover is named
                ctx.log(f"  [peers] cleanup of {spec['system']} failed: {exc}")
    ctx.log("[peers] correctness facts")
    out["facts"] = _facts(ctx, tag, gaps)
    return out
