"""PostgreSQL's asynchronous request path on asyncpg (the driver chosen when
it is installed): the same typed errors as on psycopg (a server that is not
there, a lock held past the busy timeout, a statement past the commit
timeout), the URL's settings on every connection, the poolers, the
database clock and binary bodies byte for byte; `async_driver=psycopg`
keeps psycopg."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

psycopg = pytest.importorskip("psycopg")
pytest.importorskip("asyncpg")

from idemctl import Ledger, decision  # noqa: E402
from idemctl.asgi import IdempotencyMiddleware  # noqa: E402
from idemctl.errors import (  # noqa: E402
    CommitTimeoutError,
    ConnectionFailedError,
    DatabaseLockedError,
    LedgerUnavailableError,
    StorageError,
)
from idemctl.storage.postgres import (  # noqa: E402
    AsyncPostgresEngine,
    PostgresEngine,
    asyncpg_engine,
)
from idemctl.storage.postgres.asyncpg_engine import AsyncpgEngine, positional  # noqa: E402
from tests.adapters.test_gate import call, scope_for  # noqa: E402
from tests.helpers import drained  # noqa: E402

pytestmark = pytest.mark.engines("postgres")
T = TypeVar("T")

# Bytes that are not UTF-8, every byte value once, and a NUL.
BINARY = bytes(range(256)) + b"\xff\xfe\x00"


def binary_app(body: bytes) -> Any:
    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        await receive()
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"image/png")]})
        await send({"type": "http.response.body", "body": body})

    return app


def on_the_loop(url: str, body: Callable[[Any], Awaitable[T]]) -> T:
    """`body(aio)` on a new asynchronous engine of a PostgresEngine for
    `url`; both closed after."""
    engine = PostgresEngine(url)

    async def scenario() -> T:
        aio = engine.open_async()
        try:
            return await body(aio)
        finally:
            await aio.aclose()

    try:
        return asyncio.run(scenario())
    finally:
        engine.close()


def on_loop(url: str, sql: str, params: dict[str, Any] | None = None) -> tuple[str, Any]:
    """The engine's class and `sql`'s rows, on the loop."""

    async def body(aio: Any) -> tuple[str, Any]:
        return type(aio).__name__, await aio.execute(sql, params or {})

    return on_the_loop(url, body)


def test_statements_are_renumbered_once_from_the_dialects_text() -> None:
    text, names = positional("UPDATE t SET a = %(a)s WHERE b = %(b)s AND c = %(a)s")
    assert (text, names) == ("UPDATE t SET a = $1 WHERE b = $2 AND c = $1", ("a", "b"))


def test_asyncpg_serves_when_installed_and_the_url_can_keep_psycopg(ledger_target: str) -> None:
    assert on_loop(ledger_target, "SELECT %(n)s::int + 1", {"n": 41}) == ("AsyncpgEngine", [(42,)])
    kept = ledger_target + "&async_driver=psycopg"
    assert on_loop(kept, "SELECT %(n)s::int + 1", {"n": 41}) == ("AsyncPostgresEngine", [(42,)])


def test_the_urls_settings_and_idemctls_lock_timeout_hold_on_every_asyncpg_connection(ledger_target: str) -> None:
    schema = ledger_target.split("search_path%3D", 1)[1].split("&", 1)[0]
    rows = on_loop(ledger_target, "SELECT current_setting('lock_timeout'), current_schemas(false)")
    assert rows == ("AsyncpgEngine", [("5s", [schema])])


def test_an_unreachable_server_is_connection_failed_within_the_connect_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(ConnectionFailedError) as failed:
        on_loop("postgresql://postgres@127.0.0.1:1/test?connect_timeout=2", "SELECT 1")
    assert time.monotonic() - started < 5
    assert str(failed.value) == "cannot reach PostgreSQL at postgresql://postgres@127.0.0.1:1/test: Connection refused"


def test_asyncpgs_own_refused_connection_is_connection_failed_in_libpqs_words(
    ledger_target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server answered the detection, then asyncpg's own connection is
    # refused (the server went away in between).
    real = asyncpg_engine.connect_arguments

    def gone(settings: Any, mode: str) -> Any:
        return {**real(settings, mode), "port": 1, "password": "s3cret"}

    monkeypatch.setattr(asyncpg_engine, "connect_arguments", gone)
    with pytest.raises(ConnectionFailedError) as failed:
        on_loop(ledger_target, "SELECT 1")
    assert str(failed.value) == (f"cannot reach PostgreSQL at {ledger_target.split('?')[0]}: Connection refused")


def test_an_idle_connection_the_server_ended_is_dropped_and_the_next_statement_runs_on_a_new_one(
    ledger_target: str, postgres_server: str
) -> None:
    app = ledger_target.rsplit("application_name=", 1)[1]

    async def body(aio: Any) -> list[object]:
        pid = (await aio.execute("SELECT pg_backend_pid()", {}))[0][0]
        with psycopg.connect(postgres_server, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s", (app,))
        await asyncio.sleep(0.2)
        return [type(aio).__name__, (await aio.execute("SELECT pg_backend_pid() <> %(was)s", {"was": pid}))[0][0]]

    assert on_the_loop(ledger_target, body) == ["AsyncpgEngine", True]


def test_a_statement_on_a_connection_the_server_is_ending_is_a_lost_connection_never_a_database_error(
    ledger_target: str, postgres_server: str
) -> None:
    # The server's farewell is read a loop turn before the close: a statement
    # taken in between is refused by asyncpg ("another operation is in
    # progress"). That is the connection failing, so a completion is tried
    # again on a fresh one (ConnectionFailedError), never an error of the database.
    app = ledger_target.rsplit("application_name=", 1)[1]

    async def body(aio: Any) -> list[str]:
        seen = []
        for turns in range(4):
            await aio.execute("SELECT 1", {})
            with psycopg.connect(postgres_server, autocommit=True) as admin:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s", (app,)
                )
            for _ in range(turns):
                await asyncio.sleep(0)
            try:
                await aio.execute("SELECT 1", {})
                seen.append("ran")
            except StorageError as exc:
                seen.append(type(exc).__name__)
        return seen

    seen = on_the_loop(ledger_target, body)
    assert set(seen) <= {"ran", "ConnectionFailedError"}, seen
    assert "ConnectionFailedError" in seen


def test_a_row_locked_past_the_busy_timeout_is_database_locked_on_asyncpg(make_ledger, ledger_target: str) -> None:
    ledger = make_ledger(busy_timeout_ms=200)
    with psycopg.connect(ledger_target.split("&application_name=")[0]) as holder:
        # An uncommitted claim of the same key: the asynchronous claim waits for its row lock.
        holder.execute(
            "INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, token, created_at,"
            " updated_at) VALUES ('acct_A', 'k1', 'f', 'pending', 1, 1, 0, 0)"
        )

        async def claim() -> type[BaseException]:
            steps = ledger.begin_steps("acct_A", "k1", "POST", "/orders", [], b"{}")
            try:
                await decision.run_async(steps, asyncio.to_thread, store=ledger.async_store())
            except DatabaseLockedError as exc:
                return type(exc)
            finally:
                await ledger.aclose()
            return type(None)

        started = time.monotonic()
        assert asyncio.run(claim()) is DatabaseLockedError
        assert time.monotonic() - started < 3
        holder.rollback()


def test_a_statement_past_the_commit_timeout_is_cancelled_on_the_server_and_its_connection_closed(
    ledger_target: str, postgres_server: str
) -> None:
    app = ledger_target.rsplit("application_name=", 1)[1]

    async def body(aio: Any) -> tuple[float, int, int]:
        assert isinstance(aio, AsyncpgEngine)
        first = (await aio.execute("SELECT pg_backend_pid()", {}))[0][0]
        started = time.monotonic()
        with pytest.raises(CommitTimeoutError):
            await aio.execute("SELECT pg_sleep(30)", {})
        took = time.monotonic() - started
        return took, first, (await aio.execute("SELECT pg_backend_pid()", {}))[0][0]

    took, first, then = on_the_loop(ledger_target + "&commit_timeout=0.3&pool_max_size=1", body)
    assert 0.28 <= took < 3.3
    assert then != first  # the cancelled statement's connection is not used again
    with psycopg.connect(postgres_server, autocommit=True) as admin:
        sleeping = admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND query LIKE '%%pg_sleep(30)%%'"
            " AND state = 'active'",
            (app,),
        ).fetchone()
    assert sleeping == (0,)


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_pooler_named_in_the_url_is_served_with_the_settings_in_place(ledger_target: str, mode: str) -> None:
    # Straight to the server, which passes both proofs: session pooling runs
    # on asyncpg with the settings made once per connection; transaction
    # pooling, where every statement must carry them in one simple query
    # (asyncpg cannot send one with parameters), on psycopg.
    schema = ledger_target.split("search_path%3D", 1)[1].split("&", 1)[0]

    async def body(aio: Any) -> tuple[object, ...]:
        rows = await aio.execute("SELECT current_setting('lock_timeout'), current_schemas(false)", {})
        return rows, aio.pooler, type(getattr(aio, "_psycopg", None)).__name__

    rows, pooler, delegate = on_the_loop(ledger_target + f"&pooler={mode}", body)
    assert rows == [("5s", [schema])] and pooler == mode
    assert delegate == ("AsyncPostgresEngine" if mode == "transaction" else "NoneType")


def test_the_database_clock_is_read_on_asyncpg(make_ledger, postgres_server: str) -> None:
    ledger = make_ledger(clock_fn="database")

    async def scenario() -> tuple[int, bytes]:
        app = IdempotencyMiddleware(binary_app(b"ok"), ledger, principal=lambda scope: scope["user"])
        reply = await call(app, scope_for("k1"))
        await app.wait_idle()
        assert type(ledger.async_store().engine) is AsyncpgEngine  # type: ignore[union-attr]
        await ledger.aclose()
        return reply

    before = int(time.time() * 1000)
    assert asyncio.run(scenario()) == (201, b"ok")
    row = ledger.lookup("acct_A", "k1")
    assert row is not None and before - 5000 <= row.created_at <= int(time.time() * 1000) + 5000


@pytest.mark.parametrize("driver", ["auto", "psycopg"])
def test_a_binary_answer_is_stored_and_replayed_byte_for_byte(ledger_target: str, driver: str) -> None:
    ledger = Ledger.open(ledger_target + f"&async_driver={driver}")
    ledger.init()
    app = IdempotencyMiddleware(binary_app(BINARY), ledger, principal=lambda scope: scope["user"])

    async def scenario() -> tuple[str, tuple[int, bytes], tuple[int, bytes]]:
        first = await call(app, scope_for("k1"))
        await app.wait_idle()
        again = await call(app, scope_for("k1"))
        engine = type(ledger.async_store().engine).__name__  # type: ignore[union-attr]
        await ledger.aclose()
        return engine, first, again

    try:
        engine, first, again = asyncio.run(scenario())
        row = ledger.lookup("acct_A", "k1")
    finally:
        ledger.close()
    assert engine == ("AsyncpgEngine" if driver == "auto" else "AsyncPostgresEngine")
    assert first == again == (201, BINARY)
    assert row is not None and row.response_body == BINARY


def test_the_psycopg_engine_is_still_what_open_async_gives_for_psycopg() -> None:
    engine = PostgresEngine("postgresql://app@db/payments?async_driver=psycopg")
    assert isinstance(engine.open_async(), AsyncPostgresEngine)
    engine.close()


def test_callers_beyond_the_pool_size_wait_their_turn_and_past_the_pool_timeout_get_ledger_unavailable(
    ledger_target: str,
) -> None:
    async def body(aio: Any) -> tuple[set[int], float]:
        sleepers = [aio.execute("SELECT pg_backend_pid() FROM pg_sleep(0.05)", {}) for _ in range(6)]
        pids = {rows[0][0] for rows in await asyncio.gather(*sleepers)}
        held = [asyncio.ensure_future(aio.execute("SELECT pg_sleep(1.5)", {})) for _ in range(2)]
        await asyncio.sleep(0.1)
        started = time.monotonic()
        with pytest.raises(LedgerUnavailableError):
            await aio.execute("SELECT 1", {})
        waited = time.monotonic() - started
        await asyncio.gather(*held)
        return pids, waited

    pids, waited = on_the_loop(ledger_target + "&pool_max_size=2&pool_timeout=0.5&commit_timeout=5", body)
    assert len(pids) <= 2
    assert 0.45 <= waited < 1.4


def _settings(url: str) -> Any:
    from idemctl.storage.postgres.url import ServerSettings

    return ServerSettings.parse(
        url, readonly=False, busy_timeout_ms=5000, pool_min_size=None, pool_max_size=None, pool_timeout_s=None
    )


def test_a_multi_host_url_becomes_asyncpgs_host_and_port_lists_with_the_settings_as_startup_parameters() -> None:
    url = "postgresql://app:pw@10.0.0.1:5001,10.0.0.2:5002/pay?target_session_attrs=read-write&commit_timeout=2"
    assert asyncpg_engine.connect_arguments(_settings(url), "none") == {
        "host": ["10.0.0.1", "10.0.0.2"],
        "port": [5001, 5002],
        "user": "app",
        "password": "pw",
        "database": "pay",
        "timeout": 5.0,
        "target_session_attrs": "read-write",
        "server_settings": {"lock_timeout": "5000", "idemctl.startup_options": "on"},
    }
    # Behind session pooling the settings are made per connection, not sent at startup.
    assert asyncpg_engine.connect_arguments(_settings(url), "session")["server_settings"] == {}  # type: ignore[index]


@pytest.mark.parametrize(
    "url",
    ["postgresql://app@db/pay?sslrootcert=/etc/ca.pem", "postgresql://app@db/pay?options=-B%2016"],
    ids=["a-libpq-only-parameter", "options-other-than-settings"],
)
def test_a_url_only_libpq_understands_is_served_by_psycopg(url: str) -> None:
    assert asyncpg_engine.connect_arguments(_settings(url), "none") is None


def test_a_readonly_ledger_on_asyncpg_reads_and_every_write_is_read_only_error(ledger_target: str) -> None:
    from idemctl.errors import ReadOnlyDatabaseError

    with Ledger.open(ledger_target) as writer:
        writer.init()
    engine = PostgresEngine(ledger_target, readonly=True)

    async def scenario() -> tuple[str, Any, type[BaseException] | None]:
        aio = engine.open_async()
        try:
            read = await aio.execute("SELECT count(*) FROM idempotency_keys", {})
            try:
                await aio.execute("DELETE FROM idempotency_keys", {})
            except ReadOnlyDatabaseError as exc:
                return type(aio).__name__, read, type(exc)
            return type(aio).__name__, read, None
        finally:
            await aio.aclose()

    try:
        assert asyncio.run(scenario()) == ("AsyncpgEngine", [(0,)], ReadOnlyDatabaseError)
    finally:
        engine.close()


def test_a_loop_that_ended_without_aclose_leaves_no_server_connection_once_the_ledger_closes(
    ledger_target: str, postgres_server: str
) -> None:
    import gc

    app_name = ledger_target.rsplit("application_name=", 1)[1]
    ledger = Ledger.open(ledger_target)
    ledger.init()
    app = IdempotencyMiddleware(binary_app(b"ok"), ledger, principal=lambda scope: scope["user"])

    async def request() -> tuple[int, bytes]:
        reply = await call(app, scope_for("k1"))
        await app.wait_idle()
        return reply

    def connections() -> int:
        with psycopg.connect(postgres_server, autocommit=True) as admin:
            row = admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (app_name,)
            ).fetchone()
        return int(row[0])

    # Nothing the collector would close on its own: the ledger closes them.
    gc.disable()
    try:
        assert asyncio.run(request()) == (201, b"ok")  # the loop is gone, its connections open
        assert connections() >= 1
        ledger.close()
        assert drained(connections, 3) == 0
    finally:
        gc.enable()


def test_a_value_asyncpg_cannot_send_is_a_storage_error_not_an_unreachable_server(ledger_target: str) -> None:
    with pytest.raises(StorageError) as failed:
        on_loop(ledger_target, "SELECT %(n)s::int", {"n": 2**40})
    assert not isinstance(failed.value, ConnectionFailedError)
    assert "out of int32 range" in str(failed.value)
