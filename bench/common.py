"""What every benchmark shares: the run context, identically configured raw
connections for the floors, fresh files, and the statistics (medians with
min-max over repetitions, latency percentiles)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import idemctl
from idemctl.asgi import ASGIApp
from idemctl.exchange.scope import Message
from idemctl.policy import DEFAULT_BUSY_TIMEOUT_MS
from idemctl.schema import schema_files
from idemctl.storage.statements import CLAIM, COMPLETE, LOOKUP

BODY_1K = b"b" * 1024  # the request body of every measured request
STORED_1K = b"r" * 1024  # the response body every measured request stores
HEADERS = {"content-type": "application/json"}
RESPONSE = (201, {"content-type": "application/json"}, STORED_1K)
RESPONSE_HEADERS_JSON = '{"content-type":"application/json"}'
FINGERPRINT = "f" * 64  # the raw floors never hash: they are the physical minimum


def noop_mutation(body: bytes) -> tuple[int, dict[str, str], bytes]:
    return RESPONSE


# Every measured request through an adapter: a 1 KiB JSON POST to /orders.
REQUEST_PATH = "/orders"
REQUEST_PRINCIPAL = "acct_bench"


def wsgi_environ(key: str, *, multithread: bool = False, **extra: Any) -> dict[str, Any]:
    """The environ a WSGI server builds for one measured request (`extra`
    adds keys, such as what a harness passes its app)."""
    return {
        "REQUEST_METHOD": "POST",
        "SCRIPT_NAME": "",
        "PATH_INFO": REQUEST_PATH,
        "QUERY_STRING": "",
        "SERVER_NAME": "bench",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(BODY_1K)),
        "HTTP_IDEMPOTENCY_KEY": key,
        "REMOTE_USER": REQUEST_PRINCIPAL,
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(BODY_1K),
        "wsgi.errors": io.StringIO(),
        "wsgi.multithread": multithread,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
        **extra,
    }


def asgi_scope(key: str, *, headers: Sequence[tuple[bytes, bytes]] = (), **extra: Any) -> dict[str, Any]:
    """The scope an ASGI server builds for one measured request, with more
    `headers` and scope keys (`extra`) when given."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": REQUEST_PATH,
        "raw_path": REQUEST_PATH.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"bench"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(BODY_1K)).encode()),
            (b"idempotency-key", key.encode()),
            *headers,
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("bench", 80),
        **extra,
    }


async def call_asgi_scope(app: ASGIApp, scope: dict[str, Any]) -> tuple[int, bytes]:
    """One request as a server makes it: the body in one message, then a
    disconnect for any further receive; returns the status and body sent."""
    sent: list[Message] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": BODY_1K, "more_body": False}
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


# The statements of the raw floor, exactly as idemctl's store writes them.
RAW_CLAIM, RAW_COMPLETE, RAW_LOOKUP = CLAIM, COMPLETE, LOOKUP
# Where every entry point (python -m bench, bench.renewal, bench.move)
# merges its results and renders the page.
HERE = os.path.dirname(os.path.abspath(__file__))
LATEST = os.path.join(HERE, "results", "latest.json")
PAGE = os.path.join(os.path.dirname(HERE), "docs", "performance.md")
BUSY_TIMEOUT_MS = DEFAULT_BUSY_TIMEOUT_MS  # the ledger's own, for the raw statements too

# A size is a count or a duration in seconds: int or float, as given.
_Size = TypeVar("_Size", int, float)


@dataclass
class Context:
    workdir: str
    quick: bool
    log: Callable[[str], None]
    only: set[str] | None = None
    notes: list[str] = field(default_factory=list)
    shared: dict[str, Any] = field(default_factory=dict)  # hand-overs between benchmarks (e.g. the big file)

    def size(self, full: _Size, quick: _Size) -> _Size:
        return quick if self.quick else full

    def path(self, name: str) -> str:
        """A fresh database path in the work directory (old files removed)."""
        p = os.path.join(self.workdir, name)
        remove_db(p)
        return p


def remove_db(path: str) -> None:
    for suffix in ("", "-wal", "-shm", "-journal", "-idemctl.lock"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path + suffix)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def raw_connect(path: str, synchronous: str = "FULL") -> sqlite3.Connection:
    """A plain sqlite3 connection set up exactly as idemctl sets up its own:
    auto-commit, WAL, the same synchronous level and busy timeout."""
    conn = sqlite3.connect(path, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False)
    conn.execute(f"PRAGMA synchronous={synchronous}")
    if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
        conn.execute("PRAGMA journal_mode=WAL").fetchall()
    return conn


def create_schema(path: str) -> None:
    """The ledger schema without going through idemctl (for raw-only files)."""
    conn = raw_connect(path)
    for f in schema_files("sqlite"):
        conn.executescript(f.sql)
    conn.close()


def raw_pair(conn: sqlite3.Connection, principal: str, key: str, now: int) -> None:
    """The floor of one request: claim, then the fenced completion storing 1 KiB.

    The completion stamps a later time than the claim, as a real one does
    (retention counts from completion): an unchanged updated_at would let
    SQLite skip the index update and make the floor do less work than the
    contract needs."""
    row = {"principal": principal, "key": key, "token": now}
    gen = conn.execute(RAW_CLAIM, {**row, "fingerprint": FINGERPRINT, "now": now}).fetchall()[0][0]
    done = {
        "generation": gen,
        "status": 201,
        "body": STORED_1K.decode(),
        "headers": RESPONSE_HEADERS_JSON,
        "now": now + 1,
    }
    conn.execute(RAW_COMPLETE, {**row, **done}).fetchall()


# -- statistics -------------------------------------------------------------------
# -- profiles: which package a Python function lives in ----------------------------
def package_roots(packages: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """(folder with a trailing separator, group) of each importable package
    in `packages` ((module name, group) pairs), the deepest folder first so
    that a subpackage's group wins over its parent's."""
    roots = []
    for module, group in packages:
        try:
            spec = importlib.util.find_spec(module)
        except ImportError:
            spec = None
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            roots.append((os.path.join(os.path.abspath(location), ""), group))
    return sorted(roots, key=lambda root: -len(root[0]))


def package_of(filename: str, roots: Sequence[tuple[str, str]], otherwise: str) -> str:
    """The group of the first of `roots` (package_roots) that holds `filename`."""
    for root, group in roots:
        if filename.startswith(root):
            return group
    return otherwise


def spread(values: Sequence[float], digits: int = 3) -> dict[str, Any]:
    """Median with min and max, and the raw values, of one figure's repetitions."""
    vals = [float(v) for v in values]
    return {
        "median": round(statistics.median(vals), digits),
        "min": round(min(vals), digits),
        "max": round(max(vals), digits),
        "n": len(vals),
        "values": [round(v, digits) for v in vals],
    }


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted sequence."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), int(-(-q * len(sorted_values) // 100))))
    return sorted_values[rank - 1]


def latency_summary(latencies_s: Sequence[float]) -> dict[str, Any]:
    lat = sorted(latencies_s)
    return {
        "count": len(lat),
        "p50_ms": round(percentile(lat, 50) * 1000, 3),
        "p99_ms": round(percentile(lat, 99) * 1000, 3),
        "max_ms": round(lat[-1] * 1000, 3) if lat else None,
        "over_100ms": sum(1 for v in lat if v > 0.1),
        "over_1s": sum(1 for v in lat if v > 1.0),
    }


def rate(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else float("nan")


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- machine --------------------------------------------------------------------------
def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def filesystem_of(path: str) -> dict[str, str]:
    """File system type and device holding `path` (longest mount-point match)."""
    real = os.path.realpath(path)
    best = ("", "unknown", "unknown")
    with contextlib.suppress(OSError), open("/proc/mounts", encoding="utf-8") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            mnt = mnt.replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                best = (mnt, fstype, dev)
    return {"mount": best[0], "type": best[1], "device": best[2]}


def git_commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "idemctl"], cwd=here, capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_info(workdir: str) -> dict[str, Any]:
    return {
        "nproc": os.cpu_count(),
        "cpu": _cpu_model(),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "idemctl": idemctl.__version__,
        "commit": git_commit(),
        "platform": platform.platform(),
        "workdir": workdir,
        "filesystem": filesystem_of(workdir),
        "loadavg_start": os.getloadavg(),
    }


@contextlib.contextmanager
def section(ctx: Context, name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    ctx.log(f"[{name}] ...")
    yield
    ctx.log(f"[{name}] done in {time.perf_counter() - t0:.1f} s")


def python() -> str:
    return sys.executable
