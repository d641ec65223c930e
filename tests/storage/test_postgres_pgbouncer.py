"""PostgreSQL behind PgBouncer in its default configuration (which refuses
startup options) and with the usual workaround (which drops them): idemctl
finds the pooler and keeps every setting it depends on (lock timeout,
read-only, the URL's search_path) inside each transaction, never relies on
a server-side prepared statement the pool cannot keep, and reports the
pooler's refusals as what they are."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

psycopg = pytest.importorskip("psycopg")

from typer.testing import CliRunner  # noqa: E402

from idemctl import Ledger, StorageError  # noqa: E402
from idemctl.cli import app  # noqa: E402
from idemctl.errors import ConnectionFailedError, DatabaseLockedError, ReadOnlyDatabaseError  # noqa: E402
from idemctl.storage.postgres import PoolerError, PostgresEngine  # noqa: E402
from idemctl.storage.postgres.errors import Translator  # noqa: E402
from tests.helpers import ROOT, clean_env, postgres_test_schema  # noqa: E402
from tests.pgbouncer import PgBouncer  # noqa: E402

pytestmark = pytest.mark.slow

HEADERS = {"Content-Type": "application/json"}
# PgBouncer's default configuration, and its usual workaround for clients
# that send startup options.
BOUNCERS = [
    pytest.param(False, id="default-config"),
    pytest.param(True, id="ignore-startup-options"),
]


@contextmanager
def schema_through(
    bouncer: PgBouncer, postgres_server: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, str]]:
    """A private schema for this test: (its URL through `bouncer`, its name)."""
    with contextmanager(postgres_test_schema)(postgres_server, monkeypatch, via=bouncer.url()) as url:
        yield url, url.split("search_path%3D", 1)[1].split("&", 1)[0]


@pytest.fixture(params=BOUNCERS)
def transaction_pooled(
    request: pytest.FixtureRequest, pgbouncers: Callable[..., PgBouncer], postgres_server: str, monkeypatch
) -> Iterator[tuple[str, str]]:
    """A private schema through PgBouncer's transaction pooling: (URL, schema)."""
    with schema_through(pgbouncers("transaction", ignore_options=request.param), postgres_server, monkeypatch) as got:
        yield got


def count_rows(postgres_server: str, schema: str) -> int:
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        query = psycopg.sql.SQL("SELECT count(*) FROM {}.idempotency_keys").format(psycopg.sql.Identifier(schema))
        return int(conn.execute(query).fetchone()[0])


def table_schemas(postgres_server: str, name: str) -> set[str]:
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        rows = conn.execute("SELECT table_schema FROM information_schema.tables WHERE table_name = %s", (name,))
        return {str(r[0]) for r in rows.fetchall()}


def test_the_cli_inits_a_ledger_through_transaction_pooling_in_the_urls_schema(
    transaction_pooled: tuple[str, str], postgres_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    url, schema = transaction_pooled
    clean_env(monkeypatch, tmp_path)
    public_before = "public" in table_schemas(postgres_server, "idempotency_keys")
    done = CliRunner().invoke(app, ["--db", url, "init"])
    assert done.exit_code == 0, done.output
    # The URL's options=-csearch_path=… holds through the pooler: the tables
    # are in that schema, and nothing new appeared in public.
    schemas = table_schemas(postgres_server, "idempotency_keys")
    assert schema in schemas
    assert ("public" in schemas) == public_before
    assert schema in table_schemas(postgres_server, "idemctl_schema_version")
    with Ledger.open(url) as ledger:
        assert ledger.lookup("acct_A", "k1") is None
        assert ledger.store.engine.pooler == "transaction"


def _runs_and_errors(
    ledger: Ledger, keys: list[str], threads: int, runs: collections.Counter[str], lock: threading.Lock
) -> collections.Counter[str]:
    """Each of `threads` threads sends every key of `keys` (a replay for all
    but the first to finish), starting together; the mutation counts its
    runs per key. What the requests answered (or raised), counted."""
    seen: collections.Counter[str] = collections.Counter()
    start = threading.Barrier(threads)

    def worker(seed: int) -> None:
        order = keys[seed % len(keys) :] + keys[: seed % len(keys)]
        start.wait(30)
        for key in order:

            def mutate(body: bytes, key: str = key) -> tuple[int, dict[str, str], bytes]:
                with lock:
                    runs[key] += 1
                return 201, HEADERS, b'{"created":"' + key.encode() + b'"}'

            try:
                answer = ledger.handle("acct_A", key, "POST", "/orders", HEADERS, b'{"sku":"x"}', mutate)
            except Exception as exc:
                with lock:
                    seen[f"error:{type(exc).__name__}:{exc}"] += 1
                continue
            with lock:
                seen[f"{answer.outcome.value}:{answer.status}"] += 1
                if answer.status == 201 and answer.body != b'{"created":"' + key.encode() + b'"}':
                    seen["wrong-body"] += 1

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(120)
    return seen


def test_threads_and_races_through_transaction_pooling_run_each_key_exactly_once(
    transaction_pooled: tuple[str, str],
) -> None:
    url, _ = transaction_pooled
    runs: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    # prepare_threshold=0 would prepare every statement at once: through
    # transaction pooling idemctl must not, whatever the URL asks.
    with Ledger.open(url + "&prepare_threshold=0") as ledger:
        ledger.init()
        keys = [f"order-{i:03d}" for i in range(100)]
        seen = _runs_and_errors(ledger, keys, 4, runs, lock)
        assert not [k for k in seen if k.startswith("error") or k == "wrong-body"], seen
        assert sum(seen.values()) == 400
        assert runs == collections.Counter({key: 1 for key in keys})
        # 16 threads at once on each of 10 fresh keys.
        for i in range(10):
            key = f"race-{i}"
            seen = _runs_and_errors(ledger, [key], 16, runs, lock)
            assert not [k for k in seen if k.startswith("error") or k == "wrong-body"], seen
            assert sum(seen.values()) == 16
            assert runs[key] == 1, (key, runs[key], seen)


def test_a_request_behind_a_table_lock_fails_after_the_busy_timeout_through_transaction_pooling(
    transaction_pooled: tuple[str, str], postgres_server: str
) -> None:
    url, schema = transaction_pooled
    runs: list[bytes] = []
    with Ledger.open(url, busy_timeout_ms=1000) as ledger:
        ledger.init()
        with psycopg.connect(postgres_server) as locker:
            locker.execute(
                psycopg.sql.SQL("LOCK TABLE {}.idempotency_keys IN ACCESS EXCLUSIVE MODE").format(
                    psycopg.sql.Identifier(schema)
                )
            )

            def mutate(body: bytes) -> tuple[int, dict[str, str], bytes]:
                runs.append(body)
                return 201, {}, b""

            began = time.monotonic()
            with pytest.raises(DatabaseLockedError, match="lock timeout"):
                ledger.handle("acct_A", "k1", "POST", "/orders", HEADERS, b"{}", mutate)
            waited = time.monotonic() - began
            locker.rollback()
        # The busy timeout (1 s), not forever and not PgBouncer's own limits.
        assert 0.9 <= waited < 4.0, waited
        assert runs == []


def test_a_readonly_ledger_through_transaction_pooling_writes_no_row(
    transaction_pooled: tuple[str, str], postgres_server: str
) -> None:
    url, schema = transaction_pooled
    with Ledger.open(url) as writer:
        writer.init()
        writer.handle("acct_A", "k0", "POST", "/orders", HEADERS, b"{}", lambda b: (201, {}, b"made"))
    before = count_rows(postgres_server, schema)
    with Ledger.open(url, readonly=True) as reader:
        assert reader.lookup("acct_A", "k0") is not None
        with pytest.raises(ReadOnlyDatabaseError, match="read-only transaction"):
            reader.claim("acct_A", "k1", "fp-1")
    assert count_rows(postgres_server, schema) == before == 1


def test_direct_server_keeps_startup_options_and_honours_prepare_threshold(postgres_server: str, monkeypatch) -> None:
    with contextmanager(postgres_test_schema)(postgres_server, monkeypatch) as url:
        counts = {}
        for threshold in ("0", "none"):
            engine = PostgresEngine(f"{url}&prepare_threshold={threshold}&pool_min_size=1&pool_max_size=1")
            try:
                for _ in range(3):
                    engine.read("SELECT current_setting('lock_timeout'), %(x)s::int", {"x": 1})
                counts[threshold] = engine.read("SELECT count(*) FROM pg_prepared_statements", {})[0][0]
                assert engine.pooler == "none"
                assert engine.read("SELECT current_setting('lock_timeout')", {}) == [("5s",)]
            finally:
                engine.close()
        assert counts["0"] >= 1 and counts["none"] == 0, counts


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("prepare_threshold=-1", "prepare_threshold='-1' is neither a whole number >= 0 nor 'none'"),
        ("prepare_threshold=soon", "prepare_threshold='soon' is neither a whole number >= 0 nor 'none'"),
        ("pooler=pgpool", "pooler='pgpool' is not one of auto, none, session, transaction, statement"),
    ],
)
def test_bad_pooler_parameters_are_refused_with_the_reason(query: str, message: str) -> None:
    with pytest.raises(StorageError, match=f"^bad PostgreSQL URL: {message}$"):
        PostgresEngine(f"postgresql://app@db.internal/pay?{query}")


def test_pooler_none_in_front_of_pgbouncer_is_a_pooler_error_not_an_unreachable_server(
    pgbouncers: Callable[..., PgBouncer],
) -> None:
    refusing = Ledger.open(pgbouncers("transaction").url(query="pooler=none"))
    ignoring = Ledger.open(pgbouncers("transaction", ignore_options=True).url(query="pooler=none"))
    try:
        with pytest.raises(PoolerError, match="refuses idemctl's startup options") as refused:
            refusing.init()
        assert not isinstance(refused.value, ConnectionFailedError)
        assert "cannot reach" not in str(refused.value)
        with pytest.raises(PoolerError, match="ignored idemctl's startup options"):
            ignoring.init()
    finally:
        refusing.close()
        ignoring.close()


def test_a_prepared_statement_lost_by_the_pooler_is_reported_as_such_not_as_cannot_reach() -> None:
    translate = Translator("postgresql://app@db/pay", lambda s: s, 5000, 5.0, 10)
    lost = psycopg.errors.ProtocolViolation(
        'bind message supplies 5 parameters, but prepared statement "_pg3_5" requires 2'
    )
    error = translate(lost)
    assert isinstance(error, PoolerError) and not isinstance(error, ConnectionFailedError)
    assert str(error).startswith("postgresql://app@db/pay: a prepared statement did not survive the connection pooler")
    twice = translate(psycopg.errors.DuplicatePreparedStatement('prepared statement "_pg3_0" already exists'))
    assert isinstance(twice, PoolerError)


def test_statement_pooling_serves_requests_and_an_up_to_date_init_but_refuses_an_upgrade_with_one_clear_error(
    pgbouncers: Callable[..., PgBouncer], postgres_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with schema_through(pgbouncers("session"), postgres_server, monkeypatch) as (url, schema):
        statement_url = url.replace(url.split("/")[2], pgbouncers("statement").url().split("/")[2])
        with Ledger.open(statement_url) as ledger:
            with pytest.raises(PoolerError, match="pooled in statement mode") as refused:
                ledger.init()  # creating the tables needs a transaction
            assert "cannot reach" not in str(refused.value)
        with Ledger.open(url) as ledger:
            ledger.init()  # through session pooling: transactions are allowed there
        with Ledger.open(statement_url) as ledger:
            # An app that calls init() at every start: the schema is read, nothing to write.
            assert ledger.init().describe() == "already up to date (schema version 3)"
            first = ledger.handle("acct_A", "k1", "POST", "/orders", HEADERS, b"{}", lambda b: (201, {}, b"made"))
            again = ledger.handle("acct_A", "k1", "POST", "/orders", HEADERS, b"{}", lambda b: (500, {}, b"ran twice"))
            assert (first.status, first.body) == (again.status, again.body) == (201, b"made")
        with Ledger.open(statement_url + "&pooler=statement") as ledger:
            assert ledger.init(dry_run=True).describe() == "already up to date (schema version 3)"
        assert count_rows(postgres_server, schema) == 1


def test_pooler_session_sets_the_settings_once_per_connection_and_they_hold(
    pgbouncers: Callable[..., PgBouncer], postgres_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with schema_through(pgbouncers("session"), postgres_server, monkeypatch) as (url, schema):
        with Ledger.open(url + "&pooler=session", busy_timeout_ms=1500) as ledger:
            ledger.init()
            engine = ledger.store.engine
            assert engine.pooler == "session"
            assert engine.read(
                "SELECT current_setting('lock_timeout'), current_setting('search_path'),"
                " current_setting('transaction_read_only')",
                {},
            ) == [("1500ms", schema, "off")]
        assert schema in table_schemas(postgres_server, "idempotency_keys")
        with Ledger.open(url + "&pooler=session", readonly=True) as reader, pytest.raises(ReadOnlyDatabaseError):
            reader.claim("acct_A", "k1", "fp-1")
        assert count_rows(postgres_server, schema) == 0


def test_a_direct_pools_new_connection_without_its_startup_options_is_refused_and_the_pool_replaced(
    postgres_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with contextmanager(postgres_test_schema)(postgres_server, monkeypatch) as url:
        engine = PostgresEngine(url)
        try:
            assert engine.read("SELECT 1", {}) == [(1,)] and engine.pooler == "none"
            first_pool = engine._pool
            # What a pooler that drops startup options hands the pool: a
            # session without them (and so without the marker setting).
            bare = psycopg.connect(engine._settings.pooled_conninfo, autocommit=True)
            with bare, pytest.raises(PoolerError, match="ignored idemctl's startup options"):
                engine._configure_for("none")(bare)

            # The next failure to get a connection replaces the pool, and the
            # one after finds what is there now.
            def no_connection(*args: object, **kwargs: object) -> None:
                raise psycopg.OperationalError("no connection: the pool could not make one")

            monkeypatch.setattr(engine._pool, "getconn", no_connection)
            with pytest.raises(StorageError):
                engine.read("SELECT 1", {})
            assert engine._pool is None
            assert engine.read("SELECT current_setting('lock_timeout')", {}) == [("5s",)]
            assert engine._pool is not first_pool and engine.pooler == "none"
        finally:
            engine.close()


def test_url_options_other_than_settings_are_refused_behind_a_pooler(
    pgbouncers: Callable[..., PgBouncer],
) -> None:
    engine = PostgresEngine(pgbouncers("transaction").url(query="options=-c%20lock_timeout%3D100%20-e"))
    try:
        with pytest.raises(StorageError, match="cannot pass on the URL's options='-c lock_timeout=100 -e'"):
            engine.read("SELECT 1", {})
    finally:
        engine.close()


def test_a_database_pgbouncer_does_not_know_is_a_missing_ledger_not_an_unreachable_server(
    pgbouncers: Callable[..., PgBouncer],
) -> None:
    from idemctl.errors import LedgerNotFoundError

    with (
        Ledger.open(pgbouncers("transaction").url("nosuchdb")) as ledger,
        pytest.raises(LedgerNotFoundError) as missing,
    ):
        ledger.lookup("acct_A", "k1")
    assert missing.value.reason.endswith(": the pooler has no such database: nosuchdb")
    assert not isinstance(missing.value, ConnectionFailedError)


def test_the_async_pool_whose_new_connections_lost_their_options_is_replaced_and_the_pooler_detected(
    postgres_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    from idemctl.storage.postgres import aio

    with contextmanager(postgres_test_schema)(postgres_server, monkeypatch) as url:
        app = url.rsplit("application_name=", 1)[1]
        engine = PostgresEngine(url + "&pool_timeout=1")
        on_loop = engine.open_async()

        async def scenario() -> list[object]:
            seen: list[object] = [await on_loop.execute("SELECT current_setting('lock_timeout')", {}), on_loop.pooler]
            # From now on a new session looks like one a pooler opened
            # without the startup options; the pool's only one goes away.
            monkeypatch.setattr(aio, "MARKER_QUERY", "SELECT 'off'")
            monkeypatch.setattr("idemctl.storage.postgres.pooler.MARKER_QUERY", "SELECT 'off'")
            with psycopg.connect(postgres_server, autocommit=True) as admin:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s", (app,)
                )
            for _ in range(3):  # the dead connection, then no new one within pool_timeout
                try:
                    await on_loop.execute("SELECT 1", {})
                except StorageError as exc:
                    seen.append(type(exc).__name__)
            seen.append(await on_loop.execute("SELECT current_setting('lock_timeout')", {}))
            seen.append(on_loop.pooler)
            await on_loop.aclose()
            return seen

        try:
            seen = asyncio.run(scenario())
        finally:
            engine.close()
        assert seen[:2] == [[("5s",)], "none"]
        assert seen[-2:] == [[("5s",)], "transaction"]
        assert "ConnectionFailedError" in seen[2:-2]


@pytest.mark.parametrize("mode", ["transaction", "statement"])
def test_pooler_session_in_front_of_transaction_or_statement_pooling_is_refused_before_any_request(
    pgbouncers: Callable[..., PgBouncer], postgres_server: str, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    import asyncio

    with schema_through(pgbouncers("session"), postgres_server, monkeypatch) as (url, schema):
        with Ledger.open(url) as ledger:
            ledger.init()
        wrong = url.replace(url.split("/")[2], pgbouncers(mode).url().split("/")[2]) + "&pooler=session"
        ran: list[bytes] = []
        with Ledger.open(wrong) as ledger:
            with pytest.raises(PoolerError) as refused:
                ledger.handle(
                    "acct_A", "k1", "POST", "/orders", HEADERS, b"{}", lambda b: (201, {}, ran.append(b) or b"ran")
                )
            assert "is not session pooling although the URL says pooler=session" in str(refused.value)
            assert "use pooler=transaction" in str(refused.value)
            on_loop = ledger.store.engine.open_async()

            async def on_the_loop() -> str:
                try:
                    await on_loop.execute("SELECT 1", {})
                except PoolerError as exc:
                    return str(exc)
                finally:
                    await on_loop.aclose()
                return "served"

            assert "is not session pooling" in asyncio.run(on_the_loop())
        assert ran == []
        assert count_rows(postgres_server, schema) == 0
        # Told the truth, the same pooler serves the request.
        with Ledger.open(wrong.replace("pooler=session", "pooler=transaction")) as ledger:
            done = ledger.handle("acct_A", "k1", "POST", "/orders", HEADERS, b"{}", lambda b: (201, {}, b"made"))
            assert (done.status, done.body) == (201, b"made")


def test_pgbouncer_that_cannot_reach_its_server_is_the_message_the_topologies_page_quotes(
    postgres_server: str, tmp_path
) -> None:
    import socket

    from tests.pgbouncer import start_or_skip

    with socket.socket() as closed:  # a port nothing listens on: the server is gone
        closed.bind(("127.0.0.1", 0))
        gone = f"postgresql://postgres@127.0.0.1:{closed.getsockname()[1]}/test"
    with start_or_skip("transaction", gone, check=False) as bouncer:
        url = bouncer.url(query="connect_timeout=2")
        with Ledger.open(url) as ledger, pytest.raises(ConnectionFailedError) as unreachable:
            ledger.schema_version()
    shown = url.split("?", 1)[0]
    assert str(unreachable.value) == f"cannot reach PostgreSQL at {shown}: connection timeout expired"
    page = (ROOT / "docs" / "topologies.md").read_text(encoding="utf-8")
    assert (
        "PgBouncer unable to reach the server is a `ConnectionFailedError`\n(`cannot reach PostgreSQL at …: connection timeout expired`"
        in page
    )


def test_init_through_statement_pooling_prints_its_one_line_error_and_no_driver_log(
    pgbouncers: Callable[..., PgBouncer], postgres_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    import os
    import subprocess
    import sys

    with schema_through(pgbouncers("session"), postgres_server, monkeypatch) as (url, _):
        # An empty schema: init has to create the tables, which needs a transaction.
        statement_url = url.replace(url.split("/")[2], pgbouncers("statement").url().split("/")[2])
        idemctl = os.path.join(os.path.dirname(sys.executable), "idemctl")
        done = subprocess.run(
            [idemctl, "--db", statement_url, "init"], cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
    assert (done.returncode, done.stdout) == (2, "")
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ") and "is pooled in statement mode" in lines[0]
    assert " at 0x" not in done.stderr
