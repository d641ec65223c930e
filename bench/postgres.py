"""(7) PostgreSQL: the request cycle (1), contention with 8 processes (3) and
the sweep (5), each against the same statements sent raw through psycopg to
the same server.

Everything runs in a schema of its own (dropped afterwards), reached through
libpq's `options=-csearch_path=…`, so the idemctl ledger and the raw floor see
identical tables. The raw floor uses one autocommit psycopg connection with
the same lock_timeout as idemctl's pool connections. The server's own
settings (synchronous_commit, fsync, where its data lives) are recorded."""

from __future__ import annotations

import json
import os
import time
from typing import Any
from urllib.parse import quote

from idemctl import Ledger, Outcome

from . import contention
from .backlog import DAY_MS
from .common import (
    BODY_1K,
    FINGERPRINT,
    HEADERS,
    RESPONSE_HEADERS_JSON,
    STORED_1K,
    Context,
    noop_mutation,
    now_ms,
    spread,
    timed,
)
from .proc import Claimer, cli, run_measured

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"
URL_ENV = "IDEMCTL_BENCH_POSTGRES_URL"


def _connect(base: str, schema: str | None = None):  # type: ignore[no-untyped-def]
    import psycopg

    conn = psycopg.connect(base, autocommit=True, connect_timeout=5)
    conn.execute("SET lock_timeout = 5000")
    if schema:
        conn.execute(f'SET search_path = "{schema}"')
    return conn


def _schema_url(base: str, schema: str) -> str:
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}options={quote(f'-csearch_path={schema}')}"


def _fresh_schema(admin, name: str) -> None:  # type: ignore[no-untyped-def]
    admin.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
    admin.execute(f'CREATE SCHEMA "{name}"')


def cycle(ctx: Context, base: str, admin) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    from idemctl.storage.dialect import POSTGRES
    from idemctl.storage.statements import CLAIM, CLAIM_OR_READ, COMPLETE, LOOKUP

    SQL_CLAIM, SQL_COMPLETE, SQL_LOOKUP, SQL_CLAIM_OR_READ = (
        POSTGRES.params(s) for s in (CLAIM, COMPLETE, LOOKUP, CLAIM_OR_READ)
    )

    schema = f"idemctl_bench_cycle_{os.getpid()}"
    _fresh_schema(admin, schema)
    url = _schema_url(base, schema)
    ledger = Ledger.open(url)
    ledger.init()
    raw = _connect(base, schema)
    n, reps = ctx.size(1000, 30), ctx.size(6, 3)

    def floor(rep: int) -> None:
        now = now_ms()
        for i in range(n):
            key = f"raw-{rep}-{i}"
            row = {"principal": "acct_bench", "key": key, "token": i + 1}
            gen = raw.execute(SQL_CLAIM, {**row, "fingerprint": FINGERPRINT, "now": now}).fetchall()[0][0]
            done = {
                "generation": gen,
                "status": 201,
                "body": STORED_1K,
                "headers": RESPONSE_HEADERS_JSON,
                "now": now + 1,
            }
            raw.execute(SQL_COMPLETE, {**row, **done}).fetchall()

    def ours(rep: int) -> None:
        for i in range(n):
            ledger.handle("acct_bench", f"led-{rep}-{i}", "POST", "/orders", HEADERS, BODY_1K, noop_mutation)

    def ours_and_sweep(rep: int) -> None:
        # What the middleware does per request: the sweep after the answer.
        for i in range(n):
            answer = ledger.handle("acct_bench", f"aft-{rep}-{i}", "POST", "/orders", HEADERS, BODY_1K, noop_mutation)
            ledger.after_response(answer)

    def lookup(rep: int) -> None:
        for i in range(n):
            raw.execute(SQL_LOOKUP, {"principal": "acct_bench", "key": f"led-0-{i % 50}"}).fetchall()

    def claim_or_read(rep: int) -> None:
        # A replay's one statement, raw: the claim that finds the key taken and reads its row.
        now = now_ms()
        for i in range(n):
            row = {"principal": "acct_bench", "key": f"led-0-{i % 50}", "token": i + 1}
            found = raw.execute(SQL_CLAIM_OR_READ, {**row, "fingerprint": FINGERPRINT, "now": now}).fetchall()
            assert found and found[0][0] is None, "the replay floor claimed a new key"

    def replay(rep: int) -> None:
        for i in range(n):
            ledger.handle("acct_bench", f"led-0-{i % 50}", "POST", "/orders", HEADERS, BODY_1K, noop_mutation)

    assert (
        ledger.handle("acct_bench", "check", "POST", "/o", HEADERS, BODY_1K, noop_mutation).outcome is Outcome.EXECUTED
    )
    variants = {
        "floor": floor,
        "handle": ours,
        "handle_after": ours_and_sweep,
        "pk_select": lookup,
        "claim_or_read": claim_or_read,
        "replay": replay,
    }
    rates: dict[str, list[float]] = {name: [] for name in variants}
    rotation = ["floor", "handle", "handle_after"]
    replays = ["claim_or_read", "replay", "pk_select"]
    for rep in range(reps):
        order = rotation[rep % 3 :] + rotation[: rep % 3]
        for name in order:
            rates[name].append(n / timed(lambda: variants[name](rep)))
        # The replays (the keys led-0-* exist from the first round on), alternated too.
        for name in replays[rep % 3 :] + replays[: rep % 3]:
            rates[name].append(n / timed(lambda: variants[name](rep)))
    ledger.close()
    raw.close()
    admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
    return {
        "requests_per_rep": n,
        "floor": {"ops_per_s": spread(rates["floor"], 1)},
        "handle": {
            "ops_per_s": spread(rates["handle"], 1),
            "ratio": spread([a / b for a, b in zip(rates["handle"], rates["floor"])]),
        },
        "handle_after": {
            "ops_per_s": spread(rates["handle_after"], 1),
            "ratio": spread([a / b for a, b in zip(rates["handle_after"], rates["floor"])]),
        },
        "pk_select": {"ops_per_s": spread(rates["pk_select"], 1)},
        "claim_or_read": {"ops_per_s": spread(rates["claim_or_read"], 1)},
        "replay": {
            "ops_per_s": spread(rates["replay"], 1),
            # The floor: the raw claim that finds the key and reads its row (a replay's one statement).
            "ratio": spread([a / b for a, b in zip(rates["replay"], rates["claim_or_read"])]),
            "ratio_vs_pk_select": spread([a / b for a, b in zip(rates["replay"], rates["pk_select"])]),
        },
    }


def contend(ctx: Context, base: str, admin) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    seconds = 10.0 if not ctx.quick else 0.4
    out: dict[str, Any] = {"seconds_per_config": seconds, "configs": []}
    single = None
    for workers in (1, 8):
        schema = f"idemctl_bench_contention_{workers}_{os.getpid()}"
        _fresh_schema(admin, schema)
        res = contention.measure(_schema_url(base, schema), "n/a", False, workers, seconds)
        res.pop("synchronous")
        res.pop("write_queue")
        if single is None:
            single = res
        res["ratio_to_single"] = spread([a / single["throughput"]["median"] for a in res["throughput"]["values"]])
        res["ratio_to_single"]["total"] = round(res["requests"] / single["requests"], 3)
        ctx.log(
            f"  postgres contention x{workers}: {res['requests'] / seconds:.0f} req/s, p99 {res['latency']['p99_ms']} ms, "
            f"max {res['latency']['max_ms']} ms, errors {res['error_count']}"
        )
        out["configs"].append(res)
        admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
    return out


LOAD = """
INSERT INTO idempotency_keys
  (principal, key, fingerprint, status, generation, response_status, response_body, response_headers, created_at, updated_at)
SELECT 'acct_' || lpad(mod(i, 1000)::text, 4, '0'), md5(%(seed)s || i::text), repeat('e', 64),
       CASE WHEN mod(i, 10) = 0 THEN 'pending' ELSE 'completed' END, 1,
       CASE WHEN mod(i, 10) = 0 THEN NULL ELSE 201 END,
       CASE WHEN mod(i, 10) = 0 THEN NULL ELSE convert_to(repeat('o', 256), 'UTF8') END,
       CASE WHEN mod(i, 10) = 0 THEN NULL ELSE '{"content-type":"application/json"}' END,
       %(at)s + i, %(at)s + i
FROM generate_series(1, %(n)s) AS i
"""


def _load(admin, schema: str, expired: int, live: int) -> None:  # type: ignore[no-untyped-def]
    from idemctl.schema import schema_files

    _fresh_schema(admin, schema)
    admin.execute(f'SET search_path = "{schema}"')
    for f in schema_files("postgres"):
        admin.execute(f.sql)
    admin.execute(LOAD, {"seed": "x", "at": now_ms() - 2 * DAY_MS - 10**7, "n": expired})
    admin.execute(LOAD, {"seed": "live", "at": now_ms(), "n": live})
    admin.execute("VACUUM ANALYZE idempotency_keys")
    admin.execute("SET search_path = public")


def _batch_profile(raw, cutoff: int) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Where one drain batch's time goes inside the server: EXPLAIN ANALYZE
    of the sweep statement at the CLI's default batch size, rolled back so
    the floor's DELETE still finds every row."""
    from idemctl.storage.dialect import POSTGRES

    sql = POSTGRES.params(POSTGRES.sweep.statement)
    params = {"after": -(2**62), "cutoff": cutoff, "limit": POSTGRES.sweep.drain_batch}
    raw.execute("BEGIN")
    try:
        (plan,) = raw.execute("EXPLAIN (ANALYZE, BUFFERS, WAL, FORMAT JSON) " + sql, params).fetchone()[0]
    finally:
        raw.execute("ROLLBACK")
    nodes = [plan["Plan"]]
    found: dict[str, Any] = {}
    while nodes:
        node = nodes.pop()
        nodes.extend(node.get("Plans", []))
        if node["Node Type"] == "ModifyTable":
            found["rows"] = node["Actual Rows"]
        elif node["Node Type"] == "Limit":
            found["collect_ms"] = node["Actual Total Time"]
    return {
        "batch": POSTGRES.sweep.drain_batch,
        "rows": found.get("rows"),
        "execution_ms": round(plan["Execution Time"], 3),
        "planning_ms": round(plan["Planning Time"], 3),
        "collect_ms": round(found.get("collect_ms", 0.0), 3),
        "wal_bytes": plan["Plan"].get("WAL Bytes"),
    }


def sweep(ctx: Context, base: str, admin) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    expired, live = ctx.size(10**6, 3000), ctx.size(10**4, 100)
    out: dict[str, Any] = {"expired_rows": expired, "live_rows": live}
    floor_schema = f"idemctl_bench_sweep_floor_{os.getpid()}"
    ours_schema = f"idemctl_bench_sweep_ours_{os.getpid()}"
    out["load_s"] = round(timed(lambda: _load(admin, floor_schema, expired, live)), 2)
    raw = _connect(base, floor_schema)
    cutoff = now_ms() - DAY_MS
    out["batch_profile"] = _batch_profile(raw, cutoff)
    with Claimer(_schema_url(base, floor_schema)) as claimer:
        t0 = time.perf_counter()
        deleted = raw.execute("DELETE FROM idempotency_keys WHERE updated_at < %s", (cutoff,)).rowcount
        delete_s = time.perf_counter() - t0
        time.sleep(0.2)
    raw.close()
    out["floor"] = {"deleted": deleted, "delete_s": round(delete_s, 3), "claimer": claimer.result}
    admin.execute(f'DROP SCHEMA "{floor_schema}" CASCADE')
    ctx.log(f"  postgres sweep: unbounded DELETE {delete_s:.1f} s")
    _load(admin, ours_schema, expired, live)
    url = _schema_url(base, ours_schema)
    with Claimer(url) as claimer:
        res = run_measured(cli("sweep", "--db", url, "--json"))
    if res["exit_code"] != 0:
        raise RuntimeError(f"idemctl sweep on PostgreSQL failed: {res['stderr_tail']}")
    summary = json.loads(res["stdout"])
    check = _connect(base, ours_schema)
    left = check.execute("SELECT count(*) FROM idempotency_keys WHERE updated_at < %s", (cutoff,)).fetchone()[0]
    survivors = check.execute(
        "SELECT count(*) FROM idempotency_keys WHERE updated_at >= %s AND principal <> 'acct_claimer'", (cutoff,)
    ).fetchone()[0]
    check.close()
    admin.execute(f'DROP SCHEMA "{ours_schema}" CASCADE')
    if left != 0 or survivors != live:
        raise AssertionError(f"PostgreSQL sweep left {left} expired rows, {survivors}/{live} live rows")
    out["cli"] = {
        "drain_ms": summary.get("elapsed_ms"),
        "deleted": summary.get("deleted"),
        "batches": summary.get("batches"),
        "batch_size": summary.get("batch_size"),
        "sweep_s": res["seconds"],
        "peak_rss_mib": res["peak_rss_mib"],
        "claimer": claimer.result,
        "live_rows_after": survivors,
    }
    out["ratio_total"] = round(res["seconds"] / delete_s, 3)
    ctx.log(f"  postgres sweep: idemctl sweep {res['seconds']:.1f} s")
    return out


def run(ctx: Context) -> dict[str, Any]:
    base = os.environ.get(URL_ENV, DEFAULT_URL)
    try:
        import psycopg  # noqa: F401

        from idemctl.storage.postgres import PostgresEngine  # noqa: F401
    except ImportError as exc:
        return {"missing": f"PostgreSQL backend or driver not importable ({exc})"}
    try:
        admin = _connect(base)
    except Exception as exc:
        return {"missing": f"no PostgreSQL server at {base}: {str(exc).splitlines()[0]}"}
    server = {
        name: admin.execute(f"SHOW {name}").fetchone()[0]
        for name in ("server_version", "synchronous_commit", "fsync", "shared_buffers", "data_directory")
    }
    try:
        return {
            "server": server,
            "cycle": cycle(ctx, base, admin),
            "contention": contend(ctx, base, admin),
            "sweep": sweep(ctx, base, admin),
        }
    finally:
        admin.close()
