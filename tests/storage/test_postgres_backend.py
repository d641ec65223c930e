"""PostgreSQL-specific checks of the request path: how bodies sit in BYTEA,
the sweep's query plan and its behaviour under a concurrent takeover, and the
per-process connection pool. The backend-independent behaviour is proven by
the shared suite, which runs against PostgreSQL through `ledger_target`."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator

import pytest

psycopg = pytest.importorskip("psycopg")

from idemctl import Ledger, LedgerUnavailableError, Outcome, Policy, Status, fingerprint  # noqa: E402
from idemctl.responses import not_stored  # noqa: E402
from idemctl.storage import Store  # noqa: E402
from idemctl.storage.dialect import POSTGRES  # noqa: E402
from idemctl.storage.postgres import PostgresEngine  # noqa: E402
from tests.helpers import handled_in_a_forked_child  # noqa: E402

# Only this engine's half: these checks mean nothing on the others.
pytestmark = pytest.mark.engines("postgres")

SQL_SWEEP = POSTGRES.params(POSTGRES.sweep.statement)


@pytest.fixture
def pg(ledger_target: str) -> Iterator[psycopg.Connection]:
    """A plain connection into this test's schema, for looking behind the ledger."""
    with psycopg.connect(ledger_target, autocommit=True) as conn:
        yield conn


def ok(status: int = 201, body: bytes | str = b'{"id":1}', ctype: str = "application/json"):
    return lambda _body: (status, {"content-type": ctype}, body)


def server_pid(ledger: Ledger) -> int:
    return int(ledger.store.engine.read("SELECT pg_backend_pid()", {})[0][0])


def wait_until_a_statement_waits_for_a_row(pg: psycopg.Connection, failure: str) -> None:
    """Until some statement waits for another transaction (its row lock, or its uncommitted insert)."""
    deadline = time.monotonic() + 10
    while not pg.execute("SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = 'transactionid'").fetchone()[
        0
    ]:
        assert time.monotonic() < deadline, failure
        time.sleep(0.01)


# -- bodies -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "column_type"),
    [
        (b"\xff\xfe\x00\x80 not utf-8", bytes),
        ("caf\u00e9 \\x41 \\\\ back\\slashes".encode(), str),  # bytea escape syntax must stay literal
        (b"nul \x00 inside valid utf-8", str),  # TEXT could not hold this at all
        (b"", str),
    ],
    ids=["non-utf8", "backslashes", "nul", "empty"],
)
def test_body_bytes_are_stored_in_bytea_exactly_and_replayed_byte_for_byte(
    ledger: Ledger, pg: psycopg.Connection, body: bytes, column_type: type
) -> None:
    first = ledger.handle("acct", "k", "POST", "/b", {}, b"x", ok(body=body, ctype="application/octet-stream"))
    again = ledger.handle("acct", "k", "POST", "/b", {}, b"x", ok(body=b"never runs"))
    assert (first.status, first.body) == (201, body)
    assert (again.outcome, again.status, again.body) == (Outcome.REPLAYED, 201, body)
    raw = pg.execute("SELECT response_body, pg_typeof(response_body)::text FROM idempotency_keys").fetchone()
    assert raw == (body, "bytea")
    row = ledger.lookup("acct", "k")
    assert row is not None and type(row.response_body) is column_type and row.body_bytes == body


def test_oversize_sentinel_is_a_500_with_a_null_bytea(ledger: Ledger, pg: psycopg.Connection) -> None:
    small = Ledger(ledger.store, policy=Policy(body_cap_bytes=4), clock=ledger.clock)
    answer = small.handle("acct", "big", "POST", "/b", {}, b"x", ok(body=b"12345"))
    assert answer.wire == not_stored()  # the ledger's JSON error; the row holds no body
    assert pg.execute("SELECT response_status, response_body FROM idempotency_keys").fetchone() == (500, None)


# -- sweep ---------------------------------------------------------------------------------


def _plan_nodes(plan: dict) -> Iterator[dict]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _plan_nodes(child)


@pytest.mark.parametrize("plan_cache_mode", ["force_custom_plan", "force_generic_plan"])
def test_sweep_walks_the_updated_at_index_and_deletes_by_tid_never_scanning_the_table(
    ledger: Ledger, pg: psycopg.Connection, plan_cache_mode: str
) -> None:
    # A backlog of 20 000 expired rows: a plan that scans them costs 1000x a batch.
    pg.execute(
        "INSERT INTO idempotency_keys (principal, key, fingerprint, status, created_at, updated_at) "
        "SELECT 'acct', 'k' || g, 'f', 'completed', g, g FROM generate_series(1, 20000) AS g"
    )
    pg.execute("ANALYZE idempotency_keys")
    # psycopg prepares a statement after 5 runs; the generic plan must be as good.
    pg.execute(f"SET plan_cache_mode = {plan_cache_mode}")
    params = {"after": 1, "cutoff": 15_000, "limit": 20}
    (plan,) = pg.execute("EXPLAIN (FORMAT JSON) " + SQL_SWEEP, params).fetchone()[0]
    nodes = list(_plan_nodes(plan["Plan"]))
    kinds = [n["Node Type"] for n in nodes]
    # The CTE's DELETE under the aggregate that counts what it returned.
    assert kinds[0] == "Aggregate"
    [delete] = [n for n in nodes if n["Node Type"] == "ModifyTable"]
    assert delete["Operation"] == "Delete"
    assert "Seq Scan" not in kinds and "Bitmap Heap Scan" not in kinds, kinds
    [tid] = [n for n in nodes if n["Node Type"] == "Tid Scan"]
    assert tid["Relation Name"] == "idempotency_keys"
    [limit] = [n for n in nodes if n["Node Type"] == "Limit"]
    [index] = limit["Plans"]
    assert (index["Node Type"], index["Index Name"]) == ("Index Scan", "idx_idempotency_keys_updated_at")
    # The walk starts at the sweep's starting point, not at the index's first entry.
    assert re.fullmatch(r"\(\(updated_at >= .+\) AND \(updated_at < .+\)\)", index["Index Cond"]), index["Index Cond"]

    result = ledger.operator.sweep(now=15_000 + ledger.policy.retention_ms, batch=20)
    assert (result.keys_deleted, result.cutoff) == (20, 15_000)
    oldest = pg.execute("SELECT min(updated_at), count(*) FROM idempotency_keys").fetchone()
    assert oldest == (21, 19_980)


def test_sweep_waiting_on_a_row_lock_does_not_delete_a_row_a_takeover_just_refreshed(
    ledger: Ledger, pg: psycopg.Connection, ledger_target: str, clock
) -> None:
    # An abandoned pending row, old enough to be both stale and past retention.
    # A sweep that picks rows by key and deletes them without re-checking the
    # cutoff on the row version it waited for fails this test.
    old = clock.now
    assert ledger.claim("acct", "k", "fp", now=old) is not None
    later = old + ledger.policy.retention_ms + 10
    with psycopg.connect(ledger_target) as holder:
        # The takeover's UPDATE, held open so the sweep has to wait for it.
        holder.execute(
            "UPDATE idempotency_keys SET generation = generation + 1, updated_at = %s WHERE key = 'k'", (later,)
        )
        result: list[object] = []
        sweeper = threading.Thread(target=lambda: result.append(ledger.operator.sweep(now=later)))
        sweeper.start()
        wait_until_a_statement_waits_for_a_row(pg, "the sweep never waited for the row lock")
        holder.commit()
        sweeper.join(10)
    assert result and result[0].keys_deleted == 0  # type: ignore[attr-defined]
    row = ledger.lookup("acct", "k")
    assert row is not None and (row.status, row.generation, row.updated_at) == (Status.PENDING, 2, later)


# -- one round trip for a replay -----------------------------------------------------------


class CountedStatements:
    """The statements the ledger's engine runs from now on, caught at its
    public read and write."""

    def __init__(self, ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sql: list[str] = []
        engine = ledger.store.engine
        for name in ("read", "write"):
            real = getattr(engine, name)

            def counted(sql: str, params: object, real=real):  # type: ignore[no-untyped-def]
                self.sql.append(" ".join(sql.split()))
                return real(sql, params)

            monkeypatch.setattr(engine, name, counted)


def test_a_replay_and_a_reused_key_cost_one_statement_each(ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
    # The claim that finds the key taken reads the row in the same statement.
    assert ledger.handle("acct", "k", "POST", "/orders", {}, b"{}", ok()).outcome is Outcome.EXECUTED
    counted = CountedStatements(ledger, monkeypatch)
    replay = ledger.handle("acct", "k", "POST", "/orders", {}, b"{}", ok(body=b"not again"))
    reused = ledger.handle("acct", "k", "POST", "/orders", {}, b'{"other":1}', ok(body=b"not again"))
    assert (replay.outcome, replay.status, replay.body) == (Outcome.REPLAYED, 201, b'{"id":1}')
    assert (reused.outcome, reused.status) == (Outcome.REUSED, 409)
    assert len(counted.sql) == 2
    assert all(sql.startswith("WITH claimed AS ( INSERT INTO idempotency_keys") for sql in counted.sql)


def test_a_row_committed_while_the_claim_waited_for_it_is_read_after_the_claim_and_replayed(
    ledger: Ledger, pg: psycopg.Connection, ledger_target: str, clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The claim's own SELECT reads the statement's snapshot, taken before the
    # other request committed: it sees no row, and the ledger looks the key up.
    fp = fingerprint("POST", "/orders", {}, b"{}")
    assert (
        ledger.handle("acct", "warm", "POST", "/orders", {}, b"{}", ok()).outcome is Outcome.EXECUTED
    )  # schema checked
    counted = CountedStatements(ledger, monkeypatch)
    with psycopg.connect(ledger_target) as other:
        other.execute(
            "INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, token, response_status,"
            " response_body, response_headers, created_at, updated_at)"
            " VALUES ('acct', 'k', %s, 'completed', 1, 7, 201, %s, %s, %s, %s)",
            (fp, b"made by the other", json.dumps({"content-type": "text/plain"}), clock.now, clock.now),
        )
        answers: list[object] = []
        retry = threading.Thread(
            target=lambda: answers.append(ledger.handle("acct", "k", "POST", "/orders", {}, b"{}", ok(body=b"ran")))
        )
        retry.start()
        wait_until_a_statement_waits_for_a_row(pg, "the claim never waited for the other request's row")
        other.commit()
        retry.join(10)
    (answer,) = answers
    assert (answer.outcome, answer.status, answer.body) == (Outcome.REPLAYED, 201, b"made by the other")  # type: ignore[attr-defined]
    assert [sql.split()[0] for sql in counted.sql] == ["WITH", "SELECT"]
    assert counted.sql[1].startswith("SELECT principal, key, fingerprint")


# -- connections --------------------------------------------------------------------------


def test_pool_settings_come_from_the_url_and_never_reach_libpq(ledger_target: str) -> None:
    backend = PostgresEngine(ledger_target + "&pool_min_size=0&pool_max_size=3&pool_timeout=0.5")
    try:
        assert (backend.pool_min_size, backend.pool_max_size, backend.pool_timeout_s) == (0, 3, 0.5)
        # libpq refuses parameters it does not know: connecting at all shows they never reached it.
        ledger = Ledger(Store(backend))
        assert ledger.init().action.value == "created"
        assert ledger.claim("acct", "k", "fp") is not None
    finally:
        backend.close()


def test_pool_timeout_defaults_to_the_busy_timeout(ledger_target: str) -> None:
    backend = PostgresEngine(ledger_target, busy_timeout_ms=1500)
    assert (backend.pool_min_size, backend.pool_max_size, backend.pool_timeout_s) == (1, 10, 1.5)


def test_more_threads_than_pooled_connections_wait_their_turn_and_all_succeed(ledger_target: str) -> None:
    ledger = Ledger.open(ledger_target + "&pool_max_size=2")
    ledger.init()
    answers: list[int] = []
    ran: list[int] = []
    barrier = threading.Barrier(12)

    def worker(i: int) -> None:
        def mutation(body: bytes) -> tuple[int, dict[str, str], bytes]:
            ran.append(i)
            return 201, {}, b"ok"

        barrier.wait()
        answers.append(ledger.handle("acct", f"k{i}", "POST", "/o", {}, b"{}", mutation).status)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == [201] * 12 and sorted(ran) == list(range(12))
    assert ledger.operator.stats().completed == 12
    ledger.close()


def exhaust_the_pool_then_claim(url: str, waited: str, bound_s: float) -> Ledger:
    """A ledger at `url` (one pooled connection) whose claim finds that
    connection held by a streaming read: LedgerUnavailableError naming
    `waited` seconds, within `bound_s`; then, with it back, the claim lands.
    Returns the ledger, still open."""
    ledger = Ledger.open(url)
    ledger.init()
    ledger.claim("acct", "a", "fp")
    rows = ledger.operator.pending()
    next(rows)  # the streaming cursor now holds the only connection
    started = time.monotonic()
    with pytest.raises(
        LedgerUnavailableError, match=rf"within {re.escape(waited)} s: .*all 1 pooled connections are busy"
    ):
        ledger.claim("acct", "b", "fp")
    assert time.monotonic() - started < bound_s
    rows.close()
    assert ledger.claim("acct", "b", "fp") is not None  # the connection came back
    return ledger


def test_an_exhausted_pool_is_a_ledger_unavailable_error_after_the_pool_timeout(ledger_target: str) -> None:
    exhaust_the_pool_then_claim(ledger_target + "&pool_max_size=1&pool_timeout=0.3", "0.3", 3).close()


def test_a_pool_timeout_above_the_commit_timeout_waits_only_the_commit_timeout_for_a_connection(
    ledger_target: str,
) -> None:
    # A request is answered within the commit timeout: waiting for a free
    # connection is part of that, whatever pool_timeout says.
    url = ledger_target + "&pool_max_size=1&pool_timeout=30&commit_timeout=0.4"
    with exhaust_the_pool_then_claim(url, "0.4", 10) as ledger:
        assert (ledger.store.engine.pool_timeout_s, ledger.store.engine.commit_timeout_s) == (30.0, 0.4)
        assert sorted(view.row.key for view in ledger.operator.pending()) == ["a", "b"]


def test_a_connection_the_server_killed_fails_one_statement_and_the_pool_replaces_it(
    ledger_target: str, pg: psycopg.Connection
) -> None:
    from idemctl.errors import ConnectionFailedError

    ledger = Ledger.open(ledger_target + "&pool_max_size=1")
    ledger.init()
    assert pg.execute("SELECT pg_terminate_backend(%s)", (server_pid(ledger),)).fetchone()[0] is True
    with pytest.raises(ConnectionFailedError, match=r"^cannot reach PostgreSQL at postgresql://postgres@127\.0\.0\.1"):
        ledger.claim("acct", "k", "fp")
    assert ledger.claim("acct", "k", "fp") is not None
    ledger.close()


def test_when_the_server_drops_every_pooled_connection_only_one_statement_fails(
    ledger_target: str, pg: psycopg.Connection
) -> None:
    # A restart or failover closes all of them; without a check of the idle
    # ones, each would fail one more request before the pool replaced it.
    from idemctl.errors import ConnectionFailedError

    app = ledger_target.rsplit("application_name=", 1)[1]
    ledger = Ledger.open(ledger_target + "&pool_min_size=4&pool_max_size=4")
    ledger.init()
    deadline = time.monotonic() + 10
    ours = "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND pid <> pg_backend_pid()"
    while len(pg.execute(ours, (app,)).fetchall()) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    pids = [r[0] for r in pg.execute(ours, (app,)).fetchall()]
    assert len(pids) == 4
    assert all(pg.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0] for pid in pids)
    with pytest.raises(ConnectionFailedError):
        ledger.claim("acct", "k0", "fp")
    assert [ledger.claim("acct", f"k{i}", "fp") is not None for i in range(1, 9)] == [True] * 8
    # Served by new backends; the killed ones leave pg_stat_activity as they exit.
    deadline = time.monotonic() + 5
    while set(pids) & {r[0] for r in pg.execute(ours, (app,)).fetchall()} and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not set(pids) & {r[0] for r in pg.execute(ours, (app,)).fetchall()}
    ledger.close()


def test_a_forked_child_opens_its_own_pool_and_the_parent_keeps_its_connection(ledger_target: str) -> None:
    ledger = Ledger.open(ledger_target + "&pool_max_size=1")
    ledger.init()
    parent_server_pid = server_pid(ledger)
    child_server_pid, child_status = handled_in_a_forked_child(ledger, "from-child", server_pid)
    assert child_status == 201 and child_server_pid != parent_server_pid
    # The parent's pooled connection survived the child's use and close.
    assert server_pid(ledger) == parent_server_pid
    row = ledger.lookup("acct", "from-child")
    assert row is not None and row.status is Status.COMPLETED
    ledger.close()


def test_a_draining_sweep_steps_over_none_of_the_dead_index_entries_its_earlier_batches_left(
    ledger: Ledger, pg: psycopg.Connection
) -> None:
    # PostgreSQL keeps a deleted row's index entry until VACUUM. A batch that
    # walked the updated_at index from its start would read every entry the
    # earlier batches deleted: the drain would slow down batch after batch.
    pg.execute("ALTER TABLE idempotency_keys SET (autovacuum_enabled = false)")
    pg.execute(
        "INSERT INTO idempotency_keys (principal, key, fingerprint, status, created_at, updated_at) "
        "SELECT 'acct', 'k' || g, 'f', 'completed', g, g FROM generate_series(1, 30000) AS g"
    )
    pg.execute("ANALYZE idempotency_keys")
    now = 40_000 + ledger.policy.retention_ms
    probes: list[object] = []
    batches_from: list[object] = []
    engine = ledger.store.engine
    read, write_turn = engine.read, engine.write_turn

    def recording_read(sql, params):  # type: ignore[no-untyped-def]
        if "min(updated_at)" in sql:
            probes.append(params["after"])
        return read(sql, params)

    def recording_write_turn(statements):  # type: ignore[no-untyped-def]
        batches_from.extend(params["after"] for sql, params in statements if "idempotency_keys" in sql)
        return write_turn(statements)

    engine.read = recording_read  # type: ignore[method-assign]
    engine.write_turn = recording_write_turn  # type: ignore[method-assign]
    for _ in range(25):
        assert ledger.operator.sweep(now=now, batch=1000).keys_deleted == 1000
    # One probe found the oldest row; then each full batch started where the
    # one before it ended, with no probe in between.
    assert probes == [-(2**62)]
    assert batches_from == [1] + [1000 * i for i in range(1, 25)]

    def index_pages_read(after: int) -> int:
        pg.execute("BEGIN")
        try:
            (plan,) = pg.execute(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + SQL_SWEEP,
                {"after": after, "cutoff": 40_000, "limit": 1000},
            ).fetchone()[0]
        finally:
            pg.execute("ROLLBACK")
        [limit] = [n for n in _plan_nodes(plan["Plan"]) if n["Node Type"] == "Limit"]
        return int(limit["Shared Hit Blocks"]) + int(limit["Shared Read Blocks"])

    from_where_it_ended, from_the_start = index_pages_read(25_000), index_pages_read(-(2**62))
    # Both read the same heap pages for the next 1000 rows; the walk from the
    # start also reads the leaf pages of 25 000 dead entries (some 60 of them).
    assert from_the_start - from_where_it_ended >= 50, (from_where_it_ended, from_the_start)

    last = ledger.operator.sweep(now=now, batch=10_000)
    assert (last.keys_deleted, batches_from[-1]) == (5000, 25_000)
    # Not a full batch: the next sweep probes, from where the drain ended,
    # then once more from the start before it says there is nothing due.
    assert ledger.operator.sweep(now=now, batch=10_000).keys_deleted == 0
    assert probes == [-(2**62), 30_000, -(2**62)]
