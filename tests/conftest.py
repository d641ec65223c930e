"""Shared fixtures. `ledger_target` is parametrised over the storage backends
so that backend-independent tests run against every one of them."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
from collections.abc import Callable, Iterator

import pytest

from idemctl import Ledger, Policy

BACKENDS = ["sqlite", "postgres"]

# The PostgreSQL half runs against this server; CI fails when it is missing,
# anywhere else those tests are skipped with one reason.
POSTGRES_URL_ENV = "IDEMCTL_TEST_POSTGRES_URL"
DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"


class FakeClock:
    """A virtual clock in integer milliseconds, moved by hand."""

    def __init__(self, start: int = 1_700_000_000_000) -> None:
        self.now = start

    def __call__(self) -> int:
        return self.now

    def advance(self, ms: int) -> int:
        self.now += ms
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def postgres_server() -> str:
    """The test server's base URL; skips (fails under CI) when it is unusable."""
    url = os.environ.get(POSTGRES_URL_ENV, DEFAULT_POSTGRES_URL)
    reason = None
    try:
        from idemctl.storage import Store
        from idemctl.storage.postgres import PostgresEngine
    except ImportError as exc:
        reason = f"PostgreSQL tests need the driver: pip install -e '.[postgres]' ({exc.name} is missing)"
    else:
        from idemctl import SchemaTooNewError, StorageError

        try:
            probe = Store(PostgresEngine(url, busy_timeout_ms=3000))
            try:
                probe.schema_version()
            finally:
                probe.close()
        except SchemaTooNewError:
            pass  # someone's ledger outside the per-test schemas: the server itself is fine
        except StorageError as exc:
            reason = f"{exc} (set {POSTGRES_URL_ENV} to use another server)"
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the PostgreSQL half of the suite: {reason}", pytrace=False)
        pytest.skip(reason)
    return url


def postgres_test_schema(base: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A private schema on the test server for one test, as a URL whose
    search_path holds only that schema, so processes started by the test reach
    the same isolated ledger by URL. Dropped afterwards with everything the
    test left open in it."""
    import psycopg

    from idemctl.storage import postgres

    schema = f"t_{secrets.token_hex(6)}"
    app = f"idemctl-test-{schema}"
    sep = "&" if "?" in base else "?"
    url = f"{base}{sep}options=-csearch_path%3D{schema}&application_name={app}"
    with psycopg.connect(base, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")
    opened: list[postgres.PostgresEngine] = []
    real_init = postgres.PostgresEngine.__init__

    def tracking_init(self: postgres.PostgresEngine, *args: object, **kwargs: object) -> None:
        real_init(self, *args, **kwargs)  # type: ignore[arg-type]
        opened.append(self)

    monkeypatch.setattr(postgres.PostgresEngine, "__init__", tracking_init)
    try:
        yield url
    finally:
        # Pools a test forgot to close would hold server connections for the
        # rest of the run; close them, then end whatever is still connected.
        for engine in opened:
            engine.close()
        with psycopg.connect(base, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = %s AND pid <> pg_backend_pid()",
                (app,),
            )
            admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@pytest.fixture
def ledger_target(backend_name: str, tmp_path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Where a fresh, empty ledger lives for this test (a path or a URL)."""
    if backend_name == "sqlite":
        yield str(tmp_path / "ledger.db")
    elif backend_name == "postgres":
        yield from postgres_test_schema(request.getfixturevalue("postgres_server"), monkeypatch)
    else:  # pragma: no cover
        raise AssertionError(backend_name)


@pytest.fixture
def make_ledger(ledger_target: str, clock: FakeClock) -> Iterator[Callable[..., Ledger]]:
    """Open (and init) ledgers on this test's target; all are closed afterwards."""
    opened: list[Ledger] = []

    def factory(*, policy: Policy | None = None, clock_fn: Callable[[], int] | None = None, init: bool = True, **kw: object) -> Ledger:
        ledger = Ledger.open(ledger_target, policy=policy, clock=clock_fn or clock, **kw)  # type: ignore[arg-type]
        opened.append(ledger)
        if init:
            ledger.init()
        return ledger

    yield factory
    for ledger in opened:
        ledger.close()


@pytest.fixture
def ledger(make_ledger: Callable[..., Ledger]) -> Ledger:
    return make_ledger()


# Test data lives inside the checkout, so a clone anywhere runs the suite.
VECTORS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vectors")


@contextlib.contextmanager
def read_only_file(path: str | os.PathLike[str]) -> Iterator[None]:
    """Make a file truly read-only for root too (chattr +i), or skip with the reason."""
    path = os.fspath(path)
    done = subprocess.run(["chattr", "+i", path], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot make {path} immutable here: {done.stderr.strip() or 'chattr failed'}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", path], check=False)
