"""(8) The ASGI middleware, driven in-process by a minimal ASGI caller (no
server, no sockets), on one event loop.

Overhead: requests per second through `idemctl.asgi.IdempotencyMiddleware`
around a bare ASGI app, first calls with fresh keys and replays, against two
floors in alternating rounds on one file: the bare app alone (the framework
part) and `Ledger.handle` + `after_response` called in one executor thread
per request (the ledger part). The middleware's per-request work beyond both
floors is its own cost: reading the body, three hops to the executor instead
of one (`begin`, `finish`, the sweep), capturing and sending the answer.
With FastAPI installed, the same comparison around a FastAPI app, and for
`idemctl.fastapi.idempotent_route`, against the plain FastAPI app.

Event-loop lag: a ticker coroutine on the same loop sleeps 1 ms and records
how late it wakes, with no requests (the floor), then while 50 concurrent
protected first calls run through the middleware with ledger statements in
the default executor, then the same with ledger statements called on the
loop itself (what a naive adapter does)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from importlib import metadata
from typing import Any

from idemctl import Ledger, Outcome
from idemctl.asgi import ASGIApp
from idemctl.exchange.scope import Receive, Scope, Send

from .common import (
    BODY_1K,
    HEADERS,
    STORED_1K,
    Context,
    asgi_scope,
    call_asgi_scope,
    noop_mutation,
    percentile,
    spread,
)

PRINCIPAL = "acct_bench"
CONCURRENCY = 50
TICK_S = 0.001
_RESPONSE_HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(STORED_1K)).encode())]


def available() -> bool:
    try:
        from idemctl.asgi import IdempotencyMiddleware  # noqa: F401
    except ImportError:
        return False
    return True


def _fastapi_version() -> dict[str, str] | None:
    try:
        import fastapi  # noqa: F401

        import idemctl.fastapi  # noqa: F401
    except ImportError:
        return None
    return {name: metadata.version(name) for name in ("fastapi", "starlette", "pydantic")}


async def call(app: ASGIApp, key: str) -> tuple[int, bytes]:
    """One measured request through `app`; returns status and body sent."""
    return await call_asgi_scope(app, asgi_scope(key))


async def bare_app(scope: Scope, receive: Receive, send: Send) -> None:
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 201, "headers": _RESPONSE_HEADERS})
    await send({"type": "http.response.body", "body": STORED_1K})


class OnTheLoop(Executor):
    """Runs every call at once on the calling thread, i.e. on the event loop:
    what an adapter that calls a synchronous ledger from async code does."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future


class Counting(Executor):
    """Counts the calls handed to a thread pool: how many times a request
    crosses from the loop to a worker thread and back."""

    def __init__(self) -> None:
        self.calls = 0
        self._pool = ThreadPoolExecutor(1)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.calls += 1
        return self._pool.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._pool.shutdown(wait, cancel_futures=cancel_futures)


async def _hand_offs(ledger: Ledger) -> dict[str, int]:
    """Hand-offs to the executor per first call and per replay."""
    from idemctl.asgi import IdempotencyMiddleware

    counting = Counting()
    mw = IdempotencyMiddleware(bare_app, ledger, principal=lambda scope: PRINCIPAL, executor=counting)
    out = {}
    for name in ("first", "replay"):
        before = counting.calls
        assert await call(mw, "hand-offs") == (201, STORED_1K)
        await mw.wait_idle()
        out[name] = counting.calls - before
    counting.shutdown()
    return out


def _fastapi_apps(ledger: Ledger) -> tuple[ASGIApp, ASGIApp]:
    """A plain FastAPI app with one POST endpoint, and the same endpoint
    under `idempotent_route` (the principal from a dependency)."""
    from fastapi import APIRouter, Depends, FastAPI, Request, Response

    from idemctl.fastapi import idempotent_route

    def current_account() -> str:
        return PRINCIPAL

    async def create_order(request: Request, account: str = Depends(current_account)) -> Response:
        await request.body()
        return Response(STORED_1K, status_code=201, media_type="application/json")

    # FastAPI reads parameters from annotations; this module's are strings
    # naming imports local to this function, which it could not resolve.
    create_order.__annotations__ = {"request": Request, "account": str, "return": Response}

    plain = FastAPI()
    plain.post("/orders", status_code=201)(create_order)
    router = APIRouter(route_class=idempotent_route(ledger, principal=current_account))
    router.post("/orders", status_code=201)(create_order)
    routed = FastAPI()
    routed.include_router(router)
    return plain, routed


async def _rounds(
    reps: int, variants: dict[str, tuple[int, Callable[[int], Awaitable[None]]]]
) -> dict[str, list[float]]:
    """Each variant once per round, their order rotating; requests per second."""
    names = list(variants)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            count, fn = variants[name]
            t0 = time.perf_counter()
            await fn(rep)
            rates[name].append(count / (time.perf_counter() - t0))
    return rates


def _against(ours: list[float], ledger: list[float], bare: list[float]) -> dict[str, Any]:
    """Ours against both floors of the same round; `both` is the two floors'
    times added up, so what is left over is the adapter's own cost."""
    both = [1 / lf + 1 / bf for lf, bf in zip(ledger, bare)]
    return {
        "ops_per_s": spread(ours, 1),
        "ratio_to_ledger": spread([o / lf for o, lf in zip(ours, ledger)]),
        "ratio_to_bare": spread([o / bf for o, bf in zip(ours, bare)], 4),
        "ratio_to_both": spread([o * t for o, t in zip(ours, both)]),
        "overhead_us": spread([(1 / o - t) * 1e6 for o, t in zip(ours, both)], 1),
    }


async def _overhead(ctx: Context, synchronous: str) -> dict[str, Any]:
    """Under NORMAL, where an fsync no longer hides the Python, also the
    decomposition (the same middleware with its ledger calls made on the
    loop, against `handle` called directly) and the FastAPI comparison."""
    from idemctl.asgi import IdempotencyMiddleware

    detail = synchronous == "NORMAL"
    # Short rounds and more of them under FULL: the fsync's cost drifts with
    # whatever else writes to the disk, and alternating finely pairs it better.
    n = ctx.size(300 if synchronous == "FULL" else 1500, 40)
    reps = ctx.size(11 if synchronous == "FULL" else 5, 2)
    n_replay = ctx.size(2000, 40)
    n_bare = ctx.size(20000, 200)  # microseconds each: more of them to time reliably
    keys = ctx.size(500, 20)
    path = ctx.path(f"asgi-{synchronous.lower()}.db")
    ledger = Ledger.open(path, synchronous=synchronous)
    ledger.init()
    loop = asyncio.get_running_loop()
    mw = IdempotencyMiddleware(bare_app, ledger, principal=lambda scope: PRINCIPAL)

    for i in range(keys):
        assert await call(mw, f"done-{i}") == (201, STORED_1K)
    await mw.wait_idle()
    assert await call(mw, "done-0") == (201, STORED_1K)
    # The ledger floor replays the middleware's keys: same fingerprint, same work.
    replayed = ledger.handle(PRINCIPAL, "done-0", "POST", "/orders", HEADERS, BODY_1K, noop_mutation)
    assert replayed.outcome is Outcome.REPLAYED and replayed.body == STORED_1K, replayed
    hand_offs = await _hand_offs(ledger)

    def ledger_request(key: str) -> None:
        ledger.after_response(ledger.handle(PRINCIPAL, key, "POST", "/orders", HEADERS, BODY_1K, noop_mutation))

    async def bare(rep: int) -> None:
        for i in range(n_bare):
            await call(bare_app, f"bare-{rep}-{i}")

    async def ledger_first(rep: int) -> None:
        for i in range(n):
            await loop.run_in_executor(None, ledger_request, f"lib-{rep}-{i}")

    async def ledger_replay(rep: int) -> None:
        for i in range(n_replay):
            await loop.run_in_executor(None, ledger_request, f"done-{i % keys}")

    async def ledger_direct(rep: int) -> None:
        for i in range(n):
            ledger_request(f"dir-{rep}-{i}")

    async def hop(rep: int) -> None:
        for _ in range(n_bare // 4):
            await loop.run_in_executor(None, int)

    def through(
        app: ASGIApp, prefix: str, count: int, replay: bool, waiter: Any = None
    ) -> Callable[[int], Awaitable[None]]:
        async def go(rep: int) -> None:
            for i in range(count):
                await call(app, f"done-{i % keys}" if replay else f"{prefix}-{rep}-{i}")
            if waiter is not None:
                await waiter.wait_idle()  # the post-response sweeps belong to the round that caused them

        return go

    variants: dict[str, tuple[int, Callable[[int], Awaitable[None]]]] = {
        "bare": (n_bare, bare),
        "ledger_first": (n, ledger_first),
        "middleware_first": (n, through(mw, "mw", n, False, mw)),
        "ledger_replay": (n_replay, ledger_replay),
        "middleware_replay": (n_replay, through(mw, "mw", n_replay, True, mw)),
        "executor_hop": (n_bare // 4, hop),
    }
    versions = _fastapi_version() if detail else None
    if detail:
        on_loop = IdempotencyMiddleware(bare_app, ledger, principal=lambda scope: PRINCIPAL, executor=OnTheLoop())
        assert await call(on_loop, "check-on-loop") == (201, STORED_1K)
        variants["ledger_direct_first"] = (n, ledger_direct)
        variants["on_loop_first"] = (n, through(on_loop, "ol", n, False))
    if versions is not None:
        plain, routed = _fastapi_apps(ledger)
        around = IdempotencyMiddleware(plain, ledger, principal=lambda scope: PRINCIPAL)
        assert await call(plain, "check") == (201, STORED_1K)
        for app in (around, routed):
            for key in (f"check-{id(app)}", f"check-{id(app)}", "done-0"):
                assert await call(app, key) == (201, STORED_1K)
        await around.wait_idle()
        # Starlette runs the route's post-response sweep before the app call returns.
        variants.update(
            {
                "fastapi": (n_replay, through(plain, "fa", n_replay, False)),
                "fastapi_middleware_first": (n, through(around, "fam", n, False, around)),
                "fastapi_route_first": (n, through(routed, "far", n, False)),
                "fastapi_middleware_replay": (n_replay, through(around, "fam", n_replay, True, around)),
                "fastapi_route_replay": (n_replay, through(routed, "far", n_replay, True)),
            }
        )
    rates = await _rounds(reps, variants)
    await mw.wait_idle()
    ledger.close()
    out: dict[str, Any] = {
        "synchronous": synchronous,
        "rounds": reps,
        "requests_per_round": {"first": n, "replay": n_replay, "bare": n_bare},
        "bare_ops_per_s": spread(rates["bare"], 1),
        "ledger_first_ops_per_s": spread(rates["ledger_first"], 1),
        "ledger_replay_ops_per_s": spread(rates["ledger_replay"], 1),
        "executor_hop_us": spread([1e6 / r for r in rates["executor_hop"]], 1),
        "hand_offs_per_request": {**hand_offs, "floor": 1},
        "first": _against(rates["middleware_first"], rates["ledger_first"], rates["bare"]),
        "replay": _against(rates["middleware_replay"], rates["ledger_replay"], rates["bare"]),
    }
    if detail:
        out["on_loop"] = {
            "ledger_direct_ops_per_s": spread(rates["ledger_direct_first"], 1),
            "first": _against(rates["on_loop_first"], rates["ledger_direct_first"], rates["bare"]),
            "threaded_vs_on_loop": spread([a / b for a, b in zip(rates["middleware_first"], rates["on_loop_first"])]),
        }
    if versions is not None:
        fa = rates["fastapi"]
        out["fastapi"] = {
            "versions": versions,
            "plain_ops_per_s": spread(fa, 1),
            **{
                name: _against(rates[f"fastapi_{name}"], rates[f"ledger_{name.rsplit('_', 1)[1]}"], fa)
                for name in ("middleware_first", "route_first", "middleware_replay", "route_replay")
            },
        }
    return out


def _lag_summary(lags: list[float]) -> dict[str, Any]:
    s = sorted(lags)
    return {
        "ticks": len(s),
        "p50_ms": round(percentile(s, 50) * 1000, 3),
        "p99_ms": round(percentile(s, 99) * 1000, 3),
        "max_ms": round(s[-1] * 1000, 3) if s else None,
    }


async def _lag(ctx: Context, synchronous: str) -> dict[str, Any]:
    from idemctl.asgi import IdempotencyMiddleware

    seconds = ctx.size(1, 0.2)
    rounds = ctx.size(5, 1)
    path = ctx.path(f"asgi-lag-{synchronous.lower()}.db")
    ledger = Ledger.open(path, synchronous=synchronous)
    ledger.init()
    apps = {
        "threaded": IdempotencyMiddleware(bare_app, ledger, principal=lambda scope: PRINCIPAL),
        "blocking": IdempotencyMiddleware(bare_app, ledger, principal=lambda scope: PRINCIPAL, executor=OnTheLoop()),
    }

    async def ticker(stop: asyncio.Event, lags: list[float]) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(TICK_S)
            lags.append(time.perf_counter() - t0 - TICK_S)

    async def client(app: ASGIApp, prefix: str, stop: asyncio.Event, latencies: list[float]) -> None:
        i = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            status, _ = await call(app, f"{prefix}-{i}")
            latencies.append(time.perf_counter() - t0)
            assert status == 201, status
            i += 1

    async def measure(condition: str, tag: str, duration: float) -> tuple[list[float], list[float], float]:
        stop = asyncio.Event()
        lags: list[float] = []
        latencies: list[float] = []
        tick = asyncio.create_task(ticker(stop, lags))
        app = apps.get(condition)
        clients = [
            asyncio.create_task(client(app, f"{tag}-{c}", stop, latencies))
            for c in range(CONCURRENCY)
            if app is not None
        ]
        t0 = time.perf_counter()
        await asyncio.sleep(duration)
        stop.set()
        await asyncio.gather(*clients)
        elapsed = time.perf_counter() - t0
        await tick
        if app is not None:
            await app.wait_idle()
        return lags, latencies, elapsed

    # Starts the default executor's threads and their connections.
    await measure("threaded", "warm", min(seconds, 0.5))
    conditions = ["idle", "threaded", "blocking"]
    lags: dict[str, list[float]] = {c: [] for c in conditions}
    p99: dict[str, list[float]] = {c: [] for c in conditions}
    latencies: dict[str, list[float]] = {c: [] for c in conditions}
    throughput: dict[str, list[float]] = {c: [] for c in conditions}
    for rnd in range(rounds):
        for condition in conditions[rnd % 3 :] + conditions[: rnd % 3]:
            lag, lat, elapsed = await measure(condition, f"{condition}-{rnd}", seconds)
            lags[condition] += lag
            p99[condition].append(percentile(sorted(lag), 99) * 1000)
            latencies[condition] += lat
            throughput[condition].append(len(lat) / elapsed)
    ledger.close()
    out: dict[str, Any] = {
        "synchronous": synchronous,
        "concurrency": CONCURRENCY,
        "tick_ms": TICK_S * 1000,
        "rounds": rounds,
        "seconds_per_round": seconds,
    }
    for condition in conditions:
        fig: dict[str, Any] = {"lag": _lag_summary(lags[condition]), "lag_p99_ms_per_round": spread(p99[condition])}
        if condition != "idle":
            lat = sorted(latencies[condition])
            fig["requests_per_s"] = spread(throughput[condition], 1)
            fig["request_ms"] = {
                "count": len(lat),
                "p50_ms": round(percentile(lat, 50) * 1000, 2),
                "p99_ms": round(percentile(lat, 99) * 1000, 2),
                "max_ms": round(lat[-1] * 1000, 2),
            }
            fig["lag_p99_ratio_to_idle"] = spread([a / b for a, b in zip(p99[condition], p99["idle"])], 1)
        out[condition] = fig
    return out


async def _all(ctx: Context) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for level in ("FULL", "NORMAL"):
        ctx.log(f"[asgi] overhead, synchronous={level}")
        out[level.lower()] = await _overhead(ctx, level)
    out["lag"] = {}
    for level in ("FULL", "NORMAL"):
        ctx.log(f"[asgi] event-loop lag, synchronous={level}")
        out["lag"][level.lower()] = await _lag(ctx, level)
    return out


def run(ctx: Context) -> dict[str, Any]:
    if not available():
        return {"missing": "idemctl.asgi.IdempotencyMiddleware is not importable"}
    return asyncio.run(_all(ctx))
