"""MariaDB/MySQL-specific decisions, each proven on the test server: the
session's isolation and what it spares a claim (gap locks), row locks and
their timeout, deadlock retries, lost and killed connections (503, nothing
lost), max_allowed_packet, utf8mb4 and binary-safe columns, the primary
key's length, the bounded sweep, init from several processes at once, the
URL and its errors. The backend-independent behaviour is proven by the
shared suite, which runs against MariaDB through `ledger_target`."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

pymysql = pytest.importorskip("pymysql")

from idemctl import Ledger, Outcome, Policy, Status, StorageError  # noqa: E402
from idemctl.errors import (  # noqa: E402
    ConnectionFailedError,
    DatabaseLockedError,
    InvalidPrincipalError,
    LedgerNotFoundError,
    ReadOnlyDatabaseError,
)
from idemctl.outcomes import InitAction  # noqa: E402
from idemctl.storage.dialect import MYSQL  # noqa: E402
from idemctl.storage.mysql import MysqlEngine  # noqa: E402
from idemctl.wsgi import IdempotencyMiddleware  # noqa: E402
from tests.helpers import handled_in_a_forked_child, mysql_connect_args, read_innodb_trx  # noqa: E402

# Only this engine's half: these checks mean nothing on the others.
pytestmark = pytest.mark.engines("mysql")

SECRET = "s3cr3t-Pa55"


def connect(url: str, **overrides: object) -> pymysql.connections.Connection:
    """A plain connection to the URL's database, with the server's own defaults."""
    return pymysql.connect(**{**mysql_connect_args(url), **overrides})


@pytest.fixture
def server_cursor(ledger_target: str) -> Iterator[pymysql.cursors.Cursor]:
    """A plain auto-commit cursor into this test's database, for looking behind the ledger."""
    conn = connect(ledger_target)
    try:
        yield conn.cursor()
    finally:
        conn.close()


def thread_id(ledger: Ledger) -> int:
    return int(ledger.store.engine.read("SELECT CONNECTION_ID()", {})[0][0])


def ok(status: int = 201, body: bytes | str = b'{"id":1}', ctype: str = "application/json"):
    return lambda _body: (status, {"content-type": ctype}, body)


def lock_waiters(cur: pymysql.cursors.Cursor) -> int:
    """Sessions of this test's database waiting for a row lock (the server is shared)."""

    def read() -> int:
        cur.execute(
            "SELECT count(*) FROM information_schema.innodb_trx t"
            " JOIN information_schema.processlist p ON p.id = t.trx_mysql_thread_id"
            " WHERE t.trx_state = 'LOCK WAIT' AND p.db = DATABASE()"
        )
        return int(cur.fetchone()[0])

    return read_innodb_trx(read)


def wait_until(predicate, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


# -- sessions: isolation, gap locks, row locks ----------------------------------------------


def test_every_connection_runs_read_committed_in_utc_with_strict_mode(ledger: Ledger) -> None:
    ((isolation, zone, mode, charset),) = ledger.store.engine.read(
        "SELECT @@tx_isolation, @@time_zone, @@sql_mode, @@character_set_connection", {}
    )
    assert (isolation, zone, charset) == ("READ-COMMITTED", "+00:00", "utf8mb4")
    assert "STRICT_ALL_TABLES" in mode.split(",")


def test_a_sweep_batch_holding_its_locks_takes_no_gap_lock_that_a_new_claim_waits_on(
    make_ledger, clock, ledger_target: str
) -> None:
    # Under REPEATABLE READ the batch's DELETE locks the gap at the end of
    # the updated_at index, where every new claim inserts: the claim would
    # wait the whole lock timeout. Under the engine's READ COMMITTED it does not.
    ledger = make_ledger(policy=Policy(retention_ms=60_000, pending_ttl_ms=1000))
    for i in range(5):
        ledger.claim("acct", f"old-{i}", "fp")
    clock.advance(120_000)
    claimer = make_ledger(busy_timeout_ms=1000, init=False)

    def batch_held_while_another_claims(tx) -> None:
        # One of the engine's own pooled connections, with its session settings.
        tx.execute("BEGIN", {})
        batch = {"after": -(2**62), "cutoff": clock() - 60_000, "limit": 100}
        assert len(tx.execute(MYSQL.params(MYSQL.sweep.statement), batch)) == 5  # one row per row deleted
        assert claimer.claim("acct", "new", "fp") is not None
        tx.execute("ROLLBACK", {})

    ledger.store.engine.migrate(batch_held_while_another_claims, write=True)
    assert ledger.operator.stats().total == 6


def test_a_row_lock_held_past_the_busy_timeout_is_database_locked_and_other_keys_go_on(
    make_ledger, ledger_target: str
) -> None:
    ledger = make_ledger(busy_timeout_ms=1000)
    reservation = ledger.claim("acct", "held", "fp")
    assert reservation is not None
    holder = connect(ledger_target)
    try:
        with holder.cursor() as cur:
            cur.execute("BEGIN")
            cur.execute("SELECT * FROM idempotency_keys WHERE principal = 'acct' AND `key` = 'held' FOR UPDATE")
            with pytest.raises(DatabaseLockedError, match=r"is locked: .*lock wait timeout \(1 s"):
                ledger.complete(reservation, 201, {}, b"done")
            # InnoDB locks rows, not the table: another key is claimed at once.
            assert ledger.claim("acct", "other", "fp") is not None
            cur.execute("ROLLBACK")
    finally:
        holder.close()
    assert ledger.complete(reservation, 201, {}, b"done").stored is True


def test_the_busy_timeout_is_the_lock_wait_in_whole_seconds_at_least_one() -> None:
    url = "mysql://app@db/ledger"
    assert [MysqlEngine(url, busy_timeout_ms=ms).lock_wait_s for ms in (0, 1, 1000, 1001, 5000)] == [1, 1, 1, 2, 5]


# -- deadlocks -----------------------------------------------------------------------------


def test_a_sweep_chosen_as_deadlock_victim_runs_again_and_deletes_its_batch(
    make_ledger, clock, ledger_target: str, server_cursor
) -> None:
    ledger = make_ledger(policy=Policy(retention_ms=60_000, pending_ttl_ms=1000))
    ledger.claim("acct", "a", "fp")
    clock.advance(1)
    ledger.claim("acct", "b", "fp")
    clock.advance(120_000)
    other = connect(ledger_target)
    outcome: list[object] = []
    try:
        with other.cursor() as cur:
            cur.execute("BEGIN")
            # Heavier than the sweep's statement, so InnoDB picks the sweep as the victim.
            for i in range(50):
                cur.execute(
                    "INSERT INTO idemctl_fenced_out (principal, `key`, superseded_generation, computed_status, fenced_at)"
                    " VALUES ('x', %s, 1, 200, 0)",
                    (f"k{i}",),
                )
            cur.execute("UPDATE idempotency_keys SET generation = generation WHERE principal = 'acct' AND `key` = 'b'")

            def sweep() -> None:
                try:
                    outcome.append(ledger.operator.sweep(batch=10))
                except BaseException as exc:
                    outcome.append(exc)

            sweeper = threading.Thread(target=sweep)
            sweeper.start()
            # The sweep deleted 'a' and waits for 'b'; taking 'a' closes the cycle.
            wait_until(lambda: lock_waiters(server_cursor) == 1)
            cur.execute("UPDATE idempotency_keys SET generation = generation WHERE principal = 'acct' AND `key` = 'a'")
            cur.execute("DELETE FROM idemctl_fenced_out")
            cur.execute("COMMIT")
            sweeper.join(30)
    finally:
        other.close()
    assert ledger.store.engine.deadlock_retries == 1
    (result,) = outcome
    assert not isinstance(result, BaseException), result
    assert result.keys_deleted == 2
    assert ledger.operator.stats().total == 0


def test_a_statement_that_keeps_losing_deadlocks_is_database_locked_after_the_tries(
    ledger: Ledger, monkeypatch
) -> None:
    from idemctl.storage import mysql

    real_execute = pymysql.cursors.Cursor.execute
    calls = []

    def deadlocking(self, query, args=None):
        if "idempotency_keys" in str(query) and query.lstrip().startswith("INSERT"):
            calls.append(query)
            raise pymysql.err.OperationalError(
                1213, "Deadlock found when trying to get lock; try restarting transaction"
            )
        return real_execute(self, query, args)

    monkeypatch.setattr(pymysql.cursors.Cursor, "execute", deadlocking)
    with pytest.raises(DatabaseLockedError, match=r"lost a deadlock 5 times in a row"):
        ledger.claim("acct", "k", "fp")
    assert len(calls) == mysql.DEADLOCK_TRIES
    monkeypatch.setattr(pymysql.cursors.Cursor, "execute", real_execute)
    assert ledger.lookup("acct", "k") is None


# -- lost and killed connections ------------------------------------------------------------


def app_that(during):
    runs = []

    def app(environ, start_response):
        runs.append(1)
        during()
        body = b'{"order":' + str(len(runs)).encode() + b"}"
        start_response("201 Created", [("content-type", "application/json")])
        return [body]

    return app, runs


def post(middleware, key: str) -> tuple[str, dict[str, str], bytes]:
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/orders",
        "QUERY_STRING": "",
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": "2",
        "wsgi.input": io.BytesIO(b"{}"),
        "HTTP_IDEMPOTENCY_KEY": key,
    }
    seen: dict[str, object] = {}

    def start_response(status, headers, exc_info=None):
        seen["status"], seen["headers"] = status, dict(headers)

    body = b"".join(middleware(environ, start_response))
    return str(seen["status"]), seen["headers"], body  # type: ignore[return-value]


def test_a_connection_killed_while_idle_fails_one_request_with_503_and_the_next_one_runs(
    make_ledger, ledger_target: str, server_cursor
) -> None:
    ledger = make_ledger()
    ledger.store.engine.pool_max_size = 1
    app, runs = app_that(lambda: None)
    middleware = IdempotencyMiddleware(app, ledger, principal=lambda environ: "acct")
    assert post(middleware, "before")[0].startswith("201")
    server_cursor.execute(f"KILL {thread_id(ledger)}")
    status, headers, _ = post(middleware, "during")
    assert status.startswith("503") and "retry-after" in {k.lower() for k in headers}
    assert runs == [1]  # fail closed: the app did not run without a reservation
    assert post(middleware, "during")[0].startswith("201")
    assert runs == [1, 1]
    # Nothing lost: the earlier answer replays byte for byte.
    replay = post(middleware, "before")
    assert replay[0].startswith("201") and replay[2] == b'{"order":1}'


def test_a_connection_killed_mid_statement_is_a_503_and_the_key_stays_free(
    make_ledger, ledger_target: str, server_cursor
) -> None:
    # The claim waits on a row lock another session holds; the DBA kills the
    # claim's connection: the request gets 503 without running the app, and
    # the key is not left reserved by a claim that never answered.
    ledger = make_ledger(busy_timeout_ms=30_000)
    app, runs = app_that(lambda: None)
    middleware = IdempotencyMiddleware(app, ledger, principal=lambda environ: "acct")
    assert post(middleware, "k")[0].startswith("201")
    engine_thread = thread_id(ledger)
    holder = connect(ledger_target)
    answers: list[tuple[str, dict[str, str], bytes]] = []
    try:
        with holder.cursor() as cur:
            cur.execute("BEGIN")
            cur.execute("DELETE FROM idempotency_keys WHERE principal = 'acct' AND `key` = 'k'")
            request = threading.Thread(target=lambda: answers.append(post(middleware, "k")))
            request.start()
            wait_until(lambda: lock_waiters(server_cursor) == 1)
            server_cursor.execute(f"KILL {engine_thread}")
            request.join(30)
            cur.execute("ROLLBACK")
    finally:
        holder.close()
    ((status, _, _),) = answers
    assert status.startswith("503") and runs == [1]
    # Nothing lost: the stored answer is still there and replays.
    replay = post(middleware, "k")
    assert replay[0].startswith("201") and replay[2] == b'{"order":1}' and runs == [1]


def test_a_connection_killed_while_the_app_runs_costs_no_answer(make_ledger, ledger_target: str, server_cursor) -> None:
    # The mutation ran and its connection died in the pool meanwhile: the
    # fenced completion is stored again on a fresh connection, so the
    # client's answer is the stored one, and a retry replays it.
    ledger = make_ledger()
    ledger.store.engine.pool_max_size = 1
    victim = [thread_id(ledger)]
    app, runs = app_that(lambda: victim and server_cursor.execute(f"KILL {victim.pop()}"))
    middleware = IdempotencyMiddleware(app, ledger, principal=lambda environ: "acct")
    status, _, body = post(middleware, "k")
    assert status.startswith("201") and body == b'{"order":1}' and runs == [1]
    row = ledger.lookup("acct", "k")
    assert row is not None and row.status is Status.COMPLETED
    replay = post(middleware, "k")
    assert replay[0].startswith("201") and replay[2] == b'{"order":1}' and runs == [1]
    assert post(middleware, "k2")[0].startswith("201")


def test_a_connection_idle_past_the_ping_interval_is_checked_first_and_a_dead_one_costs_no_request(
    ledger: Ledger, server_cursor, monkeypatch
) -> None:
    # What wait_timeout does to a quiet process's pooled connections.
    from idemctl.storage import mysql

    idle = thread_id(ledger)
    monkeypatch.setattr(mysql, "IDLE_PING_S", 0.0)
    server_cursor.execute(f"KILL {idle}")
    wait_until(
        lambda: server_cursor.execute("SELECT 1 FROM information_schema.processlist WHERE id = %s", (idle,)) == 0
    )
    assert ledger.claim("acct", "k", "fp") is not None
    assert thread_id(ledger) != idle


def test_when_the_server_drops_every_pooled_connection_only_one_statement_fails(
    ledger_target: str, server_cursor
) -> None:
    ledger = Ledger.open(ledger_target + "?pool_max_size=4")
    ledger.init()
    barrier = threading.Barrier(4)
    ids: list[int] = []

    def hold() -> None:
        # A listing holds its pooled connection until its last row is read.
        rows = ledger.store.engine.stream("SELECT CONNECTION_ID()", {})
        ids.append(next(rows)[0])
        barrier.wait()
        assert list(rows) == []

    threads = [threading.Thread(target=hold) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 4
    # All four stay open, idle in the pool.
    server_cursor.execute("SELECT count(*) FROM information_schema.processlist WHERE id IN (%s, %s, %s, %s)", ids)
    assert server_cursor.fetchone() == (4,)
    for thread in ids:
        server_cursor.execute(f"KILL {thread}")
    with pytest.raises(ConnectionFailedError, match=r"^cannot reach MySQL at mysql://root@127\.0\.0\.1:3306/"):
        ledger.claim("acct", "k0", "fp")
    assert [ledger.claim("acct", f"k{i}", "fp") is not None for i in range(1, 9)] == [True] * 8
    ledger.close()


def test_a_forked_child_opens_its_own_connection_and_the_parent_keeps_its_own(ledger: Ledger) -> None:
    parent_thread = thread_id(ledger)
    child_thread, child_status = handled_in_a_forked_child(ledger, "from-child", thread_id)
    assert child_status == 201 and child_thread != parent_thread
    assert thread_id(ledger) == parent_thread
    row = ledger.lookup("acct", "from-child")
    assert row is not None and row.status is Status.COMPLETED


# -- bodies, text and keys --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "column_type"),
    [
        (b"\xff\xfe\x00\x80 not utf-8", bytes),
        ("caf\u00e9 \\x41 \\\\ back\\slashes 'quotes' \U0001f4b8".encode(), str),
        (b"nul \x00 inside valid utf-8", str),
        (b"", str),
        (bytes(range(256)) * 4096, bytes),  # 1 MiB: more than a BLOB's 64 KiB
    ],
    ids=["non-utf8", "escapes-and-4-byte-utf8", "nul", "empty", "1MiB"],
)
def test_bodies_are_stored_in_a_longblob_exactly_and_replayed_byte_for_byte(
    make_ledger, body: bytes, column_type: type, server_cursor
) -> None:
    ledger = make_ledger(policy=Policy(body_cap_bytes=2 * 1024 * 1024))
    first = ledger.handle("acct", "k", "POST", "/o", {}, b"{}", ok(body=body, ctype="application/octet-stream"))
    again = ledger.handle("acct", "k", "POST", "/o", {}, b"{}", ok(body=b"never"))
    assert (first.body, again.body, again.outcome) == (body, body, Outcome.REPLAYED)
    row = ledger.lookup("acct", "k")
    assert row is not None and type(row.response_body) is column_type
    server_cursor.execute("SELECT response_body FROM idempotency_keys")
    assert server_cursor.fetchone()[0] == body


def test_principals_with_four_byte_utf8_are_stored_and_told_apart_exactly(ledger: Ledger) -> None:
    # utf8 (utf8mb3) could not hold U+1F600 at all; a _general_ci collation would equate these two.
    one, other = "tenant-\U0001f600-caf\u00e9", "tenant-\U0001f601-cafe"
    assert ledger.handle(one, "k", "POST", "/o", {}, b"{}", ok(body=b"one")).outcome is Outcome.EXECUTED
    assert ledger.handle(other, "k", "POST", "/o", {}, b"{}", ok(body=b"other")).outcome is Outcome.EXECUTED
    replay = ledger.handle(one, "k", "POST", "/o", {}, b"{}", ok())
    assert (replay.outcome, replay.body) == (Outcome.REPLAYED, b"one")
    assert {ledger.lookup(p, "k").principal for p in (one, other)} == {one, other}  # type: ignore[union-attr]


def test_keys_differing_only_in_case_or_trailing_spaces_are_different_keys(ledger: Ledger) -> None:
    # The utf8mb4 collations are PAD SPACE, and _ci ones ignore case: both
    # would merge these keys into one row and replay one request's answer to another.
    keys = ["order-1", "ORDER-1", "order-1 ", "order-1  "]
    answers = [ledger.handle("acct", k, "POST", "/o", {}, b"{}", ok(body=k.encode())) for k in keys]
    assert [(a.outcome, a.body) for a in answers] == [(Outcome.EXECUTED, k.encode()) for k in keys]
    assert ledger.operator.stats().total == 4
    assert ledger.lookup("acct", "order-1 ").key == "order-1 "  # type: ignore[union-attr]


def test_a_principal_of_the_common_maximum_is_stored_and_a_longer_one_is_refused_before_any_statement(
    ledger: Ledger, server_cursor
) -> None:
    longest = "\u00e9" * 256  # 512 bytes of UTF-8: the maximum on every engine
    assert ledger.handle(longest, "k", "POST", "/o", {}, b"{}", ok()).status == 201
    with pytest.raises(InvalidPrincipalError, match=r"is 513 bytes in UTF-8; the most is 512"):
        ledger.handle(longest + "x", "k", "POST", "/o", {}, b"{}", ok())
    server_cursor.execute("SELECT length(principal), length(`key`) FROM idempotency_keys")
    assert server_cursor.fetchall() == ((512, 1),)


def test_the_longest_key_under_the_longest_principal_fits_the_primary_key(ledger: Ledger) -> None:
    principal, key = "p" * 512, "k" * 255
    assert ledger.handle(principal, key, "POST", "/o", {}, b"{}", ok()).status == 201
    assert ledger.handle(principal, key, "POST", "/o", {}, b"{}", ok()).outcome is Outcome.REPLAYED


def test_an_answer_bigger_than_max_allowed_packet_is_refused_by_name_and_the_ledger_works_on(
    make_ledger, server_cursor
) -> None:
    server_cursor.execute("SELECT @@max_allowed_packet")
    packet = int(server_cursor.fetchone()[0])
    ledger = make_ledger(policy=Policy(body_cap_bytes=packet * 2))
    ledger.store.engine.pool_max_size = 1
    reservation = ledger.claim("acct", "big", "fp")
    assert reservation is not None
    with pytest.raises(StorageError, match=rf"does not fit the max_allowed_packet of .* \({packet} bytes\): raise"):
        ledger.complete(reservation, 200, {}, b"a" * (packet + 1))
    row = ledger.lookup("acct", "big")
    assert row is not None and row.status is Status.PENDING
    # The same connection (the pool holds one) serves the next statement.
    assert ledger.complete(reservation, 200, {}, b"small").stored is True


# -- the sweep -------------------------------------------------------------------------------


def test_a_sweep_batch_deletes_the_oldest_rows_first_and_at_most_its_limit(make_ledger, clock) -> None:
    ledger = make_ledger(policy=Policy(retention_ms=60_000, pending_ttl_ms=1000))
    for i in range(7):
        ledger.claim("acct", f"k{i}", "fp")
        clock.advance(10)
    clock.advance(120_000)
    assert ledger.operator.sweep(batch=3).keys_deleted == 3
    assert sorted(v.row.key for v in ledger.operator.pending()) == ["k3", "k4", "k5", "k6"]
    drained = ledger.operator.drain(batch=3)
    assert (drained.keys_deleted, drained.batches) == (4, 3)


def test_a_sweep_waiting_on_a_row_lock_does_not_delete_a_row_a_takeover_just_refreshed(
    make_ledger, clock, ledger_target: str, server_cursor
) -> None:
    ledger = make_ledger(policy=Policy(retention_ms=60_000, pending_ttl_ms=1000))
    ledger.claim("acct", "k", "fp")
    clock.advance(120_000)
    holder = connect(ledger_target)
    results: list[object] = []
    try:
        with holder.cursor() as cur:
            cur.execute("BEGIN")
            now = clock()
            cur.execute(
                "UPDATE idempotency_keys SET generation = generation + 1, updated_at = %s WHERE principal = 'acct' AND `key` = 'k'",
                (now,),
            )
            sweeper = threading.Thread(target=lambda: results.append(ledger.operator.sweep(batch=10)))
            sweeper.start()
            wait_until(lambda: lock_waiters(server_cursor) == 1)
            cur.execute("COMMIT")
            sweeper.join(30)
    finally:
        holder.close()
    assert [r.keys_deleted for r in results] == [0]  # type: ignore[attr-defined]
    row = ledger.lookup("acct", "k")
    assert row is not None and row.generation == 2


# -- schema ----------------------------------------------------------------------------------


def test_the_ledger_table_has_the_recipes_columns_in_order_the_token_and_its_indexes(
    ledger: Ledger, server_cursor
) -> None:
    server_cursor.execute(
        "SELECT column_name, column_type FROM information_schema.columns"
        " WHERE table_schema = DATABASE() AND table_name = 'idempotency_keys' ORDER BY ordinal_position"
    )
    assert server_cursor.fetchall() == (
        ("principal", "varbinary(1024)"),
        ("key", "varbinary(255)"),
        ("fingerprint", "varchar(255)"),
        ("status", "varchar(16)"),
        ("generation", "int(11)"),
        ("response_status", "int(11)"),
        ("response_body", "longblob"),
        ("response_headers", "mediumtext"),
        ("created_at", "bigint(20)"),
        ("updated_at", "bigint(20)"),
        ("token", "bigint(20)"),
        ("key_id", "varbinary(255)"),  # schema 3: the key a stored value names, computed by the server
    )
    server_cursor.execute(
        "SELECT index_name, group_concat(column_name ORDER BY seq_in_index) FROM information_schema.statistics"
        " WHERE table_schema = DATABASE() AND table_name = 'idempotency_keys' GROUP BY index_name ORDER BY index_name"
    )
    assert sorted(server_cursor.fetchall()) == [
        ("PRIMARY", "principal,key"),
        ("idx_idempotency_keys_key_id", "principal,key_id"),
        ("idx_idempotency_keys_updated_at", "updated_at"),
    ]
    server_cursor.execute(
        "SELECT engine, table_collation FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = 'idempotency_keys'"
    )
    assert server_cursor.fetchone() == ("InnoDB", "utf8mb4_bin")


def test_init_from_several_processes_at_once_creates_the_schema_once(
    ledger_target: str, server_cursor, tmp_path
) -> None:
    script = tmp_path / "init.py"
    script.write_text(
        "import sys, time\n"
        "from idemctl import Ledger\n"
        "ledger = Ledger.open(sys.argv[1])\n"
        "ledger.schema_version()\n"  # connected: the inits start together
        "while time.time() < float(sys.argv[2]): time.sleep(0.001)\n"
        "print(ledger.init().action.value)\n"
    )
    start = time.time() + 2.0
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), ledger_target, str(start)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(5)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 5, [err for _, err in outs]
    assert sorted(out.strip() for out, _ in outs) == sorted(
        [InitAction.CREATED.value] + [InitAction.UP_TO_DATE.value] * 4
    )
    server_cursor.execute("SELECT version FROM idemctl_schema_version")
    assert server_cursor.fetchall() == ((3,),)


def test_init_again_is_up_to_date_and_a_dry_run_on_an_empty_database_writes_nothing(make_ledger, server_cursor) -> None:
    fresh = make_ledger(init=False)
    assert fresh.init(dry_run=True).action is InitAction.CREATED
    server_cursor.execute("SELECT count(*) FROM information_schema.tables WHERE table_schema = DATABASE()")
    assert server_cursor.fetchone()[0] == 0
    assert fresh.init().action is InitAction.CREATED
    assert fresh.init().action is InitAction.UP_TO_DATE


def test_a_hand_made_ledger_table_is_refused_by_init_with_what_to_do(make_ledger, server_cursor) -> None:
    server_cursor.execute(
        "CREATE TABLE idempotency_keys (principal VARCHAR(64), `key` VARCHAR(64), PRIMARY KEY (principal, `key`))"
    )
    ledger = make_ledger(init=False)
    with pytest.raises(StorageError, match=r"idempotency_keys exists but was not made by idemctl .*rename or drop"):
        ledger.init()


def test_a_request_before_init_is_schema_missing(make_ledger) -> None:
    from idemctl.errors import SchemaMissingError

    ledger = make_ledger(init=False)
    with pytest.raises(SchemaMissingError):
        ledger.claim("acct", "k", "fp")


def test_stats_report_the_tables_size_on_the_server(ledger: Ledger) -> None:
    ledger.claim("acct", "k", "fp")
    size = ledger.operator.stats().storage_bytes
    assert size is not None and size > 0


# -- URLs and errors ---------------------------------------------------------------------------


def test_mariadb_and_mysql_urls_open_the_same_engine_and_describe_without_the_password(ledger_target: str) -> None:
    mariadb = Ledger.open(ledger_target.replace("mysql://", "mariadb://"))
    assert mariadb.init().action is InitAction.CREATED
    assert mariadb.describe() == ledger_target.replace("mysql://", "mariadb://")
    with Ledger.open(ledger_target) as mysql:
        assert mysql.init().action is InitAction.UP_TO_DATE
    mariadb.close()
    shown = Ledger.open(f"mysql://app:{SECRET}@server_cursor.internal:3307/pay?pool_max_size=3").describe()
    assert shown == "mysql://app@server_cursor.internal:3307/pay"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (f"mysql://app:{SECRET}@server_cursor.internal:notaport/pay", "bad MySQL URL: Port could not be cast"),
        (f"mysql://app:{SECRET}@server_cursor.internal/", "bad MySQL URL: name one database"),
        (f"mysql://app:{SECRET}@server_cursor.internal/pay?bogus=1", "bad MySQL URL: unknown parameter 'bogus'"),
        (
            f"mysql://app:{SECRET}@server_cursor.internal/pay?pool_max_size=many",
            "bad MySQL URL: pool_max_size='many' is not a number",
        ),
        (
            f"mysql://app:{SECRET}@server_cursor.internal/pay?pool_max_size=0",
            "bad MySQL URL: pool_max_size must be >= 1, got 0",
        ),
        (
            f"mysql://app:{SECRET}@db/pay?wsrep_sync_wait=16",
            "bad MySQL URL: wsrep_sync_wait is a bitmask from 0 to 15, got 16",
        ),
        (f"mysql://app:{SECRET}@db/pay?wsrep_sync_wait=-1", "bad MySQL URL: wsrep_sync_wait must be >= 0, got -1"),
        (
            f"mysql://app:{SECRET}@db/pay?wsrep_sync_wait=reads",
            "bad MySQL URL: wsrep_sync_wait='reads' is not a number",
        ),
    ],
    ids=[
        "port",
        "no-database",
        "unknown-param",
        "pool-size",
        "pool-zero",
        "sync-wait-16",
        "sync-wait-neg",
        "sync-wait-word",
    ],
)
def test_a_bad_url_is_a_storage_error_at_open_naming_the_problem(url: str, expected: str) -> None:
    with pytest.raises(StorageError) as caught:
        Ledger.open(url)
    text = str(caught.value)
    assert text.startswith(expected) and SECRET not in text and "\n" not in text


def test_a_server_that_is_not_a_galera_node_gets_no_causal_read_setting(make_ledger) -> None:
    ledger = make_ledger()
    engine = ledger.store.engine
    assert (engine.galera, engine.sync_wait) == (False, None)
    session, server = engine.read("SELECT @@session.wsrep_sync_wait, @@global.wsrep_sync_wait", {})[0]
    assert session == server


def test_wsrep_sync_wait_in_the_url_is_set_on_every_connection_of_a_server_that_has_it(ledger_target: str) -> None:
    with Ledger.open(f"{ledger_target}?wsrep_sync_wait=1") as ledger:
        assert ledger.store.engine.read("SELECT @@session.wsrep_sync_wait", {}) == [(1,)]
        # Not a Galera node: nothing to report as in force for the ledger's reads.
        assert (ledger.store.engine.galera, ledger.store.engine.sync_wait) == (False, None)


def test_a_galera_node_outside_a_primary_component_is_connection_failed(ledger_target: str) -> None:
    engine = MysqlEngine(ledger_target)
    error = pymysql.err.OperationalError(1047, "WSREP has not yet prepared node for application use")
    translated = engine._translate(error)
    assert isinstance(translated, ConnectionFailedError)
    assert str(translated).startswith(
        f"cannot reach MySQL at {engine.describe()}: this Galera node is not in a Primary"
    )


def test_the_principal_limit_that_docs_and_schema_state_is_the_one_enforced() -> None:
    from idemctl.ledger import MAX_PRINCIPAL_BYTES
    from tests.helpers import ROOT

    docs = " ".join((ROOT / "docs" / "mysql.md").read_text().split())
    ddl = " ".join(
        line.strip("- ") for line in (ROOT / "schema" / "mysql" / "0001_idemctl_v2.sql").read_text().splitlines()
    )
    assert MAX_PRINCIPAL_BYTES == 512
    assert f"A principal is at most {MAX_PRINCIPAL_BYTES} bytes of UTF-8" in docs
    assert f"a principal at most {MAX_PRINCIPAL_BYTES} bytes of UTF-8, on every engine" in ddl
    assert "1024 bytes of UTF-8" not in docs + ddl


def test_a_wrong_password_is_a_refused_login_without_the_password(mysql_server: str) -> None:
    # The server answered: "refused the login", not "cannot reach".
    url = mysql_server.replace("mysql://root@", f"mysql://root:{SECRET}@")
    with pytest.raises(
        ConnectionFailedError, match=r"^MySQL at mysql://root@127\.0\.0\.1:3306/test refused the login: Access denied"
    ) as caught:
        Ledger.open(url).schema_version()
    assert SECRET not in str(caught.value)


def test_a_refused_connection_is_connection_failed_and_a_missing_database_is_ledger_not_found(
    mysql_server: str,
) -> None:
    with pytest.raises(ConnectionFailedError, match=r"^cannot reach MySQL at mysql://root@127\.0\.0\.1:1/x: "):
        Ledger.open("mysql://root@127.0.0.1:1/x?connect_timeout=2").schema_version()
    missing = mysql_server.rsplit("/", 1)[0] + "/no_such_ledger_db"
    with pytest.raises(LedgerNotFoundError, match=r"Unknown database 'no_such_ledger_db'"):
        Ledger.open(missing).schema_version()


def test_a_readonly_ledger_reads_but_every_write_is_read_only_error(make_ledger, ledger_target: str) -> None:
    make_ledger().claim("acct", "k", "fp")
    readonly = make_ledger(readonly=True, init=False)
    assert readonly.lookup("acct", "k") is not None
    with pytest.raises(ReadOnlyDatabaseError, match=r"is read-only"):
        readonly.claim("acct", "k2", "fp")
    with pytest.raises(ReadOnlyDatabaseError):
        readonly.operator.purge("acct", "k", force=True)


def test_without_the_driver_a_mysql_url_asks_for_the_extra() -> None:
    code = (
        "import sys; sys.modules['pymysql'] = None\n"
        "from idemctl import Ledger, StorageError\n"
        "try:\n    Ledger.open('mysql://app@server_cursor/pay')\n"
        "except StorageError as exc:\n    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (
        done.stdout.strip()
        == "MariaDB/MySQL support needs the driver: pip install 'idemctl[mysql]' (pymysql is missing)"
    )


def test_an_exhausted_pool_is_a_ledger_unavailable_error_after_the_pool_timeout(ledger_target: str) -> None:
    from idemctl import LedgerUnavailableError

    ledger = Ledger.open(ledger_target + "?pool_max_size=1&pool_timeout=0.3")
    ledger.init()
    ledger.claim("acct", "a", "fp")
    rows = ledger.operator.pending()
    next(rows)  # the streaming cursor now holds the only connection
    with pytest.raises(LedgerUnavailableError, match=r"within 0\.3 s: all 1 pooled connections are busy"):
        ledger.claim("acct", "b", "fp")
    rows.close()
    assert ledger.claim("acct", "b", "fp") is not None
    ledger.close()


def test_purge_deletes_exactly_the_row_it_read_and_refuses_a_fresh_pending_one(make_ledger, clock) -> None:
    from idemctl.outcomes import PurgeOutcome

    ledger = make_ledger(policy=Policy(pending_ttl_ms=1000))
    ledger.claim("acct", "fresh", "fp")
    assert ledger.operator.purge("acct", "fresh").outcome is PurgeOutcome.REFUSED_FRESH_PENDING
    clock.advance(5000)
    purged = ledger.operator.purge("acct", "fresh")
    assert purged.outcome is PurgeOutcome.PURGED and purged.row.key == "fresh"  # type: ignore[union-attr]
    assert ledger.operator.purge("acct", "fresh").outcome is PurgeOutcome.NOT_FOUND


def test_idemctl_db_and_the_cli_take_a_mysql_url_like_a_path(ledger_target: str, make_ledger) -> None:
    from typer.testing import CliRunner

    from idemctl.cli import app
    from idemctl.config import Settings

    make_ledger().claim("acct", "k", "fp")
    with Settings.from_env({"IDEMCTL_DB": ledger_target}).open_ledger() as ledger:
        assert isinstance(ledger.store.engine, MysqlEngine) and ledger.lookup("acct", "k") is not None
    done = CliRunner().invoke(app, ["inspect", "k", "-p", "acct", "--json"], env={"IDEMCTL_DB": ledger_target})
    assert done.exit_code == 0, done.stderr
    assert json.loads(done.stdout)["status"] == "pending"


def test_rows_written_by_other_programs_are_named_when_malformed_never_a_traceback(
    ledger: Ledger, server_cursor
) -> None:
    from idemctl.errors import MalformedRowError

    server_cursor.execute(
        "INSERT INTO idempotency_keys (principal, `key`, fingerprint, status, generation, created_at, updated_at)"
        " VALUES ('acct', 'k', 'fp', 'done', 1, 1, 1), (X'FF61', 'k', 'fp', 'pending', 1, 1, 1)"
    )
    with pytest.raises(MalformedRowError, match=r"key='k': status 'done' is neither pending nor completed$"):
        ledger.operator.get("acct", "k")
    seen: list[MalformedRowError] = []
    assert list(ledger.operator.pending(on_malformed=seen.append)) == []
    (bad,) = seen
    assert bad.principal == b"\xffa" and "principal and key must be text" in str(bad)
