"""(0) Instructions per request: the request path counted by valgrind's
callgrind, which counts the same on a busy machine as on an idle one.

One child process runs a fixed workload (SQLite, ``synchronous=OFF`` so that
no fsync hides the CPU, 1 KiB bodies in and out) as a row of segments: each
segment sets itself up, warms up, and then runs `n` requests between two
calls of ``os.getpgrp()``. Callgrind runs with ``--dump-before=getpgrp``, so
every call writes the instructions counted since the previous one to a file
of its own: a segment's measured dump holds its `n` requests and nothing
else. Ours ÷ raw sets each segment against the raw statements through
``sqlite3`` (the claim + fenced completion for first calls; the claim attempt
+ primary-key SELECT for replays and 409s), counted the same way.

Python 3.11 shows callgrind no Python function (every frame is one C
interpreter loop), so the per-phase breakdown counts each phase's own calls,
made alone with the same arguments in the same process (fingerprint, claim,
store, events), and the rest of the request as what is left; the SQLite
library's share comes from callgrind's inclusive cost of ``sqlite3_step``
and ``sqlite3_prepare_v2`` in the measured dump itself."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from .common import Context, git_commit

# Python calls getpgrp() nowhere else, so it can mark the segments' edges.
MARKER = "getpgrp"
# Per segment: requests counted (full, --quick), after this many warm-up requests.
FULL_N, QUICK_N = 50, 3
WARM_UP, QUICK_WARM_UP = 20, 3
# C functions whose inclusive cost is the SQLite library's own work.
SQLITE_FUNCTIONS = ("sqlite3_step", "sqlite3_prepare_v2")


def available() -> str | None:
    """Why the benchmark cannot run here, or None."""
    if shutil.which("valgrind") is None:
        return "valgrind is not installed (apt-get install valgrind)"
    return None


# -- the child: the workload under callgrind ------------------------------------------
class Segments:
    """A child's segments: each warms up, then runs `n` requests between
    two markers (a dump each), and the manifest says which dump is whose."""

    def __init__(self, n: int, warm_up: int) -> None:
        self.n, self.warm_up = n, warm_up
        self.segments: list[dict[str, Any]] = []
        self.dumps = 0

    def mark(self) -> None:
        os.getpgrp()
        self.dumps += 1

    def segment(self, name: str, one: Callable[[str], object], *, what: str) -> None:
        for i in range(self.warm_up):
            one(f"{name}-w{i}")
        self.mark()  # everything before: set-up and warm-up
        for i in range(self.n):
            one(f"{name}-m{i}")
        self.mark()
        self.segments.append({"name": name, "dump": self.dumps, "requests": self.n, "what": what})

    def write(self, manifest: str) -> None:
        with open(manifest, "w", encoding="utf-8") as f:
            json.dump({"segments": self.segments, "dumps": self.dumps}, f)


def _child(workdir: str, n: int, quick: bool, manifest: str, adapters: bool = True) -> None:
    import asyncio
    import io

    from idemctl import Ledger, Policy, decision
    from idemctl.fingerprint import fingerprint, parse_key, request_digest
    from idemctl.ledger import check_principal, check_request_line
    from idemctl.outcomes import Outcome, Reservation, Ticket
    from idemctl.storage.statements import new_token

    from .common import (
        BODY_1K,
        FINGERPRINT,
        HEADERS,
        RAW_CLAIM,
        RAW_COMPLETE,
        RAW_LOOKUP,
        RESPONSE_HEADERS_JSON,
        STORED_1K,
        asgi_scope,
        call_asgi_scope,
        noop_mutation,
        now_ms,
        raw_connect,
        raw_pair,
        wsgi_environ,
    )

    path = os.path.join(workdir, "instructions.db")
    for suffix in ("", "-wal", "-shm", "-idemctl.lock"):
        if os.path.exists(path + suffix):
            os.unlink(path + suffix)
    ledger = Ledger.open(path, synchronous="OFF")
    ledger.init()
    raw = raw_connect(path, "OFF")
    policy: Policy = ledger.policy
    principal = "acct_bench"
    warm_up = QUICK_WARM_UP if quick else WARM_UP
    counted = Segments(n, warm_up)
    segment = counted.segment

    # -- the raw floors
    now = now_ms()
    segment("raw_first", lambda k: raw_pair(raw, principal, k, now), what="raw claim + fenced completion")
    raw_pair(raw, principal, "raw-replayed", now)

    def raw_replay(_: str) -> None:
        row = {"principal": principal, "key": "raw-replayed"}
        raw.execute(RAW_CLAIM, {**row, "fingerprint": FINGERPRINT, "token": 1, "now": now}).fetchall()
        raw.execute(RAW_LOOKUP, row).fetchall()

    segment("raw_replay", raw_replay, what="raw claim attempt + primary-key SELECT")

    # -- Ledger.handle
    def handle(key: str, body: bytes = BODY_1K) -> Any:
        return ledger.handle(principal, key, "POST", "/orders", HEADERS, body, noop_mutation)

    assert handle("replayed").outcome is Outcome.EXECUTED
    segment("handle_first", handle, what="Ledger.handle, new key")
    segment("handle_after_response", lambda k: ledger.after_response(handle(k)), what="handle + after_response")
    segment("handle_replay", lambda k: handle("replayed"), what="Ledger.handle, replay")
    assert handle("replayed").outcome is Outcome.REPLAYED
    segment("handle_reused", lambda k: handle("replayed", b"x" * 1024), what="Ledger.handle, 409 key reused")
    assert handle("replayed", b"x" * 1024).outcome is Outcome.REUSED
    fp = fingerprint("POST", "/orders", HEADERS, BODY_1K, policy.fingerprint_headers)
    assert ledger.claim(principal, "in-progress", fp) is not None
    assert handle("in-progress").outcome is Outcome.IN_PROGRESS
    for prefix, count in (("handle_in_progress-w", warm_up), ("handle_in_progress-m", n)):
        for i in range(count):
            assert ledger.claim(principal, f"{prefix}{i}", fp) is not None
    segment("handle_in_progress", handle, what="Ledger.handle, 409 in progress")

    # -- phases of a first call, each alone with the arguments a request passes
    def phase_fingerprint(key: str) -> None:
        check_principal(principal)
        parse_key(key)
        check_request_line("POST", "/orders")
        # As begin does it: the body is bytes, and fingerprinted raw by default.
        request_digest("POST", "/orders", HEADERS, BODY_1K, policy.fingerprint_headers)

    segment("phase_fingerprint", phase_fingerprint, what="key, principal and request-line checks + fingerprint")
    segment(
        "phase_claim",
        lambda k: ledger.store.claim(principal, k, fp, new_token(), now),
        what="Store.claim (writer queue, statement, decoding)",
    )
    held: dict[str, Reservation] = {}
    for prefix, count in (("phase_store-w", warm_up), ("phase_store-m", n)):
        for i in range(count):
            granted = ledger.claim(principal, f"{prefix}{i}", fp)
            assert granted is not None  # a fresh key is always granted (set-up: not counted)
            held[f"{prefix}{i}"] = granted

    # The ledger is its request flow, built on its single steps.
    steps = flow = ledger

    def phase_store(key: str) -> None:
        reservation = held[key]
        stored = steps._prepare(reservation, 201, RESPONSE_HEADERS, STORED_1K)
        # Steps: driven here, as finish drives them.
        decision.run(steps._store_answer(reservation, stored, now + 1))

    segment("phase_store", phase_store, what="to_store + the answer + Store.complete")

    # What finish does about events for a first call: build and deliver one
    # only when a listener or the events log hears it (here nobody does).
    ticket = Ticket(Reservation(principal, "k", 1, fp, 1), Outcome.EXECUTED, BODY_1K, now, "POST", "/orders", 0.1, 1.0)
    segment(
        "phase_events",
        lambda k: flow._finished(ticket, Outcome.EXECUTED, 201, 1.0, 0.1),
        what="the event step of finish, nobody listening",
    )

    def raw_claim(key: str) -> None:
        params = {"principal": principal, "key": key, "fingerprint": FINGERPRINT, "token": 1, "now": now}
        raw.execute(RAW_CLAIM, params).fetchall()

    segment("raw_claim", raw_claim, what="raw claim statement")
    for prefix, count in (("raw_complete-w", warm_up), ("raw_complete-m", n)):
        for i in range(count):
            raw_claim(f"{prefix}{i}")

    def raw_complete(key: str) -> None:
        done = {"generation": 1, "status": 201, "body": STORED_1K.decode(), "headers": RESPONSE_HEADERS_JSON}
        raw.execute(RAW_COMPLETE, {"principal": principal, "key": key, "token": 1, "now": now + 1, **done}).fetchall()

    segment("raw_complete", raw_complete, what="raw fenced completion statement")

    if not adapters:
        counted.write(manifest)
        return

    # -- the adapters: each around the least app of its framework, and that app alone
    def start_response(status: str, headers: list[Any], exc_info: Any = None) -> Any:
        return lambda data: None

    def wsgi_call(app: Any, key: str) -> bytes:
        body_iter = app(wsgi_environ(key), start_response)
        try:
            return b"".join(body_iter)
        finally:
            close = getattr(body_iter, "close", None)
            if close is not None:
                close()

    def bare_wsgi(environ: dict[str, Any], start: Any) -> list[bytes]:
        environ["wsgi.input"].read()
        start("201 Created", [("Content-Type", "application/json"), ("Content-Length", str(len(STORED_1K)))])
        return [STORED_1K]

    def adapter(name: str, call: Callable[[str], Any], bare: Callable[[str], Any]) -> None:
        assert call(f"{name}-check") == STORED_1K
        segment(f"{name}_bare", bare, what=f"{name}: the app alone")
        segment(f"{name}_first", call, what=f"{name}: new key")
        segment(f"{name}_replay", lambda k: call(f"{name}-check"), what=f"{name}: replay")

    from idemctl.wsgi import IdempotencyMiddleware as WsgiMiddleware

    wsgi = WsgiMiddleware(bare_wsgi, ledger, principal=lambda environ: environ.get("REMOTE_USER"))
    adapter("wsgi", lambda k: wsgi_call(wsgi, k), lambda k: wsgi_call(bare_wsgi, k))

    loop = asyncio.new_event_loop()
    from idemctl.asgi import IdempotencyMiddleware as AsgiMiddleware

    from .asgi import bare_app

    asgi = AsgiMiddleware(bare_app, ledger, principal=lambda scope: principal)

    async def through(app: Any, key: str, idle: Any = None) -> bytes:
        _, body = await call_asgi_scope(app, asgi_scope(key))
        if idle is not None:
            await idle()  # the post-response work belongs to this request
        return body

    adapter(
        "asgi",
        lambda k: loop.run_until_complete(through(asgi, k, asgi.wait_idle)),
        lambda k: loop.run_until_complete(through(bare_app, k)),
    )
    if not quick:
        _frameworks(ledger, principal, adapter, segment, wsgi_call, loop, through, STORED_1K, io)
    loop.close()
    counted.write(manifest)


RESPONSE_HEADERS = {"content-type": "application/json"}
# Rows whose requests never run the app (a middleware's replay).
_REPLAYS_WITHOUT_APP = frozenset({"fastapi_middleware_replay"})


def _frameworks(
    ledger: Any,
    principal: str,
    adapter: Any,
    segment: Any,
    wsgi_call: Any,
    loop: Any,
    through: Any,
    stored: bytes,
    io: Any,
) -> None:
    """Flask, Django and FastAPI, each where it is installed."""
    try:
        from flask import Flask, Response, request

        from idemctl.flask import idempotent
    except ImportError:
        pass
    else:
        app = Flask("bench")

        def view() -> Response:
            request.get_data()
            return Response(stored, status=201, content_type="application/json")

        app.route("/orders", methods=["POST"])(idempotent(ledger, principal=lambda: principal)(view))
        bare = Flask("bench_bare")
        bare.route("/orders", methods=["POST"])(view)
        adapter("flask", lambda k: wsgi_call(app, k), lambda k: wsgi_call(bare, k))

    try:
        import django
        from django.conf import settings
    except ImportError:
        pass
    else:
        from django.http import HttpResponse
        from django.urls import path as url

        def order(req: Any) -> HttpResponse:
            req.body  # noqa: B018  # read it, as a view does
            return HttpResponse(stored, status=201, content_type="application/json")

        module = type(sys)("bench_django_urls")
        module.urlpatterns = [url("orders", order)]  # type: ignore[attr-defined]
        sys.modules["bench_django_urls"] = module
        settings.configure(
            DEBUG=False,
            SECRET_KEY="bench",
            ALLOWED_HOSTS=["*"],
            ROOT_URLCONF="bench_django_urls",
            INSTALLED_APPS=[],
            DATABASES={},
            MIDDLEWARE=["idemctl.django.IdempotencyMiddleware"],
            IDEMCTL={"LEDGER": ledger, "PRINCIPAL": lambda req: req.META.get("REMOTE_USER")},
            USE_TZ=True,
        )
        django.setup()
        from django.core.handlers.wsgi import WSGIHandler

        protected = WSGIHandler()
        settings.MIDDLEWARE = []
        plain = WSGIHandler()
        adapter("django", lambda k: wsgi_call(protected, k), lambda k: wsgi_call(plain, k))

    try:
        from .asgi import _fastapi_apps

        plain_api, routed = _fastapi_apps(ledger)
    except ImportError:
        pass
    else:
        adapter(
            "fastapi",
            lambda k: loop.run_until_complete(through(routed, k)),
            lambda k: loop.run_until_complete(through(plain_api, k)),
        )
        # The same plain app under the ASGI middleware: its own share is set
        # against the same app alone (fastapi_bare).
        from idemctl.asgi import IdempotencyMiddleware

        around = IdempotencyMiddleware(plain_api, ledger, principal=lambda scope: principal)

        def middleware(key: str) -> bytes:
            return loop.run_until_complete(through(around, key, around.wait_idle))  # type: ignore[no-any-return]

        assert middleware("fastapi_middleware-check") == stored
        segment("fastapi_middleware_first", middleware, what="fastapi_middleware: new key")
        segment(
            "fastapi_middleware_replay",
            lambda k: middleware("fastapi_middleware-check"),
            what="fastapi_middleware: replay (the app does not run)",
        )


# -- the parent: run callgrind, read its dumps -----------------------------------------
_TOTALS = re.compile(r"^(?:summary|totals):\s*(\d+)", re.MULTILINE)


def _total(path: str) -> int:
    with open(path, encoding="utf-8", errors="replace") as f:
        found = _TOTALS.search(f.read())
    if found is None:
        raise RuntimeError(f"no totals in {path}")
    return int(found.group(1))


def _inclusive(path: str, functions: tuple[str, ...]) -> dict[str, int]:
    """Callgrind's inclusive cost of each named C function in one dump."""
    out = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", path],
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    found = dict.fromkeys(functions, 0)
    for line in out.splitlines():
        m = re.match(r"\s*([\d,]+)\s+(?:\([^)]*\)\s+)?\S*?:(\w+)\b", line)
        if m and m.group(2) in found:
            found[m.group(2)] = max(found[m.group(2)], int(m.group(1).replace(",", "")))
    return found


# Where a request's instructions go, by the C function that executes them
# (Python 3.11 shows callgrind no Python function): each function's own
# cost (its "self" cost, without what it calls), grouped by what it does.
PARTS = (
    "the interpreter loop (Python bytecode)",
    "objects and frames (allocating, freeing, calls)",
    "dicts, strings and attribute lookups",
    "the rest of CPython",
    "SHA-256 (OpenSSL)",
    "asyncio's C tasks and futures",
    "the driver's C code",
    "the C library",
)
_OBJECTS = re.compile(
    r"alloc|free|dealloc|gc_|frame|initialize_locals|newreference|trash|vectorcall|call|fromarray|"
    r"_new|new_|make_gen|gen_|eval_vector|tuple|list|slot_tp_init",
    re.IGNORECASE,
)
_LOOKUPS = re.compile(
    r"dict|unicode|lookup|getattr|setattr|getmethod|set_|hash|keys|richcompare|decode|encode|bytes|ascii|str",
    re.IGNORECASE,
)
_NAMES = {"ob": "ob", "cob": "ob", "fn": "fn", "cfn": "fn"}


def _part(obj: str, fn: str) -> str:
    if "libcrypto" in obj:
        return PARTS[4]
    if "_asyncio" in obj:
        return PARTS[5]
    if "site-packages" in obj:
        return PARTS[6]
    if "libc.so" in obj or "ld-linux" in obj:
        return PARTS[7]
    if fn.startswith("_PyEval_EvalFrameDefault"):
        return PARTS[0]
    if _OBJECTS.search(fn):
        return PARTS[1]
    if _LOOKUPS.search(fn):
        return PARTS[2]
    return PARTS[3]


def self_cost_by_part(path: str) -> dict[str, int]:
    """One dump's instructions by PARTS: each function's self cost (the
    cost lines under its ``fn=``, not the inclusive cost after a ``calls=``),
    its object file and name read through callgrind's name compression."""
    names: dict[str, dict[str, str]] = {"ob": {}, "fn": {}}
    obj = fn = ""
    after_call = False
    parts = dict.fromkeys(PARTS, 0)

    def name(table: str, spec: str) -> str:
        m = re.match(r"\((\d+)\)(?:\s+(.*))?$", spec)
        if m is None:
            return spec
        if m.group(2) is not None:
            names[table][m.group(1)] = m.group(2)
        return names[table].get(m.group(1), spec)

    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            head, eq, rest = line.partition("=")
            if eq and head in _NAMES:
                value = name(_NAMES[head], rest.strip())
                if head == "ob":
                    obj = value
                elif head == "fn":
                    fn = value
                continue
            if head == "calls":
                after_call = True
                continue
            if line[:1].isdigit() or line[:1] in "+-*":
                if after_call:  # the inclusive cost of the call just named
                    after_call = False
                    continue
                fields = line.split()
                if len(fields) > 1:
                    parts[_part(obj, fn)] += int(fields[1])
    return parts


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b else None


def callgrind(out_dir: str, child: list[str]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Run ``python -m <child...> MANIFEST`` under callgrind, in a fresh
    `out_dir`: the child marks each segment's edges with getpgrp() and
    writes the manifest ({"segments": [...], "dumps": n}). Returns its
    segments and each one's dump file (the caller removes `out_dir`)."""
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    manifest = os.path.join(out_dir, "segments.json")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONHASHSEED": "0"}
    cmd = [
        "valgrind",
        "--tool=callgrind",
        f"--dump-before={MARKER}",
        f"--callgrind-out-file={os.path.join(out_dir, 'cg.out')}",
        sys.executable,
        "-m",
        *child,
        manifest,
    ]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"the callgrind child failed: {proc.stderr[-2000:]}")
    with open(manifest, encoding="utf-8") as f:
        plan = json.load(f)
    dump_files = [os.path.join(out_dir, f"cg.out.{i}") for i in range(1, plan["dumps"] + 1)]
    if not all(os.path.exists(p) for p in dump_files) or os.path.exists(
        os.path.join(out_dir, f"cg.out.{plan['dumps'] + 1}")
    ):
        raise RuntimeError("callgrind's dumps do not match the segments: something else called getpgrp()")
    return plan["segments"], {seg["name"]: dump_files[seg["dump"] - 1] for seg in plan["segments"]}


def rows_against_floors(
    out_dir: str,
    child: list[str],
    sep: str,
    floor_of: Callable[[str, str], str],
    parts_of: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """Run `child` under callgrind (see `callgrind`; `out_dir` is removed
    after): a row per segment named door, system and kind joined by `sep`,
    with its instructions per request and its ratio to the segment
    `floor_of(door, kind)` names; the segments in `parts_of` and their
    floors also say where their instructions go (`self_cost_by_part`, per
    request)."""
    parts: dict[str, dict[str, float]] = {}
    try:
        segments, dumps = callgrind(out_dir, child)
        per = {seg["name"]: _total(dumps[seg["name"]]) / seg["requests"] for seg in segments}
        wanted = set(parts_of) | {floor_of(*name.split(sep)[::2]) for name in parts_of}
        for seg in segments:
            if seg["name"] in wanted:
                cost = self_cost_by_part(dumps[seg["name"]])
                parts[seg["name"]] = {part: n / seg["requests"] for part, n in cost.items()}
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    rows = []
    for seg in segments:
        door, system, kind = seg["name"].split(sep)
        row: dict[str, Any] = {
            "door": door,
            "system": system,
            "kind": kind,
            "instructions": round(per[seg["name"]]),
            "vs_floor": round(per[seg["name"]] / per[floor_of(door, kind)], 2),
        }
        if seg["name"] in parts:
            row["parts"] = {part: round(n) for part, n in parts[seg["name"]].items()}
        rows.append(row)
    return rows


def run(ctx: Context) -> dict[str, Any]:
    missing = available()
    if missing:
        return {"missing": missing}
    n = QUICK_N if ctx.quick else FULL_N
    out_dir = os.path.join(ctx.workdir, "callgrind")
    ctx.log(f"[instructions] callgrind over {n} requests a segment")
    segments, dumps = callgrind(out_dir, ["bench.instructions", ctx.workdir, str(n), "quick" if ctx.quick else "full"])
    per: dict[str, float] = {}
    sqlite_share: dict[str, float] = {}
    for seg in segments:
        per[seg["name"]] = _total(dumps[seg["name"]]) / seg["requests"]
        if seg["name"] in ("raw_first", "raw_replay", "handle_first", "handle_replay"):
            inc = _inclusive(dumps[seg["name"]], SQLITE_FUNCTIONS)
            sqlite_share[seg["name"]] = sum(inc.values()) / seg["requests"]
    shutil.rmtree(out_dir, ignore_errors=True)
    return _summarise(per, sqlite_share, segments, n)


def _summarise(
    per: dict[str, float], sqlite_share: dict[str, float], segments: list[dict[str, Any]], n: int
) -> dict[str, Any]:
    raw_first, raw_replay = per["raw_first"], per["raw_replay"]
    rows = []
    for seg in segments:
        name = seg["name"]
        if name.startswith(("phase_", "raw_claim", "raw_complete")) or name.endswith("_bare"):
            continue
        floor = raw_first if name.endswith(("_first", "_after_response")) else raw_replay
        row: dict[str, Any] = {
            "name": name,
            "what": seg["what"],
            "instructions": round(per[name]),
            "floor": "raw_first" if floor is raw_first else "raw_replay",
            "ratio": _ratio(per[name], floor),
        }
        adapter = name.split("_")[0]
        if f"{adapter}_bare" in per and name.endswith(("_first", "_replay")):
            ledger_part = per["handle_after_response"] if name.endswith("_first") else per["handle_replay"]
            row["app_alone"] = round(per[f"{adapter}_bare"])
            # A middleware's replay never reaches the FastAPI app: nothing of it to set aside.
            app_part = 0 if name in _REPLAYS_WITHOUT_APP else per[f"{adapter}_bare"]
            row["adapter_own"] = round(per[name] - app_part - ledger_part)
        rows.append(row)
    phases = {
        "fingerprint": per["phase_fingerprint"],
        "claim": per["phase_claim"],
        "store": per["phase_store"],
        "events": per["phase_events"],
    }
    rest = per["handle_first"] - sum(phases.values())
    breakdown = [
        {"phase": "fingerprint (key, principal, request line, sha256)", "instructions": round(phases["fingerprint"])},
        {
            "phase": "claim (Store.claim)",
            "instructions": round(phases["claim"]),
            "raw": round(per["raw_claim"]),
        },
        {
            "phase": "store (to_store, the answer from the stored columns, Store.complete)",
            "instructions": round(phases["store"]),
            "raw": round(per["raw_complete"]),
        },
        {"phase": "events (nobody listening: none built)", "instructions": round(phases["events"])},
        {
            "phase": "app hand-off and the rest (decision loop, ticket, answer, mutation call)",
            "instructions": round(rest),
        },
        {"phase": "total: Ledger.handle, new key", "instructions": round(per["handle_first"]), "raw": round(raw_first)},
    ]
    for name in ("wsgi", "asgi", "flask", "django", "fastapi", "fastapi_middleware"):
        if f"{name}_first" in per:
            bare = per[f"{name.split('_')[0]}_bare"]
            breakdown.append(
                {
                    "phase": f"adapter: {name} (its own, beyond handle + after_response and the app alone)",
                    "instructions": round(per[f"{name}_first"] - bare - per["handle_after_response"]),
                }
            )
    return {
        "requests_per_segment": n,
        "warm_up": QUICK_WARM_UP if n == QUICK_N else WARM_UP,
        "commit": git_commit(),
        "python": sys.version.split()[0],
        "raw_first": round(raw_first),
        "raw_replay": round(raw_replay),
        "rows": rows,
        "phases": breakdown,
        "sqlite_library": {k: round(v) for k, v in sqlite_share.items()},
        "aims": {
            "first_ratio": _ratio(per["handle_first"], raw_first),
            "first_aim": 1.6,
            "replay_ratio": _ratio(per["handle_replay"], raw_replay),
            "replay_aim": 2.0,
        },
    }


if __name__ == "__main__":
    # mode: "full", "quick", or "ledger" (no adapters: a quicker look while working on the ledger)
    _child(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "quick", sys.argv[4], adapters=sys.argv[3] != "ledger")
