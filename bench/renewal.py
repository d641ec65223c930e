"""(12) Lease renewal: what one tick costs as the ledger grows, on every engine.

A process holds 300 live reservations (`Policy(lease_renewal=True)` renews
them together every third of the TTL). The ledger around them grows from
10^4 to 10^6 completed rows (one bulk INSERT … SELECT a step, keys in
primary-key order) and, at each size, a tick is timed both ways:

- *now*: `Store.renew`, as the lease keeper runs it: every row reached
  through the key's unique index, (principal, key_id) (one UPDATE per
  reservation in one transaction on SQLite, one statement with an OR of
  key equalities on MariaDB, `IN (VALUES …)` on PostgreSQL);
- *before*: the single `UPDATE … WHERE (principal, key, generation, token)
  IN (VALUES …)` every engine ran until this release, which SQLite and
  MariaDB plan as a scan of the whole table or index.

Each figure is the median of several ticks, in ms; the engine's own plan
for each statement is recorded beside it. A tick must stay well inside a
sixth of the TTL (the keeper calls a renewal late at half the TTL, and
ticks are due every third).

Run on its own: `python -m bench.renewal` (add `--quick` for tiny sizes)
merges its section into bench/results/latest.json and renders
docs/performance.md; `python -m bench --only renewal --merge` does the same."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from idemctl import Ledger, Policy

from .common import LATEST, PAGE, Context, git_commit, now_ms

HELD = 300
PG_URL = os.environ.get("IDEMCTL_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
MYSQL_URL = os.environ.get("IDEMCTL_BENCH_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
COLUMNS = "principal, key, fingerprint, status, generation, created_at, updated_at, token"


def _values(key: str) -> str:
    return f"'acct_bulk', {key}, 'fp', 'completed', 1, 1700000000000 + g, 1700000000000 + g, g"


class Target:
    """One engine's ledger for the run, its bulk filler and its EXPLAIN."""

    name: str
    url: str

    def grow(self, first: int, last: int) -> None:
        raise NotImplementedError

    def plan(self, sql: str, params: dict[str, Any]) -> str:
        raise NotImplementedError

    def close(self) -> None:
        pass


class SqliteTarget(Target):
    name = "SQLite"

    def __init__(self, workdir: str) -> None:
        self.url = os.path.join(workdir, "renewal.db")
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.url + suffix)

    def grow(self, first: int, last: int) -> None:
        import sqlite3

        with contextlib.closing(sqlite3.connect(self.url, isolation_level=None)) as conn:
            conn.execute(
                f"WITH RECURSIVE s(g) AS (SELECT {first} UNION ALL SELECT g + 1 FROM s WHERE g < {last}) "
                f"INSERT INTO idempotency_keys ({COLUMNS}) SELECT " + _values("printf('k-%07d', g)") + " FROM s"
            )
            # Settle the bulk insert into the file, as a ledger that grew
            # over days would be: else the first ticks checkpoint it.
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def plan(self, sql: str, params: dict[str, Any]) -> str:
        import sqlite3

        with contextlib.closing(sqlite3.connect(self.url)) as conn:
            return "; ".join(str(r[-1]) for r in conn.execute("EXPLAIN QUERY PLAN " + sql, params))


class PostgresTarget(Target):
    name = "PostgreSQL"

    def __init__(self) -> None:
        from urllib.parse import quote

        import psycopg

        self.schema = f"idemctl_bench_renewal_{os.getpid()}"
        self.admin = psycopg.connect(PG_URL, autocommit=True, connect_timeout=5)
        self.admin.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')
        self.admin.execute(f'CREATE SCHEMA "{self.schema}"')
        sep = "&" if "?" in PG_URL else "?"
        self.url = f"{PG_URL}{sep}options={quote(f'-csearch_path={self.schema}')}"

    def grow(self, first: int, last: int) -> None:
        self.admin.execute(
            f'INSERT INTO "{self.schema}".idempotency_keys ({COLUMNS}) SELECT '
            + _values("'k-' || lpad(g::text, 7, '0')")
            + f" FROM generate_series({first}, {last}) AS g"
        )
        self.admin.execute(f'ANALYZE "{self.schema}".idempotency_keys')

    def plan(self, sql: str, params: dict[str, Any]) -> str:
        import psycopg

        with psycopg.connect(self.url) as conn, psycopg.ClientCursor(conn) as cur:
            cur.execute("EXPLAIN " + sql, params)
            return "; ".join(r[0].strip() for r in cur.fetchall() if "Scan" in r[0] or "Loop" in r[0])

    def close(self) -> None:
        self.admin.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')
        self.admin.close()


class MysqlTarget(Target):
    name = "MariaDB"

    def __init__(self) -> None:
        import pymysql

        from idemctl.storage.mysql import MysqlEngine

        self.database = f"idemctl_bench_renewal_{os.getpid()}"
        probe = MysqlEngine(MYSQL_URL)
        try:
            self.admin: Any = probe._connect().conn
        finally:
            probe.close()
        assert isinstance(self.admin, pymysql.connections.Connection)
        with self.admin.cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS {self.database}")
            cur.execute(f"CREATE DATABASE {self.database} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
            cur.execute("SELECT version()")
            self.version = str(cur.fetchone()[0])
        head, _, query = MYSQL_URL.partition("?")
        self.url = head.rsplit("/", 1)[0] + f"/{self.database}" + (f"?{query}" if query else "")

    def grow(self, first: int, last: int) -> None:
        with self.admin.cursor() as cur:
            cur.execute(
                f"INSERT INTO {self.database}.idempotency_keys ({COLUMNS.replace(' key,', ' `key`,')}) SELECT "
                + _values("CONCAT('k-', LPAD(g, 7, '0'))")
                + f" FROM (SELECT seq AS g FROM seq_{first}_to_{last}) AS s"
            )
            cur.execute(f"ANALYZE TABLE {self.database}.idempotency_keys")
            cur.fetchall()

    def plan(self, sql: str, params: dict[str, Any]) -> str:
        with self.admin.cursor() as cur:
            cur.execute(f"USE {self.database}")
            cur.execute("EXPLAIN " + sql, params)
            return "; ".join(f"{r[1]} {r[2]}: type {r[3]}, key {r[5]}, rows {r[8]}" for r in cur.fetchall())

    def close(self) -> None:
        with self.admin.cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS {self.database}")
        self.admin.close()


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times), 2)


def _measure(ctx: Context, target: Target, sizes: list[int]) -> dict[str, Any]:
    from idemctl.storage.statements import renew_text

    ledger = Ledger.open(target.url, policy=Policy(pending_ttl_ms=3000))
    try:
        ledger.init()
        store = ledger.store
        held = []
        for i in range(HELD):
            r = ledger.claim("acct_live", f"held-{i:03d}", "fp")
            assert r is not None
            held.append((r.principal, r.key, r.generation, r.token))
        size = 1 << (HELD - 1).bit_length()
        padded = held + [held[-1]] * (size - HELD)
        before_sql = store.sql(renew_text(size, "values", store.dialect.returning))

        def before_params() -> dict[str, Any]:
            params: dict[str, Any] = {"now": now_ms()}
            for i, (p, k, g, t) in enumerate(padded):
                params.update({f"p{i}": p, f"k{i}": k, f"g{i}": g, f"t{i}": t})
            return params

        points = []
        grown = 0
        for rows in sizes:
            target.grow(grown + 1, rows)
            grown = rows
            now_sql, now_params = store.renew_statements(held, now_ms())[0]
            store.renew(held, now_ms())  # warm: the statements prepared, the pages cached
            point: dict[str, Any] = {
                "rows": rows,
                "now_ms": _median_ms(lambda: store.renew(held, now_ms()), ctx.size(9, 3)),
                "now_plan": target.plan(now_sql, now_params),
            }
            if store.dialect.renew_form != "values":
                store.engine.write(before_sql, before_params())
                # The old form is the slow one: fewer repetitions of it at the largest sizes.
                point["before_ms"] = _median_ms(
                    lambda: store.engine.write(before_sql, before_params()), ctx.size(3 if rows >= 10**6 else 5, 3)
                )
                point["before_plan"] = target.plan(before_sql, before_params())
            ctx.log(f"renewal {target.name} {rows:,} rows: {point}")
            points.append(point)
        return {"form": store.dialect.renew_form, "points": points}
    finally:
        ledger.close()


@contextlib.contextmanager
def _target(make: Callable[[], Target]) -> Iterator[Target | str]:
    try:
        target = make()
    except Exception as exc:
        yield f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return
    try:
        yield target
    finally:
        target.close()


def run(ctx: Context) -> dict[str, Any]:
    sizes = [10**4, 10**5, 3 * 10**5, 10**6] if not ctx.quick else [1000, 3000]
    res: dict[str, Any] = {"held": HELD, "sizes": sizes, "engines": {}}
    started = datetime.now(UTC).isoformat(timespec="seconds")
    loadavg_start = os.getloadavg()
    for key, make in (
        ("sqlite", lambda: SqliteTarget(ctx.workdir)),
        ("postgres", PostgresTarget),
        ("mysql", MysqlTarget),
    ):
        with _target(make) as target:
            if isinstance(target, str):
                res["engines"][key] = {"missing": target}
                continue
            res["engines"][key] = {"engine": target.name, **_measure(ctx, target, sizes)}
            if isinstance(target, MysqlTarget):
                res["engines"][key]["version"] = target.version
    res["run"] = {
        "started_utc": started,
        "finished_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "loadavg_start": loadavg_start,
        "loadavg_end": os.getloadavg(),
        "nproc": os.cpu_count() or 1,
    }
    return res


def main(argv: list[str] | None = None) -> int:
    from . import report

    p = argparse.ArgumentParser(prog="python -m bench.renewal", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks that the harness works, nothing else")
    p.add_argument("--dir", default=os.environ.get("IDEMCTL_BENCH_DIR"), help="where the SQLite file goes")
    p.add_argument("--out", default=LATEST, help="results JSON to merge the section into")
    p.add_argument("--page", default=PAGE, help="performance page to render (not with --quick)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    workdir = args.dir or tempfile.mkdtemp(prefix="idemctl-bench-renewal-")
    os.makedirs(workdir, exist_ok=True)

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)

    ctx = Context(workdir=workdir, quick=args.quick, log=log)
    res = run(ctx)
    print(json.dumps(res, indent=1))
    if args.quick:
        return 0
    with open(args.out, encoding="utf-8") as f:
        results = json.load(f)
    results["benchmarks"]["renewal"] = res
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, sort_keys=False)
        f.write("\n")
    report.write_page(args.page, results)
    log(f"merged into {args.out}; rendered {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
