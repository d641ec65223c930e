"""The PostgreSQL schema: the recipe's table and index under the same names,
init and versioning exactly as on SQLite, concurrent inits, and a database
that holds only the recipe's table."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator

import pytest

psycopg = pytest.importorskip("psycopg")

from idemctl import Ledger, Outcome, State, Status, StorageError, fingerprint  # noqa: E402
from idemctl.errors import (  # noqa: E402
    ReadOnlyDatabaseError,
    SchemaMissingError,
    SchemaOutdatedError,
    SchemaTooNewError,
)
from idemctl.outcomes import InitAction  # noqa: E402
from idemctl.schema import schema_files  # noqa: E402

# Only this engine's half: these checks mean nothing on the others.
pytestmark = pytest.mark.engines("postgres")

RECIPE_COLUMNS = "principal, key, fingerprint, status, generation, response_status, response_body, response_headers, created_at, updated_at"
NOW = 1_700_000_000_000
DAY = 86_400_000
DONE_FP = fingerprint("POST", "/orders", {}, b"{}")


@pytest.fixture
def pg(ledger_target: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(ledger_target, autocommit=True) as conn:
        yield conn


def pg_tables(pg: psycopg.Connection) -> set[str]:
    rows = pg.execute(
        "SELECT c.relname FROM pg_class c WHERE c.relnamespace = current_schema()::regnamespace"
        " AND c.relkind IN ('r', 'i')"
    ).fetchall()
    return {r[0] for r in rows}


def recipe_only(pg: psycopg.Connection) -> list[tuple]:
    """A database as the recipe leaves it: its table, its index, its rows."""
    pg.execute(schema_files("postgres")[0].sql)
    rows = [
        (
            "acct_1",
            "done",
            DONE_FP,
            "completed",
            1,
            201,
            b'{"id":1}',
            '{"content-type":"application/json"}',
            NOW - 1000,
            NOW - 900,
        ),
        ("acct_1", "running", "fp2", "pending", 1, None, None, None, NOW - 1000, NOW - 1000),
        ("acct_1", "stale", "fp3", "pending", 2, None, None, None, NOW - 90_000, NOW - 60_000),
        ("acct_2", "old", "fp4", "completed", 1, 200, b"ok", "{}", NOW - 2 * DAY, NOW - 2 * DAY),
    ]
    with pg.cursor() as cur:
        cur.executemany("INSERT INTO idempotency_keys VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)", rows)
    return rows


def dump(pg: psycopg.Connection) -> list[tuple]:
    # The recipe's columns: what every writer of the ledger shares.
    return pg.execute(f"SELECT {RECIPE_COLUMNS} FROM idempotency_keys ORDER BY principal, key").fetchall()


def test_ledger_table_has_the_recipes_columns_in_order_and_its_index(ledger, pg: psycopg.Connection) -> None:
    sqlite = sqlite3.connect(":memory:")
    sqlite.executescript(schema_files("sqlite")[0].sql)
    sqlite_columns = [(r[1], r[3], r[4]) for r in sqlite.execute("PRAGMA table_info(idempotency_keys)")]
    sqlite.close()
    pg_columns = pg.execute(
        "SELECT column_name, is_nullable = 'NO', column_default, data_type FROM information_schema.columns"
        " WHERE table_schema = current_schema() AND table_name = 'idempotency_keys' ORDER BY ordinal_position"
    ).fetchall()
    # Same names, order, NOT NULLs and defaults as the recipe's table, then
    # the nullable fencing-token column of schema version 2 and the key's
    # identity (computed by the database) of version 3.
    assert [(n, bool(nn), d) for n, nn, d, _ in pg_columns] == [
        (n, bool(nn), None if d is None else (f"{d}::text" if d.startswith("'") else d)) for n, nn, d in sqlite_columns
    ] + [("token", False, None), ("key_id", False, None)]
    types = {n: t for n, _, _, t in pg_columns}
    assert types == {
        "principal": "text",
        "key": "text",
        "fingerprint": "text",
        "status": "text",
        "generation": "integer",
        "response_status": "integer",
        "response_body": "bytea",
        "response_headers": "text",
        "created_at": "bigint",
        "updated_at": "bigint",
        "token": "bigint",
        "key_id": "text",
    }
    pk = pg.execute(
        "SELECT array_agg(a.attname ORDER BY k.ord) FROM pg_index i"
        " CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)"
        " JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum"
        " WHERE i.indrelid = 'idempotency_keys'::regclass AND i.indisprimary"
    ).fetchone()[0]
    assert pk == ["principal", "key"]
    index = pg.execute(
        "SELECT indexdef FROM pg_indexes WHERE indexname = 'idx_idempotency_keys_updated_at'"
    ).fetchone()[0]
    assert index.endswith("USING btree (updated_at)")
    assert pg_tables(pg) >= {"idempotency_keys", "idemctl_schema_version", "idemctl_fenced_out"}


def test_init_dry_run_reports_created_and_writes_nothing(make_ledger, pg: psycopg.Connection) -> None:
    ledger = make_ledger(init=False)
    result = ledger.init(dry_run=True)
    assert (result.action, result.from_version, result.dry_run) == (InitAction.CREATED, None, True)
    assert pg_tables(pg) == set()
    assert ledger.schema_version() is None


def test_request_on_an_empty_schema_is_schema_missing_until_init(make_ledger, pg: psycopg.Connection) -> None:
    ledger = make_ledger(init=False)
    with pytest.raises(
        SchemaMissingError,
        match=r"^postgresql://postgres@.* has no idempotency ledger \(ledger\.init\(\) creates it\)$",
    ):
        ledger.handle("acct", "k", "POST", "/o", {}, b"{}", lambda b: (201, {}, b"ok"))
    # Another process runs `idemctl init`; this ledger notices without reopening,
    # fenced-out log included.
    assert make_ledger(init=False).init().action is InitAction.CREATED
    first = ledger.claim("acct", "k", "fp")
    assert (first.principal, first.key, first.generation, first.fingerprint) == ("acct", "k", 1, "fp")
    second = ledger.takeover("acct", "k", "fp", now=ledger.now() + 60_000)
    assert (second.generation, second.fingerprint) == (2, "fp") and second.token != first.token
    fenced = ledger.complete(first, 201, {}, b"late")
    assert not fenced.stored and fenced.event is not None
    assert (fenced.event.superseded_generation, fenced.event.current_generation) == (1, 2)
    assert [e.id for e in ledger.operator.fenced()] == [fenced.event.id]


def test_readonly_init_on_an_empty_schema_is_read_only_error_and_creates_nothing(
    ledger_target: str, pg: psycopg.Connection
) -> None:
    reader = Ledger.open(ledger_target, readonly=True)
    try:
        with pytest.raises(ReadOnlyDatabaseError):
            reader.init()
    finally:
        reader.close()
    assert pg_tables(pg) == set()


def test_recipe_only_database_is_readable_then_upgraded_from_0_without_touching_rows(
    make_ledger, pg: psycopg.Connection, clock
) -> None:
    rows = recipe_only(pg)
    clock.now = NOW
    reader = make_ledger(init=False)
    assert reader.schema_version() == 0
    assert reader.operator.get("acct_1", "running").state is State.PENDING_FRESH
    assert reader.operator.get("acct_1", "stale").state is State.PENDING_STALE
    assert [v.row.key for v in reader.operator.pending()] == ["stale", "running"]
    assert list(reader.operator.fenced()) == []
    stats = reader.operator.stats()
    assert (stats.total, stats.completed, stats.expired, stats.fenced_out_events, stats.schema_version) == (
        4,
        1,
        1,
        0,
        0,
    )
    # Requests need the fencing token of schema version 2: refused, nothing written.
    with pytest.raises(SchemaOutdatedError):
        reader.handle("acct_1", "done", "POST", "/orders", {}, b"{}", lambda b: pytest.fail("ran"))
    assert dump(pg) == sorted(rows)

    result = reader.init()
    assert (result.action, result.from_version, result.to_version) == (InitAction.UPGRADED, 0, 3)
    assert result.describe() == "upgraded from 0 to 3"
    replay = reader.handle("acct_1", "done", "POST", "/orders", {}, b"{}", lambda b: pytest.fail("ran"))
    assert (replay.outcome, replay.status, replay.body) == (Outcome.REPLAYED, 201, b'{"id":1}')
    assert replay.header("content-type") == "application/json"
    assert dump(pg) == sorted(rows)
    assert pg.execute("SELECT version, applied_at FROM idemctl_schema_version").fetchall() == [(3, NOW)]
    assert reader.init().action is InitAction.UP_TO_DATE
    assert reader.operator.sweep().keys_deleted == 1 and reader.lookup("acct_2", "old") is None


def test_newer_schema_version_is_refused_by_requests_and_by_init(
    make_ledger, pg: psycopg.Connection, ledger_target: str
) -> None:
    make_ledger()
    pg.execute("INSERT INTO idemctl_schema_version (version, applied_at) VALUES (7, 0)")
    newer = Ledger.open(ledger_target)
    try:
        with pytest.raises(SchemaTooNewError, match=r"has ledger schema version 7; this idemctl knows up to 3"):
            newer.claim("acct", "k", "fp")
        with pytest.raises(SchemaTooNewError):
            newer.init()
    finally:
        newer.close()
    assert pg.execute("SELECT count(*) FROM idempotency_keys").fetchone()[0] == 0


@pytest.mark.parametrize("start", ["empty", "recipe_only"])
def test_concurrent_inits_serialise_one_creates_or_upgrades_the_rest_find_it_done(
    ledger_target: str, pg: psycopg.Connection, start: str
) -> None:
    if start == "recipe_only":
        rows = recipe_only(pg)
    ledgers = [Ledger.open(ledger_target) for _ in range(6)]
    for ledger in ledgers:
        ledger.schema_version()  # connect first, so the inits really start together
    barrier = threading.Barrier(len(ledgers))
    results: list[object] = []
    errors: list[BaseException] = []

    def run(ledger: Ledger) -> None:
        barrier.wait()
        try:
            results.append(ledger.init().action)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(ledger,)) for ledger in ledgers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for ledger in ledgers:
        ledger.close()
    assert errors == []
    first = InitAction.CREATED if start == "empty" else InitAction.UPGRADED
    assert sorted(r.value for r in results) == sorted([first.value] + [InitAction.UP_TO_DATE.value] * 5)
    assert pg.execute("SELECT version FROM idemctl_schema_version").fetchall() == [(3,)]
    if start == "recipe_only":
        assert dump(pg) == sorted(rows)


def test_stats_report_the_tables_size_on_the_server(ledger, pg: psycopg.Connection) -> None:
    expected = pg.execute(
        "SELECT pg_total_relation_size('idempotency_keys') + pg_total_relation_size('idemctl_fenced_out')"
        " + pg_total_relation_size('idemctl_schema_version')"
    ).fetchone()[0]
    assert ledger.operator.stats().storage_bytes == expected > 0


def test_a_completed_row_written_here_has_status_completed_in_plain_sql(ledger, pg: psycopg.Connection) -> None:
    ledger.handle(
        "acct",
        "k",
        "POST",
        "/o",
        {"content-type": "text/plain"},
        b"{}",
        lambda b: (201, {"content-type": "text/plain"}, "h\u00e9"),
    )
    row = pg.execute(
        "SELECT status, generation, response_status, convert_from(response_body, 'UTF8'), response_headers"
        " FROM idempotency_keys"
    ).fetchone()
    assert row == (Status.COMPLETED.value, 1, 201, "h\u00e9", '{"content-type":"text/plain"}')


def test_a_hand_made_recipe_table_with_a_text_body_is_refused_with_the_fix(make_ledger, pg: psycopg.Connection) -> None:
    pg.execute(schema_files("postgres")[0].sql.replace("response_body     BYTEA", "response_body     TEXT"))
    pg.execute(
        "INSERT INTO idempotency_keys (principal, key, fingerprint, status, response_status, response_body, created_at, updated_at)"
        " VALUES ('acct', 'k', 'fp', 'completed', 200, 'caf\u00e9', 1, 1)"
    )
    ledger = make_ledger(init=False)
    with pytest.raises(
        StorageError,
        match=r"response_body is text, .* ALTER TABLE idempotency_keys ALTER COLUMN response_body TYPE bytea USING convert_to\(response_body, 'UTF8'\)$",
    ):
        ledger.init()
    assert pg_tables(pg) == {"idempotency_keys", "idempotency_keys_pkey", "idx_idempotency_keys_updated_at"}
    pg.execute(
        "ALTER TABLE idempotency_keys ALTER COLUMN response_body TYPE bytea USING convert_to(response_body, 'UTF8')"
    )
    assert ledger.init().describe() == "upgraded from 0 to 3"
    assert ledger.lookup("acct", "k").response_body == "caf\u00e9"


def test_a_missing_database_tells_the_library_caller_what_creates_it_and_what_does_not(postgres_server: str) -> None:
    import secrets
    from urllib.parse import urlsplit, urlunsplit

    from idemctl.errors import LedgerNotFoundError

    parts = urlsplit(postgres_server)
    url = urlunsplit((parts.scheme, parts.netloc, f"/idemctl_none_{secrets.token_hex(4)}", "", ""))
    with Ledger.open(url) as ledger:
        with pytest.raises(LedgerNotFoundError) as missing:
            ledger.handle("acct", "k", "POST", "/o", {}, b"{}", lambda b: (201, {}, b"ok"))
        with pytest.raises(LedgerNotFoundError):
            ledger.init()  # it does not create the database
    assert str(missing.value).endswith(
        "does not exist (`idemctl init` creates it, a server's database included; ledger.init() creates only the tables)"
    )
