"""A PostgreSQL failover under load, on a real primary and streaming standby
that the tests start from the installed binaries (bench/replica.py): what an
acknowledged completion survives, what runs twice, and how idemctl answers
while no host accepts writes.

The measured table in docs/postgres.md comes from `python -m bench.failover`;
`python -m pytest -m slow tests/e2e/test_postgres_failover.py -s` prints it for
the settings these tests run."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from bench.common import wsgi_environ
from bench.failover import SETTINGS, FailoverRun, measure, render
from bench.replica import ReplicaPair
from idemctl import Ledger
from idemctl.cli import app
from idemctl.errors import ConnectionFailedError, ReadOnlyDatabaseError
from idemctl.outcomes import Outcome, Status
from idemctl.wsgi import IdempotencyMiddleware
from tests.helpers import skip_or_fail

postgres = pytest.importorskip("idemctl.storage.postgres", reason="the failover tests need the postgres extra")
import psycopg  # noqa: E402  (after the skip: the postgres extra brings it)

from idemctl.storage.postgres import engine as postgres_engine  # noqa: E402

# The shared pair and the table of measurements the module prints at its end:
# its tests stay on one worker.
pytestmark = pytest.mark.xdist_group("test_postgres_failover")

MEASURED: list[FailoverRun] = []


def _require_pair() -> None:
    skip_or_fail(ReplicaPair.unavailable(), "CI runs the failover tests")


@contextlib.contextmanager
def _started_pair() -> Iterator[ReplicaPair]:
    """An asynchronous primary and standby, with an initialised ledger."""
    _require_pair()
    with ReplicaPair.start(synchronous=False) as started:
        with Ledger.open(started.url()) as ledger:
            ledger.init()
        started.wait_caught_up()
        yield started


@pytest.fixture
def pair() -> Iterator[ReplicaPair]:
    """A pair of the test's own, to kill, fence or promote."""
    with _started_pair() as started:
        yield started


@pytest.fixture(scope="module")
def running_pair() -> Iterator[ReplicaPair]:
    """A pair that the tests sharing it leave running as it is (no failover)."""
    with _started_pair() as started:
        yield started


@pytest.fixture(scope="module", autouse=True)
def _print_table() -> Iterator[None]:
    yield
    if MEASURED:
        print("\n" + render(MEASURED))


def _order(body: bytes) -> tuple[int, dict[str, str], bytes]:
    return 201, {"content-type": "application/json"}, b'{"id": 1}'


# -- what the engine does with several hosts (no servers needed) ------------------------


def conninfo_of(monkeypatch: pytest.MonkeyPatch, url: str, **engine_args: object) -> str:
    """What the engine for `url` hands libpq when it connects (no server needed: the attempt is refused)."""
    attempts: list[str] = []

    def refused(conninfo: str, **kwargs: object) -> None:
        attempts.append(conninfo)
        raise psycopg.OperationalError("connection failed: Connection refused")

    monkeypatch.setattr(psycopg, "connect", refused)
    with pytest.raises(ConnectionFailedError):
        postgres.PostgresEngine(url, **engine_args).read("SELECT 1", {})  # type: ignore[arg-type]
    return attempts[0]


def test_a_url_naming_several_hosts_connects_only_to_one_that_accepts_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "target_session_attrs=read-write" in conninfo_of(monkeypatch, "postgresql://app@db1:5432,db2:5432/payments")


def test_a_url_that_chooses_its_own_target_session_attrs_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    conninfo = conninfo_of(monkeypatch, "postgresql://app@db1,db2/payments?target_session_attrs=primary")
    assert "target_session_attrs=primary" in conninfo
    assert "read-write" not in conninfo


def test_a_read_only_ledger_and_a_single_host_url_take_any_session(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "target_session_attrs" not in conninfo_of(monkeypatch, "postgresql://app@db1,db2/p", readonly=True)
    assert "target_session_attrs" not in conninfo_of(monkeypatch, "postgresql://app@db1/p")


def test_while_no_host_accepts_connections_statements_fail_at_once_without_reconnecting_each_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    attempts: list[str] = []

    def refused(conninfo: str, **kwargs: object) -> None:
        attempts.append(conninfo)
        raise psycopg.OperationalError("connection failed: Connection refused")

    monkeypatch.setattr(psycopg, "connect", refused)
    monkeypatch.setattr(postgres_engine, "RECONNECT_PAUSE_S", 0.5)
    engine = postgres.PostgresEngine("postgresql://app@127.0.0.1:1,127.0.0.1:2/payments")
    for _ in range(3):
        with pytest.raises(
            ConnectionFailedError, match=r"^cannot reach PostgreSQL at postgresql://app@127\.0\.0\.1:1,"
        ):
            engine.read("SELECT 1", {})
    assert len(attempts) == 1
    time.sleep(0.6)  # the pause is over
    with pytest.raises(ConnectionFailedError):
        engine.read("SELECT 1", {})
    assert len(attempts) == 2


# -- a real primary and standby --------------------------------------------------------


@pytest.mark.slow
def test_a_url_naming_only_a_standby_fails_closed_with_503_and_never_runs_the_app(running_pair: ReplicaPair) -> None:
    pair = running_pair
    ran: list[bytes] = []

    def orders(environ, start_response):  # type: ignore[no-untyped-def]
        ran.append(environ["wsgi.input"].read())
        start_response("201 Created", [("content-type", "application/json")])
        return [b"{}"]

    for url in (pair.url(pair.standby_port), pair.url(pair.standby_port, query="target_session_attrs=read-write")):
        with Ledger.open(url) as standby:
            app = IdempotencyMiddleware(orders, standby, principal=lambda env: env.get("REMOTE_USER"))
            seen: dict[str, object] = {}

            def start_response(status, headers, exc_info=None, seen=seen):  # type: ignore[no-untyped-def]
                seen["status"], seen["headers"] = status, dict(headers)

            body = b"".join(app(wsgi_environ("k-standby"), start_response))
            assert seen["status"] == "503 Service Unavailable", url
            assert seen["headers"]["retry-after"] == "1"  # type: ignore[index]
            assert b"idempotency_ledger_unavailable" in body
    assert ran == []
    with Ledger.open(pair.url(pair.standby_port)) as standby, pytest.raises(ReadOnlyDatabaseError, match="read-only"):
        standby.claim("acct", "k", "fp")
    read_write = pair.url(pair.standby_port, query="target_session_attrs=read-write")
    with Ledger.open(read_write) as standby, pytest.raises(ConnectionFailedError, match=r"session is read-only"):
        standby.claim("acct", "k", "fp")
    refused = "SELECT count(*) FROM idempotency_keys WHERE key IN ('k-standby', 'k')"
    assert pair.sql(pair.primary_port, refused) == [(0,)]


@pytest.mark.slow
def test_a_read_only_ledger_reads_a_standby_as_far_as_it_has_replayed(running_pair: ReplicaPair) -> None:
    pair = running_pair
    with Ledger.open(pair.url()) as ledger:
        assert ledger.handle("acct", "k1", "POST", "/orders", {}, b"{}", _order).outcome is Outcome.EXECUTED
    pair.wait_caught_up()
    with Ledger.open(pair.url(pair.standby_port), readonly=True) as standby:
        row = standby.lookup("acct", "k1")
        assert row is not None and row.status is Status.COMPLETED and row.response_status == 201


@pytest.mark.slow
def test_a_multi_host_ledger_refuses_while_no_host_accepts_writes_then_serves_from_the_promoted_standby(
    pair: ReplicaPair,
) -> None:
    with Ledger.open(pair.url()) as ledger:
        assert ledger.handle("acct", "before", "POST", "/orders", {}, b"{}", _order).status == 201
        pair.wait_caught_up()
        pair.kill_primary()
        ran: list[str] = []

        def order(body: bytes) -> tuple[int, dict[str, str], bytes]:
            ran.append("during")
            return _order(body)

        # The primary is gone and the standby still read-only: fail closed.
        for _ in range(3):
            with pytest.raises(
                ConnectionFailedError,
                match=r"^cannot reach PostgreSQL at postgresql://postgres@127\.0\.0\.1:\d+,127\.0\.0\.1:\d+/postgres: ",
            ):
                ledger.handle("acct", "during", "POST", "/orders", {}, b"{}", order)
        assert ran == []
        pair.promote_standby()
        deadline = time.monotonic() + 15
        while True:
            try:
                answer = ledger.handle("acct", "during", "POST", "/orders", {}, b"{}", order)
                break
            except ConnectionFailedError:
                assert time.monotonic() < deadline, "the promoted standby was never reached"
                time.sleep(0.05)
        assert (answer.status, answer.outcome, ran) == (201, Outcome.EXECUTED, ["during"])
        assert ledger.handle("acct", "before", "POST", "/orders", {}, b"{}", order).outcome is Outcome.REPLAYED
    assert pair.sql(pair.standby_port, "SELECT key, status FROM idempotency_keys ORDER BY key") == [
        ("before", "completed"),
        ("during", "completed"),
    ]


@pytest.mark.slow
def test_a_ledger_leaves_an_old_primary_fenced_read_only_for_the_promoted_standby(pair: ReplicaPair) -> None:
    # Fencing the old primary (read-only instead of stopped) keeps its
    # connections open: they must be given up, not used for 503s forever.
    with Ledger.open(pair.url()) as ledger:
        assert ledger.handle("acct", "before", "POST", "/orders", {}, b"{}", _order).status == 201
        pair.wait_caught_up()
        pair.sql(pair.primary_port, "ALTER SYSTEM SET default_transaction_read_only = on", "SELECT pg_reload_conf()")
        pair.promote_standby()
        with pytest.raises(ReadOnlyDatabaseError):
            ledger.handle("acct", "after", "POST", "/orders", {}, b"{}", _order)
        deadline = time.monotonic() + 15
        while True:
            try:
                answer = ledger.handle("acct", "after", "POST", "/orders", {}, b"{}", _order)
                break
            except (ReadOnlyDatabaseError, ConnectionFailedError):
                assert time.monotonic() < deadline, "the ledger kept to the fenced old primary"
                time.sleep(0.05)
        assert answer.outcome is Outcome.EXECUTED
    assert pair.sql(pair.standby_port, "SELECT key FROM idempotency_keys ORDER BY key") == [("after",), ("before",)]
    assert pair.sql(pair.primary_port, "SELECT key FROM idempotency_keys ORDER BY key") == [("before",)]


@pytest.mark.slow
def test_doctor_warns_about_a_url_that_names_a_standby(running_pair: ReplicaPair) -> None:
    on_standby = CliRunner().invoke(app, ["--db", running_pair.url(running_pair.standby_port), "doctor"])
    assert on_standby.exit_code == 1
    assert on_standby.stdout.splitlines()[1].startswith("warning: this server is a standby (in recovery)")


def _doctor(pair: ReplicaPair) -> tuple[int, list[str]]:
    result = CliRunner().invoke(app, ["--db", pair.url(), "doctor"])
    return result.exit_code, result.stdout.splitlines()[1:]


def _measured(name: str, doctor: list[tuple[int, list[str]]]) -> FailoverRun:
    _require_pair()
    run = measure(
        SETTINGS[name],
        writers=3,
        before=100,
        after=100,
        lag_s=0.3,
        pending_ttl_ms=1000,
        budget_s=30,
        before_load=lambda pair: doctor.append(_doctor(pair)),
    )
    MEASURED.append(run)
    # The load went on through the failover: answers before, during the
    # stalled replication, and from the promoted standby after it.
    assert len(run.acknowledged) >= 100 and run.acknowledged_after_failover > 0, run.row()
    assert run.unanswered == [], run.row()
    assert max(run.runs.values()) <= 2, run.row()
    # An answer computed while the primary went away ran again exactly when
    # the promoted standby did not hold its completion: a pending row is
    # taken over once the TTL has passed, a completed one replays.
    assert set(run.in_flight_rerun) == set(run.in_flight) - set(run.in_flight_completed), run.row()
    assert set(run.in_flight_pending) <= set(run.in_flight_rerun), run.row()
    return run


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sync", "remote_apply"])
def test_with_synchronous_replication_no_acknowledged_completion_is_lost_or_run_twice_after_a_failover(
    name: str,
) -> None:
    doctor: list[tuple[int, list[str]]] = []
    run = _measured(name, doctor)
    assert run.lost == [] and run.double_runs == [], run.row()
    # What `idemctl doctor` said of these settings before the failover.
    commit = SETTINGS[name].synchronous_commit
    assert doctor == [
        (
            0,
            [
                f"ok: synchronous replication (synchronous_standby_names='*', synchronous_commit={commit}): "
                "a completion is acknowledged only once a standby holds it"
            ],
        )
    ]
    # Every acknowledged answer is replayed from the promoted standby.
    assert run.final_outcomes[Outcome.REPLAYED.value] >= len(run.acknowledged), run.row()


@pytest.mark.slow
def test_with_asynchronous_replication_each_lost_completion_runs_exactly_once_more() -> None:
    doctor: list[tuple[int, list[str]]] = []
    run = _measured("async", doctor)
    assert doctor[0][0] == 1 and doctor[0][1][0].startswith(
        "warning: replication is asynchronous (synchronous_standby_names is empty; 1 standby(s) connected)"
    ), doctor
    # What the standby had not received when the primary died is gone: each
    # such acknowledged answer ran again on the retry, once; every other
    # acknowledged answer replayed. (How many are lost depends on timing.)
    assert set(run.double_runs) == set(run.lost), run.row()
    assert run.final_outcomes[Outcome.REPLAYED.value] >= len(run.acknowledged) - len(run.lost), run.row()


@pytest.mark.slow
def test_the_asynchronous_path_fails_closed_while_no_host_accepts_writes_then_serves_from_the_promoted_standby(
    pair: ReplicaPair,
) -> None:
    import asyncio

    from idemctl.asgi import IdempotencyMiddleware as AsgiMiddleware
    from tests.adapters.test_gate import call, scope_for

    ran: list[bytes] = []

    async def orders(scope, receive, send):  # type: ignore[no-untyped-def]
        ran.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"made"})

    with Ledger.open(pair.url()) as ledger:
        app = AsgiMiddleware(orders, ledger, principal=lambda scope: scope["user"])

        async def scenario() -> tuple[str, list[int], tuple[int, bytes], tuple[int, bytes]]:
            before = await call(app, scope_for("before"))
            driver = type(ledger.async_store().engine).__name__  # type: ignore[union-attr]
            await asyncio.to_thread(pair.wait_caught_up)
            await asyncio.to_thread(pair.kill_primary)
            during = [(await call(app, scope_for("during")))[0] for _ in range(3)]
            await asyncio.to_thread(pair.promote_standby)
            deadline = time.monotonic() + 15
            while (served := await call(app, scope_for("during")))[0] == 503:
                assert time.monotonic() < deadline, "the promoted standby was never reached"
                await asyncio.sleep(0.05)
            again = await call(app, scope_for("before"))
            await app.wait_idle()
            await ledger.aclose()
            assert before == (201, b"made")
            return driver, during, served, again

        driver, during, served, again = asyncio.run(scenario())
    assert driver == "AsyncpgEngine"
    assert during == [503, 503, 503]  # fail closed: the app never ran while no host took writes
    assert served == again == (201, b"made")
    assert len(ran) == 2
    assert pair.sql(pair.standby_port, "SELECT key, status FROM idempotency_keys ORDER BY key") == [
        ("before", "completed"),
        ("during", "completed"),
    ]
