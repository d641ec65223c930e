"""(7b) MariaDB: the request cycle (1), contention with 8 processes (3) and
the sweep (5), each against the same statements sent raw through PyMySQL to
the same server, as (7) does for PostgreSQL.

Everything runs in a database of its own (dropped afterwards), so the
idemctl ledger and the raw floor see identical tables. The raw floor uses
one auto-commit PyMySQL connection with the session settings of idemctl's
own connections. The server's durability settings are recorded."""

from __future__ import annotations

import json
import os
import time
from typing import Any

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

DEFAULT_URL = "mysql://root@127.0.0.1:3306/test"
URL_ENV = "IDEMCTL_BENCH_MYSQL_URL"


def _db_url(base: str, name: str) -> str:
    head, _, query = base.partition("?")
    return head.rsplit("/", 1)[0] + f"/{name}" + (f"?{query}" if query else "")


def _connect(base: str, database: str | None = None):  # type: ignore[no-untyped-def]
    """A raw connection set up exactly as the engine sets up its own."""
    from idemctl.storage.mysql import MysqlEngine

    engine = MysqlEngine(_db_url(base, database) if database else base)
    return engine._connect().conn


def _fresh_database(admin, name: str) -> None:  # type: ignore[no-untyped-def]
    with admin.cursor() as cur:
        cur.execute(f"DROP DATABASE IF EXISTS {name}")
        cur.execute(f"CREATE DATABASE {name} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")


def _drop(admin, name: str) -> None:  # type: ignore[no-untyped-def]
    with admin.cursor() as cur:
        cur.execute(f"DROP DATABASE IF EXISTS {name}")


def cycle(ctx: Context, base: str, admin) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    from idemctl.storage.dialect import MYSQL
    from idemctl.storage.statements import CLAIM, COMPLETE, LOOKUP, WITHOUT_RETURNING

    sql_claim, sql_complete = (MYSQL.params(WITHOUT_RETURNING[s]) for s in (CLAIM, COMPLETE))
    sql_lookup = MYSQL.params(LOOKUP)
    name = f"idemctl_bench_cycle_{os.getpid()}"
    _fresh_database(admin, name)
    url = _db_url(base, name)
    ledger = Ledger.open(url)
    ledger.init()
    raw = _connect(base, name)
    cur = raw.cursor()
    n, reps = ctx.size(1000, 30), ctx.size(6, 3)

    def floor(rep: int) -> None:
        now = now_ms()
        for i in range(n):
            row = {"principal": "acct_bench", "key": f"raw-{rep}-{i}", "token": i + 1}
            assert cur.execute(sql_claim, {**row, "fingerprint": FINGERPRINT, "now": now}) == 1
            done = {"generation": cur.lastrowid, "status": 201, "body": STORED_1K, "headers": RESPONSE_HEADERS_JSON}
            cur.execute(sql_complete, {**row, **done, "now": now + 1})

    def ours(rep: int) -> None:
        for i in range(n):
            ledger.handle("acct_bench", f"led-{rep}-{i}", "POST", "/orders", HEADERS, BODY_1K, noop_mutation)

    def ours_and_sweep(rep: int) -> None:
        for i in range(n):
            answer = ledger.handle("acct_bench", f"aft-{rep}-{i}", "POST", "/orders", HEADERS, BODY_1K, noop_mutation)
            ledger.after_response(answer)

    def lookup(rep: int) -> None:
        for i in range(n):
            cur.execute(sql_lookup, {"principal": "acct_bench", "key": f"led-0-{i % 50}"})
            cur.fetchall()

    def replay(rep: int) -> None:
        for i in range(n):
            ledger.handle("acct_bench", f"led-0-{i % 50}", "POST", "/orders", HEADERS, BODY_1K, noop_mutation)

    assert (
        ledger.handle("acct_bench", "check", "POST", "/o", HEADERS, BODY_1K, noop_mutation).outcome is Outcome.EXECUTED
    )
    rates: dict[str, list[float]] = {"floor": [], "handle": [], "handle_after": [], "pk_select": [], "replay": []}
    variants = {"floor": floor, "handle": ours, "handle_after": ours_and_sweep, "pk_select": lookup, "replay": replay}
    rotation = ["floor", "handle", "handle_after"]
    for rep in range(reps):
        order = rotation[rep % 3 :] + rotation[: rep % 3]
        for variant in order:
            rates[variant].append(n / timed(lambda: variants[variant](rep)))
        for variant in ("pk_select", "replay"):
            rates[variant].append(n / timed(lambda: variants[variant](rep)))
    ledger.close()
    raw.close()
    _drop(admin, name)
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
        "replay": {
            "ops_per_s": spread(rates["replay"], 1),
            "ratio": spread([a / b for a, b in zip(rates["replay"], rates["pk_select"])]),
        },
    }


def contend(ctx: Context, base: str, admin) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    seconds = 10.0 if not ctx.quick else 0.4
    out: dict[str, Any] = {"seconds_per_config": seconds, "configs": []}
    single = None
    for workers in (1, 8):
        name = f"idemctl_bench_contention_{workers}_{os.getpid()}"
        _fresh_database(admin, name)
        res = contention.measure(_db_url(base, name), "n/a", False, workers, seconds)
        res.pop("synchronous")
        res.pop("write_queue")
        if single is None:
            single = res
        res["ratio_to_single"] = spread([a / single["throughput"]["median"] for a in res["throughput"]["values"]])
        res["ratio_to_single"]["total"] = round(res["requests"] / single["requests"], 3)
        ctx.log(
            f"  mariadb contention x{workers}: {res['requests'] / seconds:.0f} req/s, p99 {res['latency']['p99_ms']} ms, "
            f"max {res['latency']['max_ms']} ms, errors {res['error_count']}"
        )
        out["configs"].append(res)
        _drop(admin, name)
    return out


# MariaDB's SEQUENCE engine (seq_1_to_N) makes the rows in one statement.
LOAD = """
INSERT INTO idempotency_keys
  (principal, `key`, fingerprint, status, generation, response_status, response_body, response_headers,
   created_at, updated_at)
SELECT CONCAT('acct_', LPAD(MOD(seq, 1000), 4, '0')), MD5(CONCAT(%(seed)s, seq)), REPEAT('e', 64),
       IF(MOD(seq, 10) = 0, 'pending', 'completed'), 1, IF(MOD(seq, 10) = 0, NULL, 201),
       IF(MOD(seq, 10) = 0, NULL, REPEAT('o', 256)),
       IF(MOD(seq, 10) = 0, NULL, '{"content-type":"application/json"}'),
       %(at)s + seq, %(at)s + seq
FROM seq_1_to_N
"""


def _load(admin, base: str, name: str, expired: int, live: int) -> None:  # type: ignore[no-untyped-def]
    _fresh_database(admin, name)
    Ledger.open(_db_url(base, name)).init()
    conn = _connect(base, name)
    with conn.cursor() as cur:
        cur.execute(
            LOAD.replace("seq_1_to_N", f"seq_1_to_{int(expired)}"), {"seed": "x", "at": now_ms() - 2 * DAY_MS - 10**7}
        )
        cur.execute(LOAD.replace("seq_1_to_N", f"seq_1_to_{int(live)}"), {"seed": "live", "at": now_ms()})
        cur.execute("ANALYZE TABLE idempotency_keys")
        cur.fetchall()
    conn.close()


def sweep(ctx: Context, base: str, admin) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    expired, live = ctx.size(10**6, 3000), ctx.size(10**4, 100)
    out: dict[str, Any] = {"expired_rows": expired, "live_rows": live}
    floor_db = f"idemctl_bench_sweep_floor_{os.getpid()}"
    ours_db = f"idemctl_bench_sweep_ours_{os.getpid()}"
    out["load_s"] = round(timed(lambda: _load(admin, base, floor_db, expired, live)), 2)
    raw = _connect(base, floor_db)
    cutoff = now_ms() - DAY_MS
    with Claimer(_db_url(base, floor_db)) as claimer, raw.cursor() as cur:
        t0 = time.perf_counter()
        deleted = cur.execute("DELETE FROM idempotency_keys WHERE updated_at < %s", (cutoff,))
        delete_s = time.perf_counter() - t0
        time.sleep(0.2)
    raw.close()
    out["floor"] = {"deleted": deleted, "delete_s": round(delete_s, 3), "claimer": claimer.result}
    _drop(admin, floor_db)
    ctx.log(f"  mariadb sweep: unbounded DELETE {delete_s:.1f} s")
    _load(admin, base, ours_db, expired, live)
    url = _db_url(base, ours_db)
    with Claimer(url) as claimer:
        res = run_measured(cli("sweep", "--db", url, "--json"))
    if res["exit_code"] != 0:
        raise RuntimeError(f"idemctl sweep on MariaDB failed: {res['stderr_tail']}")
    summary = json.loads(res["stdout"])
    check = _connect(base, ours_db)
    with check.cursor() as cur:
        cur.execute("SELECT count(*) FROM idempotency_keys WHERE updated_at < %s", (cutoff,))
        left = cur.fetchone()[0]
        cur.execute(
            "SELECT count(*) FROM idempotency_keys WHERE updated_at >= %s AND principal <> 'acct_claimer'", (cutoff,)
        )
        survivors = cur.fetchone()[0]
    check.close()
    _drop(admin, ours_db)
    if left != 0 or survivors != live:
        raise AssertionError(f"MariaDB sweep left {left} expired rows, {survivors}/{live} live rows")
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
    ctx.log(f"  mariadb sweep: idemctl sweep {res['seconds']:.1f} s")
    return out


def run(ctx: Context) -> dict[str, Any]:
    base = os.environ.get(URL_ENV, DEFAULT_URL)
    try:
        import pymysql  # noqa: F401

        from idemctl.storage.mysql import MysqlEngine  # noqa: F401
    except ImportError as exc:
        return {"missing": f"MariaDB backend or driver not importable ({exc})"}
    try:
        admin = _connect(base)
    except Exception as exc:
        return {"missing": f"no MariaDB server at {base}: {str(exc).splitlines()[0]}"}
    with admin.cursor() as cur:
        cur.execute(
            "SELECT @@version, @@innodb_flush_log_at_trx_commit, @@sync_binlog, @@log_bin,"
            " @@innodb_buffer_pool_size, @@innodb_doublewrite"
        )
        values = cur.fetchone()
    keys = (
        "version",
        "innodb_flush_log_at_trx_commit",
        "sync_binlog",
        "log_bin",
        "innodb_buffer_pool_size",
        "innodb_doublewrite",
    )
    server = dict(zip(keys, values))
    try:
        return {
            "server": server,
            "measured_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cycle": cycle(ctx, base, admin),
            "contention": contend(ctx, base, admin),
            "sweep": sweep(ctx, base, admin),
        }
    finally:
        admin.close()
