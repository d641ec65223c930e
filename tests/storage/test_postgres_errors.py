"""PostgreSQL failures become idemctl's typed errors with one-line messages
that never carry the password: bad URLs, refused connections, unknown roles
and databases, lock timeouts, read-only sessions."""

from __future__ import annotations

import threading
import time

import pytest

psycopg = pytest.importorskip("psycopg")

from idemctl import Ledger, LedgerUnavailableError, StorageError  # noqa: E402
from idemctl.errors import (  # noqa: E402
    ConnectionFailedError,
    DatabaseLockedError,
    InvalidPrincipalError,
    LedgerNotFoundError,
    ReadOnlyDatabaseError,
)
from idemctl.storage import Store  # noqa: E402
from idemctl.storage.postgres import PostgresEngine  # noqa: E402
from tests.helpers import drained  # noqa: E402

# Only this engine's half: these checks mean nothing on the others.
pytestmark = pytest.mark.engines("postgres")

SECRET = "s3cr3t-Pa55"


@pytest.fixture
def server(postgres_server: str) -> str:
    """host:port of the test server, for building wrong URLs next to it."""
    params = psycopg.conninfo.conninfo_to_dict(postgres_server)
    return f"{params.get('host', '127.0.0.1')}:{params.get('port', 5432)}"


@pytest.fixture
def pg_count_connections(ledger_target: str):
    """How many server connections this test's ledgers hold right now."""
    app = ledger_target.rsplit("application_name=", 1)[1]

    def count() -> int:
        with psycopg.connect(ledger_target.replace(app, "idemctl-test-observer"), autocommit=True) as conn:
            return int(
                conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (app,)).fetchone()[0]
            )

    return count


def single_line_without_secret(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and "\t" not in text
    assert SECRET not in text
    return text


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (f"postgresql://app:{SECRET}@db.internal:notaport/pay", "port 'notaport' is not a number from 1 to 65535"),
        (
            f"postgresql://app:{SECRET}@db.internal:5432/pay?sslmode=require&bogus=1",
            'invalid URI query parameter: "bogus"',
        ),
        (f"postgresql://app:{SECRET}@db.internal/pay%zz", 'invalid percent-encoded token: "pay%zz"'),
        (f"postgresql://app:{SECRET}@db.internal/pay?pool_max_size=many", "pool_max_size='many' is not a whole number"),
        (
            f"postgresql://app:{SECRET}@db.internal/pay?pool_min_size=5&pool_max_size=2",
            "pool_max_size (2) is below pool_min_size (5)",
        ),
        (
            f"postgresql://app:{SECRET}@db.internal/pay?pool_timeout=soon",
            "pool_timeout='soon' is not a number of seconds",
        ),
    ],
    ids=["port", "unknown-param", "percent", "pool-size", "pool-order", "pool-timeout"],
)
def test_bad_url_is_a_storage_error_at_open_naming_the_problem(url: str, expected: str) -> None:
    with pytest.raises(StorageError) as caught:
        Ledger.open(url)
    assert not isinstance(caught.value, LedgerUnavailableError)  # not worth a retry
    text = single_line_without_secret(caught.value)
    assert text.startswith("bad PostgreSQL URL: ") and expected in text


def test_describe_drops_the_password_and_pool_parameters() -> None:
    backend = PostgresEngine(f"postgres://app:{SECRET}@db.internal:6432/pay?sslmode=require&pool_max_size=4")
    assert backend.describe() == "postgresql://app@db.internal:6432/pay"
    multi = PostgresEngine(f"postgresql://app:{SECRET}@h1:5432,h2:5433/pay?password={SECRET}")
    assert multi.describe() == "postgresql://app@h1:5432,h2:5433/pay"


def test_refused_connection_is_connection_failed_with_libpqs_reason(server: str) -> None:
    host = server.split(":")[0]
    ledger = Ledger.open(f"postgresql://app:{SECRET}@{host}:1/test")  # opening is lazy: no error yet
    with pytest.raises(ConnectionFailedError) as caught:
        ledger.claim("acct", "k", "fp")
    text = single_line_without_secret(caught.value)
    assert text.startswith(f"cannot reach PostgreSQL at postgresql://app@{host}:1/test: ")
    assert "Connection refused" in text
    # Still failing, still typed, on the next call: nothing half-open is cached.
    with pytest.raises(ConnectionFailedError):
        ledger.lookup("acct", "k")


def test_unknown_role_is_a_refused_login_and_names_the_role_not_the_password(server: str) -> None:
    # The server answered: "refused the login", not "cannot reach".
    ledger = Ledger.open(f"postgresql://nobody_here:{SECRET}@{server}/test")
    with pytest.raises(ConnectionFailedError) as caught:
        ledger.schema_version()
    text = single_line_without_secret(caught.value)
    assert text == (
        f'PostgreSQL at postgresql://nobody_here@{server}/test refused the login: role "nobody_here" does not exist'
    )


def test_a_role_that_may_not_log_in_is_a_refused_login_through_the_cli(server: str, tmp_path, monkeypatch) -> None:
    import secrets

    import psycopg
    from typer.testing import CliRunner

    from idemctl.cli import app
    from tests.helpers import clean_env

    role = f"idemctl_nologin_{secrets.token_hex(4)}"
    admin = f"postgresql://postgres@{server}/test"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{role}" NOLOGIN')
    try:
        clean_env(monkeypatch, tmp_path)
        url = f"postgresql://{role}@{server}/test"
        done = CliRunner().invoke(app, ["--db", url, "stats"])
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP ROLE "{role}"')
    assert (done.exit_code, done.stdout) == (2, "")
    assert done.stderr == f'error: PostgreSQL at {url} refused the login: role "{role}" is not permitted to log in\n'


def test_missing_database_is_ledger_not_found(server: str) -> None:
    ledger = Ledger.open(f"postgresql://postgres:{SECRET}@{server}/no_such_db_idemctl")
    with pytest.raises(LedgerNotFoundError) as caught:
        ledger.init()
    text = single_line_without_secret(caught.value)
    assert 'database "no_such_db_idemctl" does not exist' in text


def test_password_is_scrubbed_even_from_the_servers_own_messages(ledger_target: str) -> None:
    # A value the server echoes back in its error message happens to be the
    # password; the message shows *** instead.
    backend = Store(PostgresEngine(ledger_target.replace("postgres@", f"postgres:{SECRET}@")))
    try:
        Ledger(backend).init()
        with pytest.raises(StorageError) as caught:
            backend.claim("acct", "k", "fp", 1, SECRET)  # type: ignore[arg-type]
        text = single_line_without_secret(caught.value)
        assert 'invalid input syntax for type bigint: "***"' in text
    finally:
        backend.close()


def test_nul_in_a_principal_is_refused_before_any_statement(ledger) -> None:
    with pytest.raises(InvalidPrincipalError, match=r"holds a NUL character"):
        ledger.claim("acct\x00evil", "k", "fp")
    assert ledger.operator.stats().total == 0


def test_row_lock_held_past_the_busy_timeout_is_database_locked(make_ledger, ledger_target: str) -> None:
    ledger = make_ledger(busy_timeout_ms=200)
    reservation = ledger.claim("acct", "k", "fp")
    with psycopg.connect(ledger_target) as holder:
        holder.execute("SELECT * FROM idempotency_keys WHERE key = 'k' FOR UPDATE")
        with pytest.raises(
            DatabaseLockedError,
            match=r"is locked: another session held the row or table past the lock timeout \(200 ms unless the URL sets lock_timeout\): canceling statement due to lock timeout$",
        ):
            ledger.complete(reservation, 201, {}, b"ok")
    # Nothing was written by the timed-out statement; once free, it completes.
    assert ledger.lookup("acct", "k").status.value == "pending"
    assert ledger.complete(reservation, 201, {}, b"ok").stored


def test_lock_timeout_in_the_url_options_wins_over_the_busy_timeout(ledger_target: str) -> None:
    url = ledger_target.replace("options=", "options=-c%20lock_timeout%3D150%20")
    ledger = Ledger.open(url, busy_timeout_ms=60_000)
    ledger.init()
    reservation = ledger.claim("acct", "k", "fp")
    with psycopg.connect(ledger_target) as holder:
        holder.execute("SELECT * FROM idempotency_keys WHERE key = 'k' FOR UPDATE")
        timer = threading.Timer(
            5, holder.rollback
        )  # releases the lock: never hang the suite if the option were ignored
        timer.start()
        started = time.monotonic()
        try:
            with pytest.raises(DatabaseLockedError):
                ledger.release(reservation)
        finally:
            timer.cancel()
        assert time.monotonic() - started < 4
    ledger.close()


def test_readonly_ledger_reads_but_every_write_is_read_only_error(make_ledger, ledger_target: str, clock) -> None:
    writer = make_ledger()
    writer.handle("acct", "k", "POST", "/o", {}, b"{}", lambda b: (201, {}, b"ok"))
    reader = Ledger.open(ledger_target, readonly=True, clock=clock)
    try:
        assert reader.lookup("acct", "k").response_status == 201
        assert reader.operator.stats().completed == 1
        for write in (
            lambda: reader.claim("acct", "k2", "fp"),
            # A sweep with nothing to delete writes nothing and succeeds; one
            # with work to do needs a write.
            lambda: reader.operator.sweep(now=reader.now() + 2 * 86_400_000),
            lambda: reader.operator.purge("acct", "k", force=True),
        ):
            with pytest.raises(ReadOnlyDatabaseError, match=r"is read-only"):
                write()
        # As on SQLite: an init with nothing to do needs no write.
        assert reader.init().describe() == "already up to date (schema version 3)"
        assert writer.lookup("acct", "k") is not None and writer.lookup("acct", "k2") is None
    finally:
        reader.close()


def test_a_closed_ledger_used_again_reconnects_like_sqlite(ledger, pg_count_connections) -> None:
    ledger.claim("acct", "k", "fp")
    assert pg_count_connections() >= 1
    ledger.close()
    # The client side closes at once; the server's backend process notices
    # the closed socket and leaves pg_stat_activity a moment later.
    assert drained(pg_count_connections, 5) == 0
    assert ledger.lookup("acct", "k") is not None
    assert pg_count_connections() >= 1


def test_several_hosts_in_the_url_report_one_reason_per_host(server: str) -> None:
    host = server.split(":")[0]
    ledger = Ledger.open(f"postgresql://app:{SECRET}@{host}:1,{host}:2/test")
    with pytest.raises(ConnectionFailedError) as caught:
        ledger.operator.stats()
    assert single_line_without_secret(caught.value) == (
        f"cannot reach PostgreSQL at postgresql://app@{host}:1,{host}:2/test: "
        f"{host}:1: Connection refused; {host}:2: Connection refused"
    )


def test_zero_busy_timeout_means_do_not_wait_not_wait_forever(make_ledger, ledger_target: str) -> None:
    ledger = make_ledger(busy_timeout_ms=0)
    reservation = ledger.claim("acct", "k", "fp")
    with psycopg.connect(ledger_target) as holder:
        holder.execute("SELECT * FROM idempotency_keys WHERE key = 'k' FOR UPDATE")
        timer = threading.Timer(5, holder.rollback)  # releases the lock: never hang the suite if it did wait
        timer.start()
        started = time.monotonic()
        try:
            with pytest.raises(DatabaseLockedError):
                ledger.complete(reservation, 201, {}, b"ok")
        finally:
            timer.cancel()
        assert time.monotonic() - started < 2


def test_without_the_driver_a_postgres_url_asks_for_the_extra() -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['psycopg'] = None\n"  # as if `idemctl[postgres]` was never installed
        "from idemctl import Ledger, StorageError\n"
        "try:\n"
        "    Ledger.open('postgresql://app:pw@db/payments')\n"
        "except StorageError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "PostgreSQL support needs the driver: pip install 'idemctl[postgres]' (psycopg is missing)\n"


def test_statement_timeout_from_the_url_is_database_locked_and_says_so(ledger_target: str) -> None:
    ledger = Ledger.open(ledger_target.replace("options=", "options=-c%20statement_timeout%3D100%20"))
    ledger.init()
    with psycopg.connect(ledger_target) as holder:
        holder.execute("LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE")
        timer = threading.Timer(5, holder.rollback)  # releases the lock: never hang the suite
        timer.start()
        try:
            with pytest.raises(
                DatabaseLockedError,
                match=r"was cancelled or ran past statement_timeout: canceling statement due to statement timeout$",
            ):
                ledger.lookup("acct", "k")
        finally:
            timer.cancel()
    ledger.close()
