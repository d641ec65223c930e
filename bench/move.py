"""(11) Moving a ledger: `idemctl copy` of a 10^6-row SQLite ledger into
PostgreSQL, the three passes of the cutover procedure (docs/runbook.md).

The source is built like the other big ledgers (bench/backlog.py: random
128-bit keys, 256-byte bodies, one row in ten pending), with a token on every
row and 10^3 fenced-out events. Each pass runs `idemctl copy --json` as a
separate process, exactly as an operator would, and its wall time and peak
RSS are recorded:

1. the first copy, into an empty, initialised schema (copy while live);
2. the same copy again with nothing changed (the floor of the paused pass:
   every row read and compared, nothing written);
3. after 1 % of the rows changed (half of them pending rows completed, half
   new keys): the paused pass of a cutover.

Floor: PostgreSQL's `COPY … FROM STDIN` of the same rows, read from the
same file through a plain sqlite3 cursor, into a fresh table with the same
DDL (no comparison, no conflict handling: the least a bulk move can cost).

Run on its own: `python -m bench.move` (add `--quick` for tiny sizes) merges
its section into bench/results/latest.json and renders docs/performance.md."""

from __future__ import annotations

import argparse
import json
import os
import random
import sqlite3
import sys
import tempfile
import time
from datetime import UTC, datetime
from typing import Any

from .backlog import DAY_MS, PRINCIPALS, add_rows, init_ledger
from .common import LATEST, PAGE, Context, git_commit, now_ms
from .proc import cli, run_measured

COLUMNS = (
    "principal, key, fingerprint, status, generation, token, response_status, "
    "response_body, response_headers, created_at, updated_at"
)
DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"
URL_ENV = "IDEMCTL_BENCH_POSTGRES_URL"
FENCED_EVENTS = 1000


def _schema_url(base: str, schema: str) -> str:
    from urllib.parse import quote

    sep = "&" if "?" in base else "?"
    return f"{base}{sep}options={quote(f'-csearch_path={schema}')}"


def build_source(path: str, rows: int) -> None:
    """`rows` rows as bench/backlog.py writes them, each with a token, and
    FENCED_EVENTS fenced-out events."""
    init_ledger(path)
    add_rows(path, rows, seed=11, updated_at=now_ms() - DAY_MS // 2)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN")
    conn.execute("UPDATE idempotency_keys SET token = abs(random()) + 1")
    rnd = random.Random(12)
    conn.executemany(
        "INSERT INTO idemctl_fenced_out (principal, key, superseded_generation, current_generation,"
        " computed_status, fenced_at) VALUES (?, ?, 1, 2, 201, ?)",
        (("acct_%04d" % (i % PRINCIPALS), "%032x" % rnd.getrandbits(128), now_ms() - i) for i in range(FENCED_EVENTS)),
    )
    conn.execute("COMMIT")
    conn.close()


def change_one_percent(path: str, rows: int) -> int:
    """Complete rows // 200 pending rows and add as many new keys: what a live
    ledger writes while the first copy runs."""
    half = max(1, rows // 200)
    conn = sqlite3.connect(path, isolation_level=None)
    later = now_ms()
    conn.execute("BEGIN")
    done = conn.execute(
        "UPDATE idempotency_keys SET status = 'completed', response_status = 201, response_body = ?,"
        " response_headers = '{}', updated_at = ? WHERE rowid IN"
        " (SELECT rowid FROM idempotency_keys WHERE status = 'pending' LIMIT ?)",
        ("d" * 256, later, half),
    ).rowcount
    conn.execute("COMMIT")
    conn.close()
    add_rows(path, half, seed=13, updated_at=later)
    return done + half


def _floor(admin, base: str, path: str) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    from idemctl.schema import schema_files

    schema = f"idemctl_bench_copy_floor_{os.getpid()}"
    admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    admin.execute(f'CREATE SCHEMA "{schema}"')
    admin.execute(f'SET search_path = "{schema}"')
    for f in schema_files("postgres"):
        admin.execute(f.sql)
    src = sqlite3.connect(path)
    t0 = time.perf_counter()
    with admin.cursor() as cur, cur.copy(f"COPY idempotency_keys ({COLUMNS}) FROM STDIN") as copy:
        for row in src.execute(f"SELECT {COLUMNS} FROM idempotency_keys"):
            body = row[7]
            copy.write_row((*row[:7], body.encode() if isinstance(body, str) else body, *row[8:]))
    seconds = time.perf_counter() - t0
    src.close()
    admin.execute("SET search_path = public")
    admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
    return {"seconds": round(seconds, 3)}


def _pass(source: str, url: str, name: str, ctx: Context) -> dict[str, Any]:
    res = run_measured(cli("--db", source, "copy", "--to", url, "--json"))
    if res["exit_code"] != 0:
        raise RuntimeError(f"idemctl copy ({name}) failed: {res['stderr_tail']}")
    summary = json.loads(res["stdout"])
    ctx.log(f"  copy {name}: {res['seconds']:.1f} s, {summary['copied']} copied, {summary['unchanged']} unchanged")
    return {
        "seconds": res["seconds"],
        "peak_rss_mib": res["peak_rss_mib"],
        **{k: summary[k] for k in ("rows_read", "inserted", "updated", "unchanged", "fenced_copied")},
        "conflicts": len(summary["conflicts"]),
        "kept_newer": len(summary["kept_newer"]),
    }


def run(ctx: Context) -> dict[str, Any]:
    base = os.environ.get(URL_ENV, DEFAULT_URL)
    try:
        import psycopg
    except ImportError as exc:
        return {"missing": f"PostgreSQL driver not importable ({exc})"}
    try:
        admin = psycopg.connect(base, autocommit=True, connect_timeout=5)
    except Exception as exc:
        return {"missing": f"no PostgreSQL server at {base}: {str(exc).splitlines()[0]}"}
    rows = ctx.size(10**6, 2000)
    source = ctx.path("copy-source.db")
    t0 = time.perf_counter()
    build_source(source, rows)
    out: dict[str, Any] = {"rows": rows, "fenced_events": FENCED_EVENTS, "build_s": round(time.perf_counter() - t0, 1)}
    out["source_bytes"] = os.path.getsize(source)
    out["server"] = {
        name: admin.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[index]
        for name in ("server_version", "synchronous_commit", "fsync")
    }
    schema = f"idemctl_bench_copy_{os.getpid()}"
    admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    admin.execute(f'CREATE SCHEMA "{schema}"')
    url = _schema_url(base, schema)
    try:
        out["floor"] = _floor(admin, base, source)
        ctx.log(f"  copy floor (COPY FROM STDIN): {out['floor']['seconds']:.1f} s")
        init = run_measured(cli("--db", url, "init"))
        if init["exit_code"] != 0:
            raise RuntimeError(f"idemctl init failed: {init['stderr_tail']}")
        out["first"] = _pass(source, url, "first", ctx)
        out["again"] = _pass(source, url, "again, nothing changed", ctx)
        out["changed_rows"] = change_one_percent(source, rows)
        out["after_changes"] = _pass(source, url, "after 1% changed", ctx)
        count = admin.execute(f'SELECT count(*) FROM "{schema}".idempotency_keys').fetchone()
        out["destination_rows"] = int(count[0]) if count else -1
    finally:
        admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        admin.close()
        os.unlink(source)
    return out


def main(argv: list[str] | None = None) -> int:
    from . import report
    from .common import machine_info

    p = argparse.ArgumentParser(prog="python -m bench.move", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks that the harness works, nothing else")
    p.add_argument("--dir", default=os.environ.get("IDEMCTL_BENCH_DIR"), help="where the SQLite file goes")
    p.add_argument("--out", default=LATEST, help="results JSON to merge the section into")
    p.add_argument("--page", default=PAGE, help="performance page to render (not with --quick)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    workdir = args.dir or tempfile.mkdtemp(prefix="idemctl-bench-move-")
    os.makedirs(workdir, exist_ok=True)

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)

    ctx = Context(workdir=workdir, quick=args.quick, log=log)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    loadavg_start = os.getloadavg()
    res = run(ctx)
    res["run"] = {
        "started_utc": started,
        "finished_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "loadavg_start": loadavg_start,
        "loadavg_end": os.getloadavg(),
        "filesystem": machine_info(workdir)["filesystem"],
    }
    print(json.dumps(res, indent=1))
    if args.quick:
        return 0
    with open(args.out, encoding="utf-8") as f:
        results = json.load(f)
    results["benchmarks"]["move"] = res
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, sort_keys=False)
        f.write("\n")
    report.write_page(args.page, results)
    log(f"merged into {args.out}; rendered {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
