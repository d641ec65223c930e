"""Lease renewal on a ledger of 10^6 rows, on every engine: each renewal
reaches its rows through the primary key (the engine's own EXPLAIN says so),
so a tick costs the same however large the ledger grows, and a live owner
with a short TTL and a long mutation is never taken over while 300 other
reservations of the process are renewed with it.

The rows are written by one INSERT … SELECT from a generated series (a
recursive CTE on SQLite, generate_series on PostgreSQL, the sequence engine
on MariaDB), not row by row, so the full 10^6 rows fit on every engine:
filling and the test together took 7.6 s on SQLite, 9.9 s on PostgreSQL
and 11.0 s on MariaDB (30 s for the module) on 2 cores with a load average
near 7.
Before, renewal was a full scan on SQLite (`SCAN idempotency_keys`) and on
MariaDB (type `index`, a dependent subquery per row: 2–3 s a tick at this
size with 300 reservations), and a live owner with a 3 s TTL was taken over
and ran twice."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import pytest

from idemctl import Outcome, Policy
from idemctl.leases import LeaseTick
from tests.helpers import mysql_connect_args, steady_ms

# The SQL engines: their planners must be shown to reach each row by its
# key (EXPLAIN). On Redis a renewal is one script per reservation on its own
# key, with no planner between (tests/storage/test_redis_engine.py renews there).
pytestmark = [pytest.mark.slow, pytest.mark.engines("sqlite", "postgres", "mysql")]

ROWS = 1_000_000
HELD = 300  # live reservations of this process, renewed together each tick
TTL = 1500  # ms: renewal every 0.5 s; takeover 1.5 s after a missed renewal


def fill(backend_name: str, target: str, rows: int) -> None:
    """`rows` completed rows of another principal, in one statement: keys in
    primary-key order, so the bulk insert appends to the index."""
    columns = "principal, key, fingerprint, status, generation, created_at, updated_at, token"
    values = "'acct_bulk', {key}, 'fp', 'completed', 1, 1700000000000 + g, 1700000000000 + g, g"
    if backend_name == "sqlite":
        import sqlite3

        conn = sqlite3.connect(target, isolation_level=None)
        try:
            conn.execute(
                f"WITH RECURSIVE s(g) AS (SELECT 1 UNION ALL SELECT g + 1 FROM s WHERE g < {rows}) "
                f"INSERT INTO idempotency_keys ({columns}) SELECT "
                + values.format(key="printf('k-%07d', g)")
                + " FROM s"
            )
        finally:
            conn.close()
    elif backend_name == "postgres":
        import psycopg

        with psycopg.connect(target, autocommit=True) as conn:
            conn.execute(
                f"INSERT INTO idempotency_keys ({columns}) SELECT "
                + values.format(key="'k-' || lpad(g::text, 7, '0')")
                + f" FROM generate_series(1, {rows}) AS g"
            )
            conn.execute("ANALYZE idempotency_keys")  # as autovacuum would, long before 10^6 rows
    else:
        import pymysql

        conn = pymysql.connect(**mysql_connect_args(target))
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT version()")
                mariadb = "mariadb" in str(cur.fetchone()[0]).lower()
                source = f"(SELECT seq AS g FROM seq_1_to_{rows}) AS s" if mariadb else _mysql_series(cur, rows)
                cur.execute(
                    f"INSERT INTO idempotency_keys ({columns.replace(' key,', ' `key`,')}) SELECT "
                    + values.format(key="CONCAT('k-', LPAD(g, 7, '0'))")
                    + f" FROM {source}"
                )
                cur.execute("ANALYZE TABLE idempotency_keys")
                cur.fetchall()
        finally:
            conn.close()


def _mysql_series(cur: Any, rows: int) -> str:
    # MySQL has no sequence engine: six joined digits.
    digits = "(SELECT 0 AS d UNION ALL " + " UNION ALL ".join(f"SELECT {i}" for i in range(1, 10)) + ")"
    parts = " CROSS JOIN ".join(f"{digits} AS d{i}" for i in range(6))
    number = " + ".join(f"d{i}.d * {10**i}" for i in range(6))
    return f"(SELECT {number} + 1 AS g FROM {parts} HAVING g <= {rows}) AS s"


def plan(backend_name: str, target: str, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The engine's own plan for a renewal statement, as it spells it."""
    if backend_name == "sqlite":
        import sqlite3

        with contextlib.closing(sqlite3.connect(target)) as conn:
            return conn.execute("EXPLAIN QUERY PLAN " + sql, params).fetchall()
    if backend_name == "postgres":
        import psycopg

        with psycopg.connect(target) as conn, psycopg.ClientCursor(conn) as cur:
            cur.execute("EXPLAIN " + sql, params)
            return cur.fetchall()
    import pymysql

    conn = pymysql.connect(**mysql_connect_args(target))
    try:
        with conn.cursor() as cur:
            cur.execute("EXPLAIN " + sql, params)
            return list(cur.fetchall())
    finally:
        conn.close()


def assert_reaches_rows_by_primary_key(backend_name: str, steps: list[tuple[Any, ...]], reservations: int) -> None:
    if backend_name == "sqlite":
        details = [step[-1] for step in steps]
        assert details == ["SEARCH idempotency_keys USING INDEX idx_idempotency_keys_key_id (principal=? AND key_id=?)"]
    elif backend_name == "postgres":
        text = "\n".join(step[0] for step in steps)
        assert "Index Scan using idx_idempotency_keys_key_id on idempotency_keys" in text, text
        assert "Index Cond: ((principal = " in text and "Seq Scan" not in text, text
    else:
        # id, select_type, table, type, possible_keys, key, key_len, ref, rows, Extra
        assert len(steps) == 1, steps
        (row,) = steps
        table, access, key, rows = row[2], row[3], row[5], int(row[8])
        assert (table, access, key) == ("idempotency_keys", "range", "idx_idempotency_keys_key_id"), row
        assert rows <= 2 * reservations, row  # one index probe per reservation, not the table


def test_renewal_uses_the_primary_key_and_never_lets_a_live_owner_be_taken_over_at_a_million_rows(
    make_ledger, ledger_target, backend_name
):
    owner = make_ledger(policy=Policy(pending_ttl_ms=TTL, lease_renewal=True), clock_fn=steady_ms)
    fill(backend_name, ledger_target, ROWS)
    assert owner.operator.count_rows() == ROWS
    tickets = [owner.begin("acct_live", f"held-{i:03d}", "POST", "/orders", {}, b"{}") for i in range(HELD)]
    held = [t.reservation for t in tickets]
    assert all(r is not None for r in held) and owner.leases is not None and owner.leases.held() == HELD

    # What EXPLAIN says about the very statements a tick runs.
    statements = owner.store.renew_statements(
        [(r.principal, r.key, r.generation, r.token) for r in held if r is not None], steady_ms()
    )
    if backend_name == "sqlite":
        assert len(statements) == HELD  # one primary-key UPDATE each, in one transaction
    else:
        assert len(statements) == 1  # up to 512 reservations a statement
    sql, params = statements[0]
    assert_reaches_rows_by_primary_key(backend_name, plan(backend_name, ledger_target, sql, params), HELD)

    ticks: list[LeaseTick] = []
    owner.leases.subscribe(ticks.append)
    runs: list[str] = []
    started = threading.Event()
    answers: list[Any] = []

    def mutation(body: bytes) -> tuple[int, dict[str, str], bytes]:
        runs.append("owner")
        started.set()
        time.sleep(3 * TTL / 1000)  # three TTLs: only renewal keeps the key
        return 201, {"content-type": "text/plain"}, b"made once"

    worker = threading.Thread(
        target=lambda: answers.append(owner.handle("acct_A", "k-slow", "POST", "/orders", {}, b"{}", mutation))
    )
    worker.start()
    assert started.wait(30)
    claimed = time.monotonic()

    def second_claimant(body: bytes) -> tuple[int, dict[str, str], bytes]:
        runs.append("other")
        return 201, {}, b"twice"

    # A second claimant in another ledger object (no leases of its own), each
    # time past the TTL since the claim: 409 in progress, never a takeover.
    other = make_ledger(policy=Policy(pending_ttl_ms=TTL), clock_fn=steady_ms, init=False)
    seen = []
    for at in (1.3, 2.1, 2.9, 4.0):  # in TTLs since the claim
        time.sleep(max(0.0, claimed + at * TTL / 1000 - time.monotonic()))
        if not worker.is_alive():
            break
        seen.append(other.handle("acct_A", "k-slow", "POST", "/orders", {}, b"{}", second_claimant).outcome)
    worker.join(30)
    assert seen and set(seen) == {Outcome.IN_PROGRESS}, seen
    assert runs == ["owner"]
    assert answers[0].outcome is Outcome.EXECUTED
    assert (
        other.handle("acct_A", "k-slow", "POST", "/orders", {}, b"{}", lambda body: (500, {}, b"")).body == b"made once"
    )
    # Every tick renewed every live reservation, whatever the 10^6 rows beside them.
    done = [t for t in ticks if t.done]
    assert done and all(t.error is None for t in done)
    # (MariaDB counts the rows whose updated_at changed: one claimed in the
    # tick's own millisecond would not count.)
    slack = 1 if backend_name == "mysql" else 0
    assert all(t.renewed is not None and t.reservations - slack <= t.renewed <= t.reservations for t in done)
    assert any(t.reservations == t.renewed == HELD + 1 for t in done)
    for ticket in tickets:
        owner.finish(ticket, 201, {}, b"")
    assert owner.leases.held() == 0
