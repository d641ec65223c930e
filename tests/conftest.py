"""Shared fixtures. `ledger_target` is parametrised over the storage backends
so that backend-independent tests run against every one of them."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from idemctl import Ledger, Policy
from tests import galera, redis_servers
from tests.galera import GaleraCluster
from tests.helpers import FakeClock, missing_driver, mysql_test_database, postgres_test_schema, skip_or_fail
from tests.pgbouncer import PgBouncer, start_or_skip

# The suite runs with --doctest-modules (for the library's examples); these
# are support modules, not tests, and some start servers' apps on import.
collect_ignore = ["helpers.py", "galera.py", "pgbouncer.py", "redis_servers.py"]

BACKENDS = ["sqlite", "postgres", "mysql", "redis", "redis-cluster"]
# The engines whose tests start servers of their own (tests/redis_servers.py):
# slow-marked wherever a test is parametrised over engines.
SERVER_BACKENDS = ("redis", "redis-cluster")
# A Redis Cluster runs the same scripts as one server, each on the primary
# of its slot: every engine-independent test on it would add as much time as
# the standalone run again. It runs the modules that set ON_REDIS_CLUSTER =
# True (the ledger's contract and the adapters' table; the state machine
# names it itself) and the tests whose `engines` mark names it.
CLUSTER_OPT_IN = "ON_REDIS_CLUSTER"
# PostgreSQL through PgBouncer in its default configuration, by pool mode:
# the modules that set THROUGH_PGBOUNCER = True run their PostgreSQL tests
# through these too (slow: they start PgBouncer).
PGBOUNCER_BACKENDS = ["pgbouncer-session", "pgbouncer-transaction"]


def engine_params(names: list[str]) -> list[object]:
    """`names` (engines), those that start servers of their own slow-marked."""
    return [pytest.param(name, marks=pytest.mark.slow) if name in SERVER_BACKENDS else name for name in names]


def pgbouncer_params(names: list[str]) -> list[object]:
    """`names` (engines) plus the PgBouncer variants of PostgreSQL, slow-marked."""
    extra = [pytest.param(name, marks=pytest.mark.slow) for name in PGBOUNCER_BACKENDS] if "postgres" in names else []
    return [*engine_params(names), *extra]


# The PostgreSQL half runs against this server; CI fails when it is missing,
# anywhere else those tests are skipped with one reason.
POSTGRES_URL_ENV = "IDEMCTL_TEST_POSTGRES_URL"
DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
# The MariaDB/MySQL half: a server where this user may create databases
# (one per test, dropped afterwards); same rules as PostgreSQL's.
MYSQL_URL_ENV = "IDEMCTL_TEST_MYSQL_URL"
DEFAULT_MYSQL_URL = "mysql://root@127.0.0.1:3306/test"


@pytest.fixture
def db(tmp_path: Path) -> str:
    """The path of an initialised SQLite ledger, for tests of the file itself
    (its processes, its queue, the CLI's environment)."""
    path = str(tmp_path / "ledger.db")
    with Ledger.open(path) as ledger:
        ledger.init()
    return path


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test that uses a ledger runs on each engine (`backend_name`):
    all of them, or those its `engines` mark names, unless the test
    parametrises `backend_name` itself."""
    if "backend_name" not in metafunc.fixturenames:
        return
    if any(mark.args and mark.args[0] == "backend_name" for mark in metafunc.definition.iter_markers("parametrize")):
        return
    marker = metafunc.definition.get_closest_marker("engines")
    names = list(marker.args) if marker else BACKENDS
    if not marker and not getattr(metafunc.module, CLUSTER_OPT_IN, False):
        names = [name for name in names if name != "redis-cluster"]
    if getattr(metafunc.module, "THROUGH_PGBOUNCER", False):
        metafunc.parametrize("backend_name", pgbouncer_params(names))
    else:
        metafunc.parametrize("backend_name", engine_params(names))


@pytest.fixture(scope="session")
def postgres_server() -> str:
    """The test server's base URL; skips (fails under CI) when it is unusable."""
    url = os.environ.get(POSTGRES_URL_ENV, DEFAULT_POSTGRES_URL)
    reason = missing_driver("idemctl.storage.postgres", "PostgreSQL", "postgres")
    if reason is None:
        from idemctl import StorageError
        from idemctl.errors import SchemaTooNewError
        from idemctl.storage import Store
        from idemctl.storage.postgres import PostgresEngine

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
    skip_or_fail(reason, "CI runs the PostgreSQL half of the suite")
    return url


@pytest.fixture(scope="session")
def pgbouncers(postgres_server: str) -> Iterator[Callable[..., PgBouncer]]:
    """PgBouncer in front of the test server, by pool mode (session,
    transaction, statement) and whether it drops startup options
    (`ignore_options`), and whether it passes any database name on
    (`any_database`): each started on first use, stopped at the end of
    the run. Skips (fails under CI) when PgBouncer cannot run here."""
    started: dict[tuple[str, bool, bool], PgBouncer] = {}
    with contextlib.ExitStack() as stack:

        def get(mode: str, *, ignore_options: bool = False, any_database: bool = False) -> PgBouncer:
            if (mode, ignore_options, any_database) not in started:
                bouncer = start_or_skip(mode, postgres_server, ignore_options=ignore_options, any_database=any_database)
                started[mode, ignore_options, any_database] = stack.enter_context(bouncer)
            return started[mode, ignore_options, any_database]

        yield get


# The Redis the queue consumer's end-to-end test uses; the same rule as PostgreSQL.
REDIS_URL_ENV = "IDEMCTL_TEST_REDIS_URL"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="session")
def redis_server() -> str:
    """The test Redis server's URL; skips (fails under CI) when it does not answer."""
    url = os.environ.get(REDIS_URL_ENV, DEFAULT_REDIS_URL)
    reason = None
    try:
        import redis
    except ImportError:
        reason = "Redis tests need the client: pip install -e '.[test]'"
    else:
        try:
            redis.Redis.from_url(url, socket_connect_timeout=3).ping()
        except redis.RedisError as exc:
            reason = f"no Redis answers at {url}: {exc} (set {REDIS_URL_ENV} to use another server)"
    skip_or_fail(reason, "CI runs the Redis tests")
    return url


def _redis_servers_or_skip() -> None:
    reason = redis_servers.missing()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the Redis engine's tests: {reason}", pytrace=False)
        pytest.skip(reason)


@pytest.fixture(scope="session")
def redis_standalone() -> Iterator[redis_servers.Standalone]:
    """A standalone redis-server of the suite's own, on a free port in a
    temporary directory, for the session (never the machine's 6379)."""
    _redis_servers_or_skip()
    server = redis_servers.Standalone()
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[redis_servers.Cluster]:
    """A Redis Cluster of three primaries and three replicas of the suite's
    own, for the session."""
    _redis_servers_or_skip()
    cluster = redis_servers.Cluster()
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def mysql_server() -> str:
    """The MariaDB/MySQL test server's URL (its database is only used to
    connect); skips (fails under CI) when it is unusable."""
    url = os.environ.get(MYSQL_URL_ENV, DEFAULT_MYSQL_URL)
    reason = missing_driver("idemctl.storage.mysql", "MariaDB/MySQL", "mysql")
    if reason is None:
        from idemctl import StorageError
        from idemctl.storage.mysql import MysqlEngine

        probe = MysqlEngine(url, busy_timeout_ms=3000)
        try:
            probe.read("SELECT 1", {})
        except StorageError as exc:
            reason = f"{exc} (set {MYSQL_URL_ENV} to use another server)"
        finally:
            probe.close()
    skip_or_fail(reason, "CI runs the MariaDB half of the suite")
    return url


@pytest.fixture
def ledger_target(
    backend_name: str, tmp_path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """Where a fresh, empty ledger lives for this test (a path or a URL)."""
    if backend_name in ("sqlite", "sqlite-group"):  # sqlite-group: a few modules' group-commit variant
        yield str(tmp_path / "ledger.db")
    elif backend_name == "postgres":
        yield from postgres_test_schema(request.getfixturevalue("postgres_server"), monkeypatch)
    elif backend_name.startswith("pgbouncer-"):
        bouncer = request.getfixturevalue("pgbouncers")(backend_name.removeprefix("pgbouncer-"))
        yield from postgres_test_schema(request.getfixturevalue("postgres_server"), monkeypatch, via=bouncer.url())
    elif backend_name == "mysql":
        yield from mysql_test_database(request.getfixturevalue("mysql_server"), monkeypatch)
    elif backend_name == "d1":  # only where a module asks for it (tests/d1/): it starts miniflare
        yield request.getfixturevalue("d1")(monkeypatch)
    elif backend_name in SERVER_BACKENDS:
        servers = request.getfixturevalue("redis_standalone" if backend_name == "redis" else "redis_cluster")
        servers.flush()  # each test starts from an empty ledger
        yield servers.url
    else:  # pragma: no cover
        raise AssertionError(backend_name)


@pytest.fixture
def make_ledger(ledger_target: str, clock: FakeClock) -> Iterator[Callable[..., Ledger]]:
    """Open (and init) ledgers on this test's target; all are closed afterwards."""
    opened: list[Ledger] = []

    def factory(
        *, policy: Policy | None = None, clock_fn: Callable[[], int] | None = None, init: bool = True, **kw: object
    ) -> Ledger:
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


@pytest.fixture(scope="session")
def d1_runtime() -> Iterator[object]:
    """miniflare serving the recipe's Worker and D1's HTTP API over one D1
    database (tests/d1/runtime.py), once for the session; skips (fails
    under CI) where node or `npm ci` in tests/d1/runtime is missing."""
    from tests.d1.runtime import start

    started = start()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def d1(d1_runtime: object) -> Callable[[pytest.MonkeyPatch], str]:
    """An empty D1 database in the session's runtime: wipes it, sets the
    token and base URL in the environment, gives the ledger's URL."""
    from tests.d1.runtime import Runtime, wipe

    def fresh(monkeypatch: pytest.MonkeyPatch) -> str:
        assert isinstance(d1_runtime, Runtime)
        wipe(d1_runtime)
        for name, value in d1_runtime.env().items():
            monkeypatch.setenv(name, value)
        return d1_runtime.ledger_url

    return fresh


@pytest.fixture(scope="session")
def galera_cluster() -> Iterator[GaleraCluster]:
    """A three-node MariaDB Galera cluster on free ports in a temporary
    directory (tests/galera.py), started once for the session and gone
    after it; skips (fails under CI) where galera-4 or rsync is missing."""
    skip_or_fail(galera.missing(), "CI runs the Galera tests")
    cluster = GaleraCluster()
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def galera_database(galera_cluster: GaleraCluster) -> Iterator[str]:
    """A fresh database on the cluster for one test (its name); every node
    has it, and it is dropped afterwards. A node that a test killed is
    started again first, so the next test has three nodes."""
    name = f"t_{secrets.token_hex(6)}"
    galera_cluster.create_database(name)
    try:
        yield name
    finally:
        galera_cluster.heal()
        galera_cluster.drop_database(name)
