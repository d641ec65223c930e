"""init, schema versions, and databases written by the recipe's own Worker."""

from __future__ import annotations

import sqlite3

import pytest

from idemctl import Ledger, Outcome, State, Status
from idemctl.errors import SchemaMissingError, SchemaOutdatedError, SchemaTooNewError
from idemctl.outcomes import InitAction

# As the recipe's Cloudflare Worker creates it (D1 / wrangler's local SQLite).
RECIPE_DDL = """
CREATE TABLE idempotency_keys (
  principal         TEXT NOT NULL,                   -- server-derived account/user id, never client-supplied
  key               TEXT NOT NULL,
  fingerprint       TEXT NOT NULL,
  status            TEXT NOT NULL DEFAULT 'pending', -- 'pending' | 'completed'
  generation        INTEGER NOT NULL DEFAULT 1,      -- fencing token, bumped on takeover
  response_status   INTEGER,
  response_body     TEXT,                            -- bounded, see Response Lifecycle
  response_headers  TEXT,                             -- JSON-encoded allowlisted headers
  created_at        INTEGER NOT NULL,
  updated_at        INTEGER NOT NULL,
  PRIMARY KEY (principal, key)
);

CREATE INDEX idx_idempotency_keys_updated_at ON idempotency_keys (updated_at);
"""

RECIPE_COLUMNS = "principal, key, fingerprint, status, generation, response_status, response_body, response_headers, created_at, updated_at"
NOW = 1_700_000_000_000
DAY = 86_400_000


def recipe_database(path) -> list[tuple]:
    conn = sqlite3.connect(path)
    conn.executescript(RECIPE_DDL)
    rows = [
        (
            "acct_1",
            "done",
            "fp1",
            "completed",
            1,
            201,
            '{"id":1}',
            '{"content-type":"application/json"}',
            NOW - 1000,
            NOW - 900,
        ),
        ("acct_1", "running", "fp2", "pending", 1, None, None, None, NOW - 1000, NOW - 1000),
        ("acct_1", "stale", "fp3", "pending", 2, None, None, None, NOW - 90_000, NOW - 60_000),
        ("acct_2", "old", "fp4", "completed", 1, 200, "ok", "{}", NOW - 2 * DAY, NOW - 2 * DAY),
    ]
    conn.executemany("INSERT INTO idempotency_keys VALUES (?,?,?,?,?,?,?,?,?,?)", rows)
    conn.commit()
    conn.close()
    return rows


def dump(path) -> list[tuple]:
    conn = sqlite3.connect(path)
    try:
        # The recipe's columns: what every writer of the ledger shares.
        return conn.execute(f"SELECT {RECIPE_COLUMNS} FROM idempotency_keys ORDER BY principal, key").fetchall()
    finally:
        conn.close()


def tables(path) -> set[str]:
    conn = sqlite3.connect(path)
    try:
        return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'index')")}
    finally:
        conn.close()


def test_init_creates_then_is_idempotent(ledger_target, clock):
    ledger = Ledger.open(ledger_target, clock=clock)
    assert ledger.schema_version() is None
    first = ledger.init()
    assert (first.action, first.from_version, first.to_version) == (InitAction.CREATED, None, 3)
    assert first.describe() == "created (schema version 3)"
    again = ledger.init()
    assert (again.action, again.from_version) == (InitAction.UP_TO_DATE, 3)
    assert again.describe() == "already up to date (schema version 3)"
    assert ledger.schema_version() == 3
    ledger.close()


def test_init_dry_run_writes_nothing(tmp_path):
    path = tmp_path / "l.db"
    ledger = Ledger.open(path)
    result = ledger.init(dry_run=True)
    assert (result.action, result.dry_run) == (InitAction.CREATED, True)
    assert ledger.schema_version() is None
    assert "idempotency_keys" not in tables(path)
    ledger.close()


def test_init_creates_the_recipe_table_unchanged_plus_new_tables(tmp_path):
    path = tmp_path / "l.db"
    Ledger.open(path).init()
    assert tables(path) >= {
        "idempotency_keys",
        "idx_idempotency_keys_updated_at",
        "idemctl_fenced_out",
        "idemctl_schema_version",
    }
    conn = sqlite3.connect(path)
    cols = [(r[1], r[2], r[3], r[4], r[5]) for r in conn.execute("PRAGMA table_info(idempotency_keys)")]
    assert cols == [
        ("principal", "TEXT", 1, None, 1),
        ("key", "TEXT", 1, None, 2),
        ("fingerprint", "TEXT", 1, None, 0),
        ("status", "TEXT", 1, "'pending'", 0),
        ("generation", "INTEGER", 1, "1", 0),
        ("response_status", "INTEGER", 0, None, 0),
        ("response_body", "TEXT", 0, None, 0),
        ("response_headers", "TEXT", 0, None, 0),
        ("created_at", "INTEGER", 1, None, 0),
        ("updated_at", "INTEGER", 1, None, 0),
        # Added by schema version 2: nullable, so the recipe's INSERT still works.
        ("token", "INTEGER", 0, None, 0),
    ]
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()


def test_recipe_database_is_readable_and_sweepable_without_init(tmp_path):
    path = tmp_path / "recipe.db"
    recipe_database(path)
    ledger = Ledger.open(path, clock=lambda: NOW)
    assert ledger.schema_version() == 0
    assert ledger.operator.get("acct_1", "done").state is State.COMPLETED
    assert ledger.operator.get("acct_1", "running").state is State.PENDING_FRESH
    assert ledger.operator.get("acct_1", "stale").state is State.PENDING_STALE
    assert ledger.operator.get("acct_2", "old").state is State.EXPIRED
    stats = ledger.operator.stats()
    assert (
        stats.total,
        stats.pending_fresh,
        stats.pending_stale,
        stats.completed,
        stats.expired,
        stats.taken_over,
    ) == (
        4,
        1,
        1,
        1,
        1,
        1,
    )
    assert stats.fenced_out_events == 0 and stats.schema_version == 0
    assert [v.row.key for v in ledger.operator.pending()] == ["stale", "running"]
    assert list(ledger.operator.fenced()) == []
    ledger.close()


def test_requests_on_a_recipe_database_are_refused_until_init_adds_the_fencing_token(tmp_path):
    path = tmp_path / "recipe.db"
    rows = recipe_database(path)
    ledger = Ledger.open(path, clock=lambda: NOW)
    ran = []
    with pytest.raises(SchemaOutdatedError, match=r"has an older ledger schema; requests need the current one"):
        ledger.handle("acct_1", "new", "POST", "/", {}, b"", lambda b: ran.append(b) or (201, {}, b"x"))
    assert ran == [] and dump(path) == sorted(rows)
    ledger.init()
    # A request whose fingerprint is not the stored one is a reuse, as in the Worker.
    other = ledger.handle("acct_1", "done", "POST", "/", {}, b"", lambda b: (500, {}, b""))
    assert (other.status, other.outcome) == (409, Outcome.REUSED)
    fresh = ledger.handle("acct_1", "new", "POST", "/", {}, b"", lambda b: ran.append(b) or (201, {}, b"x"))
    assert (fresh.status, fresh.outcome, fresh.body, ran) == (201, Outcome.EXECUTED, b"x", [b""])
    ledger.close()


def test_recipe_rows_replay_after_the_upgrade_when_fingerprints_match(tmp_path):
    from idemctl import fingerprint

    path = tmp_path / "recipe.db"
    conn = sqlite3.connect(path)
    conn.executescript(RECIPE_DDL)
    fp = fingerprint("POST", "/orders", {"content-type": "application/json"}, b'{"a":1}')
    conn.execute(
        "INSERT INTO idempotency_keys VALUES (?,?,?,?,?,?,?,?,?,?)",
        ("acct", "k", fp, "completed", 1, 201, '{"id":9}', '{"content-type":"application/json"}', NOW, NOW),
    )
    conn.commit()
    conn.close()
    ledger = Ledger.open(path, clock=lambda: NOW)
    ledger.init()
    answer = ledger.handle(
        "acct", "k", "POST", "/orders", {"content-type": "application/json"}, b'{"a":1}', lambda b: (500, {}, b"")
    )
    assert (answer.outcome, answer.status, answer.headers, answer.body) == (
        Outcome.REPLAYED,
        201,
        (("content-type", "application/json"),),
        b'{"id":9}',
    )
    other = ledger.handle("acct", "k", "POST", "/orders", {}, b"{}", lambda b: (500, {}, b""))
    assert other.outcome is Outcome.REUSED
    ledger.close()


def test_recipe_database_sweep_works_without_fenced_log(tmp_path):
    path = tmp_path / "recipe.db"
    recipe_database(path)
    ledger = Ledger.open(path, clock=lambda: NOW)
    result = ledger.operator.sweep()
    assert (result.keys_deleted, result.fenced_deleted) == (1, 0)
    assert ledger.lookup("acct_2", "old") is None
    ledger.close()


def test_a_recipe_reservation_cannot_be_completed_by_a_hand_made_reservation_after_the_upgrade(tmp_path, caplog):
    # Rows the recipe wrote carry no token: no idemctl owner can complete them,
    # only take them over once stale.
    path = tmp_path / "recipe.db"
    recipe_database(path)
    ledger = Ledger.open(path, clock=lambda: NOW)
    ledger.init()
    late = ledger.lookup("acct_1", "stale")
    from idemctl import Reservation

    done = ledger.complete(Reservation("acct_1", "stale", 2, late.fingerprint), 200, {}, b"late")
    assert (done.stored, done.event.superseded_generation, done.event.current_generation) == (False, 2, 2)
    assert "fenced out: principal=acct_1 key=stale generation=2" in caplog.text
    assert ledger.lookup("acct_1", "stale").status is Status.PENDING
    taken = ledger.takeover("acct_1", "stale", late.fingerprint)
    assert (taken.generation, ledger.complete(taken, 200, {}, b"ok").stored) == (3, True)
    ledger.close()


def test_init_on_recipe_database_adds_only_new_tables_and_touches_no_row(tmp_path):
    path = tmp_path / "recipe.db"
    recipe_database(path)
    before_rows = dump(path)
    conn = sqlite3.connect(path)
    before_sql = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'idempotency_keys'").fetchone()[0]
    conn.close()
    ledger = Ledger.open(path, clock=lambda: NOW)
    result = ledger.init()
    assert (result.action, result.from_version, result.to_version) == (InitAction.UPGRADED, 0, 3)
    assert result.describe() == "upgraded from 0 to 3"
    assert dump(path) == before_rows
    conn = sqlite3.connect(path)
    # The recipe's table as it was, plus one nullable column its statements
    # ignore and the key's identity, computed by SQLite (a virtual column).
    after_sql = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'idempotency_keys'").fetchone()[0]
    added = after_sql.split("updated_at        INTEGER NOT NULL, token INTEGER, ", 1)
    assert (
        added[0] + "updated_at        INTEGER NOT NULL," + added[1][added[1].index("\n  PRIMARY KEY") :] == before_sql
    )
    assert added[1].startswith("key_id TEXT GENERATED ALWAYS AS (")
    assert conn.execute("SELECT version, applied_at FROM idemctl_schema_version").fetchall() == [(3, NOW)]
    conn.close()
    # Now fenced events are recorded.
    late = ledger.lookup("acct_1", "stale")
    from idemctl import Reservation

    assert ledger.complete(Reservation("acct_1", "stale", 1, late.fingerprint), 200, {}, b"x").event is not None
    ledger.close()


def test_newer_schema_is_refused_at_open_and_nothing_is_written(tmp_path):
    path = tmp_path / "future.db"
    Ledger.open(path).init()
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO idemctl_schema_version VALUES (4, 0)")
    conn.commit()
    conn.close()
    before = dump(path)
    with pytest.raises(SchemaTooNewError, match=r"has ledger schema version 4; this idemctl knows up to 3$"):
        Ledger.open(path)
    assert dump(path) == before


def test_request_on_database_without_schema_says_run_init(tmp_path):
    path = tmp_path / "empty.db"
    ledger = Ledger.open(path)
    with pytest.raises(SchemaMissingError, match=r"has no idempotency ledger \(ledger\.init\(\) creates it\)$"):
        ledger.handle("acct", "k", "POST", "/", {}, b"", lambda b: (200, {}, b""))
    with pytest.raises(SchemaMissingError):
        ledger.operator.stats()
    ledger.close()


def test_concurrent_inits_from_threads_create_exactly_once(tmp_path):
    import threading

    path = tmp_path / "l.db"
    results = []
    ledgers = [Ledger.open(path) for _ in range(6)]
    barrier = threading.Barrier(len(ledgers))

    def go(ledger):
        barrier.wait()
        results.append(ledger.init().action)

    threads = [threading.Thread(target=go, args=(lg,)) for lg in ledgers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(a.value for a in results) == sorted(["created"] + ["already up to date"] * 5)
    for lg in ledgers:
        lg.close()
