"""The registry of engines: which kind a location names, the messages for
one it does not know, what registering a kind checks, and that an engine
registered from outside is opened, stored over and described by its own
kind's words everywhere (the ledger, `doctor`), with no other change."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from idemctl import Ledger
from idemctl.cli import app
from idemctl.errors import LedgerNotFoundError, StorageError
from idemctl.operations.replication import check_failover
from idemctl.storage import (
    Capabilities,
    EngineKind,
    Locations,
    Store,
    accepted_urls,
    create_database,
    engine_kind,
    is_file_location,
    is_mysql_url,
    is_postgres_url,
    is_server_url,
    kind_of,
    kinds,
    open_engine,
    open_store,
    reads_where_it_writes,
    register,
    registry,
)
from idemctl.storage.capabilities import CAPABILITY_METHODS
from idemctl.storage.dialect import SQLITE
from idemctl.storage.failover import Severity
from idemctl.storage.sqlite import SqliteEngine


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Kinds registered by a test are gone after it."""
    monkeypatch.setattr(registry, "_KINDS", dict(registry._KINDS))
    yield


@pytest.mark.parametrize(
    ("target", "name"),
    [
        ("ledger.db", "sqlite"),
        (":memory:", "sqlite"),
        ("/srv/app/ledger.db", "sqlite"),
        ("host=ledger.db", "postgres"),  # libpq keywords only: a connection string
        ("data=1.db", "sqlite"),  # not a libpq keyword: a file name
        ("postgresql://app@db/payments", "postgres"),
        ("postgres://app@db/payments", "postgres"),
        ("host=db user=app dbname=payments", "postgres"),
        ("mysql://app@db/payments", "mysql"),
        ("mariadb://app@db/payments", "mysql"),
    ],
)
def test_each_location_names_its_kind(target: str, name: str):
    assert kind_of(target).name == name


def test_a_path_object_is_a_file(tmp_path: Path):
    assert kind_of(tmp_path / "ledger.db").name == "sqlite"
    assert is_file_location(tmp_path / "ledger.db")


def test_the_built_in_kinds_their_order_and_capabilities():
    assert [(k.name, k.title, k.locations.schemes) for k in kinds()] == [
        ("postgres", "PostgreSQL", ("postgresql", "postgres")),
        ("mysql", "MariaDB/MySQL", ("mysql", "mariadb")),
        ("d1", "Cloudflare D1", ("d1",)),
        ("redis", "Redis", ("redis", "rediss", "redis+sentinel", "rediss+sentinel")),
        ("sqlite", "SQLite", ()),
    ]
    capabilities = {k.name: dataclasses.astuple(k.capabilities) for k in kinds()}
    # server, native_async, creates_database, replicates, readonly_reaches_writer
    assert capabilities == {
        "postgres": (True, True, True, True, False),
        "mysql": (True, False, True, True, True),
        "d1": (True, False, False, True, True),
        "redis": (True, True, False, True, True),
        "sqlite": (False, False, False, False, True),
    }


def _promises(kind: EngineKind) -> tuple[dict[str, bool], dict[str, bool]]:
    """What the kind's engine class has, and what the kind promises it has."""
    engine_class = kind.engine_class()
    has = {capability: hasattr(engine_class, method) for capability, method in CAPABILITY_METHODS.items()}
    return has, {capability: getattr(kind.capabilities, capability) for capability in CAPABILITY_METHODS}


@pytest.mark.parametrize("kind", kinds(), ids=lambda k: k.name)
def test_each_kind_s_engine_class_has_what_its_capabilities_promise(kind: EngineKind):
    try:
        has, promised = _promises(kind)
    except StorageError as exc:  # its driver is not installed here
        pytest.skip(str(exc))
    assert has == promised
    assert kind.engine_class().dialect.name == kind.name  # type: ignore[attr-defined]


def test_the_promise_check_finds_a_kind_that_promises_too_much():
    sqlite = kinds()[-1]  # SQLite has no failover facts
    lying = dataclasses.replace(sqlite, capabilities=dataclasses.replace(sqlite.capabilities, replicates=True))
    has, promised = _promises(lying)
    assert {k for k in has if has[k] != promised[k]} == {"replicates"}


def test_a_url_of_no_kind_is_refused_naming_what_is_accepted():
    with pytest.raises(
        StorageError,
        match=r"^unsupported ledger URL oracle://…: use a file path, postgresql://, mysql://, d1:// or redis://$",
    ):
        kind_of("oracle://db/x")
    assert not is_file_location("oracle://db/x")
    assert (is_server_url("oracle://db/x"), is_postgres_url("oracle://db/x"), is_mysql_url("oracle://db/x")) == (
        False,
        False,
        False,
    )


def test_a_target_that_is_no_location_is_refused_naming_every_kind():
    with pytest.raises(StorageError) as caught:
        open_engine(42)  # type: ignore[arg-type]
    assert str(caught.value) == (
        "a ledger is a file path, a postgresql:// URL or connection string, a mysql:// URL,"
        " a d1://ACCOUNT_ID/DATABASE_ID URL, or a redis:// URL, got int"
    )


def test_scheme_matching_is_exact_as_before():
    # An upper-case scheme was never a server URL: it stays unsupported, not a file.
    with pytest.raises(StorageError, match="unsupported ledger URL POSTGRESQL://"):
        kind_of("POSTGRESQL://db/x")


def test_the_public_queries_follow_the_registry():
    assert is_postgres_url("host=db dbname=x") and not is_postgres_url("mysql://a@b/c")
    assert is_mysql_url("mariadb://a@b/c") and not is_mysql_url("ledger.db")
    assert is_server_url("mysql://a@b/c") and not is_server_url("ledger.db")
    assert (reads_where_it_writes("mysql://a@b/c"), reads_where_it_writes("postgresql://a@b/c")) == (True, False)


def test_a_file_kind_creates_no_database(tmp_path: Path):
    assert create_database(str(tmp_path / "x.db")) is None


def test_a_second_fallback_or_a_taken_scheme_is_refused(scratch_registry: None):
    other_file = EngineKind(
        "lmdb", "LMDB", Locations((), "an LMDB path", fallback=True), "x:Y", capabilities=Capabilities(server=False)
    )
    with pytest.raises(StorageError, match=r"^engine kind lmdb: another kind is the fallback already$"):
        register(other_file)
    clash = EngineKind("pg2", "PG2", Locations(("pg2", "postgres"), "a pg2:// URL"), "x:Y")
    with pytest.raises(StorageError, match=r"^engine kind pg2: scheme postgres:// is postgres's already$"):
        register(clash)
    assert [k.name for k in kinds()] == ["postgres", "mysql", "d1", "redis", "sqlite"]


def test_a_missing_driver_names_the_extra_that_brings_it(scratch_registry: None):
    register(
        EngineKind("nodb", "NoDB", Locations(("nodb",), "a nodb:// URL"), "idemctl_no_such_driver:Engine", extra="nodb")
    )
    with pytest.raises(StorageError) as caught:
        open_engine("nodb://host/x")
    assert str(caught.value) == (
        "NoDB support needs the driver: pip install 'idemctl[nodb]' (idemctl_no_such_driver is missing)"
    )
    # The list of what is accepted grows with the kinds registered.
    with pytest.raises(
        StorageError,
        match=r"^unsupported ledger URL x://…: use a file path, postgresql://, mysql://, d1://, redis:// or nodb://$",
    ):
        kind_of("x://y")
    assert accepted_urls() == "a postgresql://, a mysql://, a d1://, a redis:// or a nodb:// URL"
    empty = CliRunner().invoke(app, ["--db", "", "stats"])
    assert (empty.exit_code, empty.stderr) == (
        2,
        "error: --db is empty: give a ledger file path, a postgresql://, a mysql://, a d1://, a redis:// or a nodb:// URL\n",
    )


# -- an engine registered from outside --------------------------------------------------------

# A file engine of another name: SQLite underneath, so the SQL store runs on it.
DISKFILE = dataclasses.replace(SQLITE, name="diskfile")


class DiskFileEngine(SqliteEngine):
    dialect = DISKFILE


class CountingStore(Store):
    """The SQL store, counting how many were built (a kind's own store class)."""

    built = 0

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        CountingStore.built += 1


def _path(target: str) -> str:
    return target.split("://", 1)[1]


@pytest.fixture
def diskfile(scratch_registry: None) -> EngineKind:
    return register(
        EngineKind(
            "diskfile",
            "DiskFile",
            Locations(("diskfile",), "a diskfile:// path", locate=_path),
            f"{__name__}:DiskFileEngine",
            store=f"{__name__}:CountingStore",
            sqlite_options=True,
            capabilities=Capabilities(server=False),
        )
    )


def _sqlite_ledger(tmp_path: Path) -> str:
    path = str(tmp_path / "l.db")
    with Ledger.open(path) as ledger:
        ledger.init()
    return path


def test_a_registered_kind_opens_its_engine_and_its_own_store(diskfile: EngineKind, tmp_path: Path):
    path = _sqlite_ledger(tmp_path)
    before = CountingStore.built
    store = open_store(f"diskfile://{path}")
    try:
        assert isinstance(store, CountingStore) and CountingStore.built == before + 1
        assert isinstance(store.engine, DiskFileEngine)
        assert engine_kind(store.engine) is diskfile
        assert store.schema_version() == 3
    finally:
        store.close()


def test_a_file_kind_checks_the_schema_at_open(diskfile: EngineKind, tmp_path: Path):
    # Not a server: the file is opened, and a missing one refused, at open.
    with pytest.raises(LedgerNotFoundError):
        Ledger.open(f"diskfile://{tmp_path / 'none.db'}", create=False)


def test_doctor_names_a_registered_file_kind_by_its_own_title(diskfile: EngineKind, tmp_path: Path):
    target = f"diskfile://{_sqlite_ledger(tmp_path)}"
    with Ledger.open(target, create=False, readonly=True) as ledger:
        check = check_failover(ledger)
    assert (check.engine, check.settings, check.ok) == ("DiskFile", None, True)
    assert [(f.severity, f.message) for f in check.findings] == [
        (Severity.OK, "DiskFile: the ledger is a file on one host; there is no replication to fail over to")
    ]
    result = CliRunner().invoke(app, ["--db", target, "doctor"])
    assert (result.exit_code, result.stderr) == (0, "")
    assert "SQLite" not in result.stdout
    assert result.stdout.splitlines()[1] == (
        "ok: DiskFile: the ledger is a file on one host; there is no replication to fail over to"
    )


def test_a_server_kind_without_replication_facts_says_it_cannot_read_them(scratch_registry: None, tmp_path: Path):
    register(
        EngineKind(
            "diskfile",
            "RemoteThing",
            Locations(("remote",), "a remote:// URL", locate=_path),
            f"{__name__}:DiskFileEngine",
            sqlite_options=True,
        )
    )
    with Ledger.open(f"remote://{_sqlite_ledger(tmp_path)}", create=False, readonly=True) as ledger:
        check = check_failover(ledger)
    assert check.ok and check.engine == "RemoteThing"
    assert [(f.severity, f.message) for f in check.findings] == [
        (
            Severity.NOTE,
            "RemoteThing: idemctl cannot read how this database replicates; check with its operator that a write "
            "it acknowledged survives a failover",
        )
    ]
