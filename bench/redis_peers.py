"""(13) idemctl on Redis beside idemkit's `RedisBackend` and the raw redis-py
floor, on one standalone redis-server started here (tests/redis_servers.py),
through WSGI and ASGI, first calls and replays, with 1, 10 and 50 requests in
flight, all in one run.

    python -m bench.redis_peers              # about 4 minutes on 2 cores; merged into bench/results/latest.json, page rendered
    python -m bench.redis_peers --no-merge   # print the tables only
    python -m bench.redis_peers --quick      # tiny sizes, JSON out (half a minute, most of it callgrind starting Python)

Every system serves the same app, keys and 1 KiB answer. WSGI: the
middleware called from that many threads at once (each sending its next
request as soon as its last is answered); ASGI: that many tasks on one event
loop (bench/inflight.py's callers). The floor is what any Redis ledger must
send: a first call is a claim and a completion (SET NX, then SET XX, two
round trips), a replay one GET; redis-py's synchronous client for WSGI, its
`redis.asyncio` client for ASGI. idemkit's WSGI middleware runs its asyncio
backend on a loop of its own through its bridge; its ASGI middleware awaits
the backend on the caller's loop.

Every variant runs once per round, in rotating order, so that drift hits all
of them; each ratio is taken within a round, and the figure is the median
round with the min-max of the rounds. Between rounds the server is flushed
and the keys replays read are written again, so every round starts from the
same data.

After the rounds: where idemctl's time goes (cProfile, bench/inflight.py's
grouping by package), and the instructions of one first call and one replay
through the WSGI door, for each system, counted by callgrind as
bench/instructions.py counts them (`--no-instructions` leaves them out)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from . import report
from .common import STORED_1K, Context, git_commit, spread
from .inflight import LEVELS, _in_flight, _profile
from .peers_systems import call_asgi, call_wsgi, idemctl_asgi, idemkit_asgi_on, idemkit_wsgi_on, versions, wsgi_app

DOORS = ("wsgi", "asgi")
SYSTEMS = ("floor", "idemctl", "idemkit")
KINDS = ("first", "replay")
AIM = 1.5  # idemctl's rate over idemkit's on every row
TTL_S = 30.0
DAY_MS = 86_400_000
# The profile sets the store apart from the rest of idemctl, and names idemkit's own code.
PROFILE_GROUPS = (("idemctl.storage", "idemctl's store"), ("idemkit", "idemkit"))
Blocking = Callable[[int, str], object]
Awaiting = Callable[[int, str], Awaitable[object]]


def _threads_in_flight(n: int, level: int, one: Callable[[int], object]) -> float:
    """`n` blocking requests by `level` threads at once; requests per second.
    The threads are started before the clock is, and all wait at a barrier."""
    counter = iter(range(n))  # next() on a range iterator is atomic under the GIL
    gate = threading.Barrier(level + 1)
    failures: list[BaseException] = []

    def caller() -> None:
        gate.wait()
        try:
            for i in counter:
                one(i)
        except BaseException as exc:  # reported by the main thread: a failed request must fail the run
            failures.append(exc)

    threads = [threading.Thread(target=caller) for _ in range(level)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    gate.wait()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if failures:
        raise failures[0]
    return n / elapsed


def _expect(status: int, body: bytes, key: str) -> None:
    if status != 201 or body != STORED_1K:
        raise AssertionError(f"{key}: {status} {body[:80]!r}")


class Variants:
    """The three systems through both doors on one server: each path a
    function of the request's number and the round's tag."""

    def __init__(self, url: str, loop: asyncio.AbstractEventLoop, seeds: int) -> None:
        import redis
        import redis.asyncio as aredis

        from idemctl import Ledger
        from idemctl.wsgi import IdempotencyMiddleware

        self.url, self.loop, self.seeds = url, loop, seeds
        self.admin = redis.Redis.from_url(url)
        self.floor = redis.Redis.from_url(url)
        self.afloor = aredis.Redis.from_url(url)
        self.ledger = Ledger.open(f"{url}?prefix=bench")
        self.ours_wsgi = IdempotencyMiddleware(wsgi_app, self.ledger, principal=lambda environ: environ["REMOTE_USER"])
        self.ours_asgi = idemctl_asgi(self.ledger)
        self.kit_wsgi = self.kit_asgi = self.kit_backends = None
        try:
            from idemkit import RedisBackend
        except ImportError:
            self.kit_missing: str | None = "idemkit is not installed (pip install -e '.[bench]')"
        else:
            self.kit_missing = None
            # One backend per door: the WSGI one lives on idemkit's own loop, the ASGI one on ours.
            self.kit_backends = (RedisBackend.from_url(url), RedisBackend.from_url(url))
            self.kit_wsgi = idemkit_wsgi_on(self.kit_backends[0], TTL_S)
            self.kit_asgi = idemkit_asgi_on(self.kit_backends[1], TTL_S)
        self.blocking: dict[str, Blocking] = {
            "floor_first": self._floor_first,
            "floor_replay": lambda i, tag: self.floor.get(f"floor-wsgi-seed-{i % seeds}"),
            "idemctl_first": lambda i, tag: self._wsgi(self.ours_wsgi, f"ours-wsgi-{tag}-{i}"),
            "idemctl_replay": lambda i, tag: self._wsgi(self.ours_wsgi, f"ours-wsgi-seed-{i % seeds}"),
        }
        self.awaiting: dict[str, Awaiting] = {
            "floor_first": self._afloor_first,
            "floor_replay": lambda i, tag: self.afloor.get(f"floor-asgi-seed-{i % seeds}"),
            "idemctl_first": lambda i, tag: self._asgi(self.ours_asgi, f"ours-asgi-{tag}-{i}"),
            "idemctl_replay": lambda i, tag: self._asgi(self.ours_asgi, f"ours-asgi-seed-{i % seeds}"),
        }
        if self.kit_wsgi is not None:
            self.blocking["idemkit_first"] = lambda i, tag: self._wsgi(self.kit_wsgi, f"kit-wsgi-{tag}-{i}")
            self.blocking["idemkit_replay"] = lambda i, tag: self._wsgi(self.kit_wsgi, f"kit-wsgi-seed-{i % seeds}")
            self.awaiting["idemkit_first"] = lambda i, tag: self._asgi(self.kit_asgi, f"kit-asgi-{tag}-{i}")
            self.awaiting["idemkit_replay"] = lambda i, tag: self._asgi(self.kit_asgi, f"kit-asgi-seed-{i % seeds}")

    def systems(self) -> tuple[str, ...]:
        return SYSTEMS if self.kit_wsgi is not None else SYSTEMS[:2]

    def _floor_first(self, i: int, tag: str) -> None:
        name = f"floor-wsgi-{tag}-{i}"
        if not self.floor.set(name, b"pending", nx=True, px=DAY_MS):
            raise AssertionError(f"{name}: SET NX found the key taken")
        self.floor.set(name, STORED_1K, xx=True, px=DAY_MS)

    async def _afloor_first(self, i: int, tag: str) -> None:
        name = f"floor-asgi-{tag}-{i}"
        if not await self.afloor.set(name, b"pending", nx=True, px=DAY_MS):
            raise AssertionError(f"{name}: SET NX found the key taken")
        await self.afloor.set(name, STORED_1K, xx=True, px=DAY_MS)

    @staticmethod
    def _wsgi(app: Any, key: str) -> None:
        status, _, body = call_wsgi(app, key, lambda: STORED_1K)
        _expect(status, body, key)

    @staticmethod
    async def _asgi(app: Any, key: str) -> None:
        _expect(*await call_asgi(app, key, lambda: STORED_1K), key)

    def reset(self) -> None:
        """An empty server, the ledger's marker, and the keys replays read,
        each written through its own path; then one first call and its retry
        through each, outside the timing."""
        self.admin.flushall()
        self.ledger.init()
        for i in range(self.seeds):
            self.floor.set(f"floor-wsgi-seed-{i}", STORED_1K, px=DAY_MS)
            self.floor.set(f"floor-asgi-seed-{i}", STORED_1K, px=DAY_MS)
        for system in self.systems()[1:]:
            for i in range(self.seeds):
                self.blocking[f"{system}_first"](i, "seed")
                self.loop.run_until_complete(self.awaiting[f"{system}_first"](i, "seed"))
            for path in ("first", "first"):  # the second is a replay of the first
                self.blocking[f"{system}_{path}"](0, "check")
                self.loop.run_until_complete(self.awaiting[f"{system}_{path}"](0, "check"))

    def rate(self, name: str, n: int, tag: str) -> float:
        """Requests per second of one variant, `door_system_kind@level`."""
        variant, level = name.split("@")
        door, path = variant.split("_", 1)
        if door == "wsgi":
            go = self.blocking[path]
            return _threads_in_flight(n, int(level), lambda i: go(i, tag))
        ago = self.awaiting[path]
        out = self.loop.run_until_complete(_in_flight(n, int(level), lambda i: ago(i, tag)))
        self.loop.run_until_complete(self.ours_asgi.wait_idle())
        return out

    def close(self) -> None:
        self.loop.run_until_complete(self.ours_asgi.wait_idle())
        self.loop.run_until_complete(self.ledger.aclose())
        self.ledger.close()
        if self.kit_backends is not None:
            from idemkit.core.sync_bridge import run_sync

            run_sync(self.kit_backends[0].aclose())  # on the bridge's loop, where its pool lives
            self.loop.run_until_complete(self.kit_backends[1].aclose())
        self.loop.run_until_complete(self.afloor.aclose())
        self.floor.close()
        self.admin.close()


def _wsgi_profile(n: int, one: Callable[[int], object]) -> dict[str, Any]:
    """inflight's profile of `n` blocking requests on this thread (cProfile
    sees only the thread that enables it, so one at a time)."""

    async def serial(i: int) -> None:
        one(i)

    return asyncio.run(_profile(n, 1, serial, PROFILE_GROUPS))


def measure(ctx: Context, url: str) -> dict[str, Any]:
    n = ctx.shared.get("n") or ctx.size(1000, 40)
    reps = ctx.shared.get("rounds") or ctx.size(9, 2)
    seeds = ctx.size(100, 5)
    loop = asyncio.new_event_loop()
    v = Variants(url, loop, seeds)
    try:
        systems = v.systems()
        names = [
            f"{door}_{system}_{kind}@{level}"
            for door in DOORS
            for level in LEVELS
            for system in systems
            for kind in KINDS
        ]
        rates: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(reps):
            ctx.log(f"  [redis_peers] round {rep + 1}/{reps}")
            v.reset()
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                rates[name].append(v.rate(name, n, f"r{rep}-{name.split('@')[1]}"))
        v.reset()
        profile = {
            "wsgi_first_1": _wsgi_profile(n, lambda i: v.blocking["idemctl_first"](i, "profile")),
            "wsgi_replay_1": _wsgi_profile(n, lambda i: v.blocking["idemctl_replay"](i, "profile")),
        }
        for system in systems[1:]:
            for kind in KINDS:
                go = v.awaiting[f"{system}_{kind}"]
                name = f"asgi_{kind}_10" + ("" if system == "idemctl" else f"_{system}")

                # A function, not a lambda, so that its arguments have types.
                def profiled(i: int, go: Awaiting = go) -> Awaitable[object]:
                    return go(i, "profile")

                profile[name] = loop.run_until_complete(_profile(n, 10, profiled, PROFILE_GROUPS))
        rows: list[dict[str, Any]] = []
        for door in DOORS:
            for level in LEVELS:
                for kind in KINDS:
                    cell: dict[str, Any] = {"door": door, "level": level, "kind": kind}
                    of = {s: rates[f"{door}_{s}_{kind}@{level}"] for s in systems}
                    for system in systems:
                        cell[system] = spread(of[system], 0)
                        if system != "floor":
                            cell[f"{system}_vs_floor"] = spread([a / b for a, b in zip(of[system], of["floor"])])
                    if "idemkit" in of:
                        cell["idemctl_vs_idemkit"] = spread([a / b for a, b in zip(of["idemctl"], of["idemkit"])])
                    rows.append(cell)
        return {
            "rounds": reps,
            "requests_per_round": n,
            "replay_keys": seeds,
            "aim": AIM,
            "idemkit_missing": v.kit_missing,
            "rows": rows,
            "profile": profile,
        }
    finally:
        v.close()
        loop.close()


# -- instructions: callgrind over the WSGI door, one request at a time ----------------------
def _callgrind_child(url: str, n: int, quick: bool, manifest: str) -> None:
    """Under callgrind: the floor's, idemctl's and idemkit's first calls and
    replays through the WSGI door and through the ASGI door (each request
    driven to its end on the loop), one segment each (bench/instructions.py)."""
    from .instructions import QUICK_WARM_UP, WARM_UP, Segments

    loop = asyncio.new_event_loop()
    v = Variants(url, loop, 5)
    v.reset()
    counted = Segments(n, QUICK_WARM_UP if quick else WARM_UP)
    for door in DOORS:
        for system in v.systems():
            for kind in KINDS:
                name = f"{system}_{kind}"
                go: Blocking = v.blocking[name] if door == "wsgi" else _on_loop(loop, v.awaiting[name])

                def one(key: str, go: Blocking = go) -> None:
                    tag, _, i = key.rpartition("-")  # a segment's keys: name-w0, name-w1, ..., name-m0, ...
                    go(int(i[1:]), f"{tag}-{i[0]}")

                counted.segment(f"{door}_{name}", one, what=f"{door}: {system}, {kind}")
    v.close()
    loop.close()
    counted.write(manifest)


def _on_loop(loop: asyncio.AbstractEventLoop, go: Awaiting) -> Blocking:
    return lambda i, tag: loop.run_until_complete(go(i, tag))


def count_instructions(ctx: Context, url: str) -> dict[str, Any]:
    """Instructions per request of this Python process (redis-server's are
    not counted) through each door, as ratios to that door's floor."""
    from . import instructions

    missing = instructions.available()
    if missing:
        return {"missing": missing}
    n = ctx.size(instructions.FULL_N, instructions.QUICK_N)
    out_dir = os.path.join(ctx.workdir or tempfile.mkdtemp(prefix="idemctl-bench-"), "callgrind-redis")
    ctx.log(f"  [redis_peers] callgrind over {n} requests a segment")
    child = ["bench.redis_peers", "--callgrind-child", url, str(n), "quick" if ctx.quick else "full"]
    rows = instructions.rows_against_floors(out_dir, child, "_", lambda door, kind: f"{door}_floor_{kind}")
    return {"requests_per_segment": n, "rows": rows}


def run(ctx: Context) -> dict[str, Any]:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.redis_servers import Standalone, missing

    reason = missing()
    if reason is not None:
        return {"missing": reason}
    started = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
    load = os.getloadavg()
    t0 = time.perf_counter()
    server = Standalone().start()
    try:
        version = server.server.cli("info", "server").split("redis_version:")[1].split()[0]
        out = measure(ctx, server.url)
        if not ctx.shared.get("no_instructions"):
            out["instructions"] = count_instructions(ctx, server.url)
    finally:
        server.stop()
    return {
        "started_utc": started,
        "commit": git_commit(),
        "load": "/".join(f"{x:.1f}" for x in load),
        "load_end": "/".join(f"{x:.1f}" for x in os.getloadavg()),
        "nproc": os.cpu_count(),
        "elapsed_s": round(time.perf_counter() - t0, 1),
        "server": version,
        "versions": versions(),
        **out,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--callgrind-child"]:  # url, n, quick|full, manifest: run by count_instructions
        _callgrind_child(argv[1], int(argv[2]), argv[3] == "quick", argv[4])
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.redis_peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, JSON out: checks the harness, nothing else")
    p.add_argument("--dir", default=None, help="unused (the redis-server keeps its files in a temp dir of its own)")
    p.add_argument("--n", type=int, default=0, help="requests per variant and round (default 1000; --quick 40)")
    p.add_argument("--rounds", type=int, default=0, help="rounds (default 9; --quick 2)")
    p.add_argument("--no-instructions", action="store_true", help="leave out the callgrind counts (0.5 min of a run)")
    p.add_argument("--no-merge", action="store_true", help="print the table; leave latest.json and the page alone")
    args = p.parse_args(argv)

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)

    ctx = Context(
        workdir=args.dir or "",
        quick=args.quick,
        log=log,
        shared={"n": args.n, "rounds": args.rounds, "no_instructions": args.no_instructions},
    )
    res = run(ctx)
    if "missing" in res:
        print(f"cannot run: {res['missing']}", file=sys.stderr)
        return 2
    if args.quick:
        print(json.dumps(res))
        return 0
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
    log(f"merged into {LATEST}; rendered {PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
