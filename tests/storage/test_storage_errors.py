"""Bad paths and bad databases get typed errors with one-line messages, and
lose nothing."""

from __future__ import annotations

import os
import sqlite3
import threading

import pytest

from idemctl import IdemctlError, Ledger, LedgerUnavailableError, StorageError
from idemctl.errors import (
    DatabaseLockedError,
    InvalidKeyError,
    LedgerNotFoundError,
    NotADatabaseError,
    ReadOnlyDatabaseError,
)
from tests.helpers import read_only_file


def noop(body):
    return 200, {}, b"ok"


def test_directory_given_as_database_is_not_a_database(tmp_path):
    with pytest.raises(NotADatabaseError, match=r"is a directory, not a ledger file"):
        Ledger.open(tmp_path)


def test_text_file_given_as_database_is_not_a_database_and_is_left_alone(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("these are my notes, not a ledger\n" * 50)
    before = path.read_bytes()
    with pytest.raises(NotADatabaseError) as info:
        Ledger.open(path)
    assert str(info.value) == f"{path} is not an SQLite database, or it is corrupt"
    assert "\n" not in str(info.value)
    assert path.read_bytes() == before
    assert not os.path.exists(f"{path}-wal")


def test_corrupt_database_is_reported_not_a_database(tmp_path):
    path = tmp_path / "corrupt.db"
    with Ledger.open(path) as ledger:
        ledger.init()
    assert not os.path.exists(f"{path}-wal")  # checkpointed on close: the schema is in the file
    data = bytearray(path.read_bytes())
    data[100:4096] = b"\xde\xad\xbe\xef" * ((4096 - 100) // 4)  # smash the schema page
    path.write_bytes(bytes(data))
    with pytest.raises(NotADatabaseError, match="not an SQLite database, or it is corrupt"):
        ledger = Ledger.open(path)
        ledger.operator.stats()


def test_missing_file_with_create_false_is_not_found_and_not_created(tmp_path):
    path = tmp_path / "nope.db"
    with pytest.raises(LedgerNotFoundError) as info:
        Ledger.open(path, create=False)
    assert str(info.value) == (
        f"no ledger at {path} (`idemctl init` creates it, a server's database included; "
        "ledger.init() creates only the tables)"
    )
    assert info.value.reason == f"no ledger at {path}"
    assert not path.exists()
    with pytest.raises(LedgerNotFoundError):
        Ledger.open(path, readonly=True)
    assert not path.exists()


def test_missing_parent_directory_is_a_clear_error(tmp_path):
    path = tmp_path / "no" / "such" / "dir" / "l.db"
    with pytest.raises(LedgerNotFoundError, match=r"directory .*dir does not exist"):
        Ledger.open(path)


def test_unknown_url_scheme_is_a_storage_error(tmp_path):
    with pytest.raises(
        StorageError,
        match=r"^unsupported ledger URL oracle://…: use a file path, postgresql://, mysql://, d1:// or redis://$",
    ):
        Ledger.open("oracle://root@localhost/db")


def test_read_only_open_refuses_writes_but_reads(tmp_path, clock):
    path = tmp_path / "l.db"
    rw = Ledger.open(path, clock=clock)
    rw.init()
    rw.claim("acct", "k", "fp")
    rw.close()
    ro = Ledger.open(path, readonly=True, clock=clock)
    assert ro.operator.get("acct", "k").row.generation == 1
    with pytest.raises(ReadOnlyDatabaseError, match=r"is read-only$"):
        ro.handle("acct", "k2", "POST", "/", {}, b"", noop)
    assert ro.lookup("acct", "k2") is None
    ro.close()


def test_truly_read_only_file_gives_read_only_error_and_nothing_changes(tmp_path, clock):
    path = tmp_path / "l.db"
    ledger = Ledger.open(path, clock=clock)
    ledger.init()
    ledger.claim("acct", "k", "fp")
    ledger.close()
    before = path.read_bytes()
    with read_only_file(path):
        ledger = Ledger.open(path, clock=clock)
        calls = []
        with pytest.raises(ReadOnlyDatabaseError):
            ledger.handle("acct", "k2", "POST", "/", {}, b"", lambda b: (calls.append(b), (200, {}, b""))[1])
        assert calls == []  # the mutation never ran
        assert ledger.operator.get("acct", "k").row.generation == 1
        ledger.close()
    assert path.read_bytes() == before


def test_a_ledger_in_a_directory_this_user_cannot_write_says_why_and_nothing_changes(tmp_path, clock, monkeypatch):
    # An operator who is not the app's user: even reading a WAL database
    # needs the -shm file beside it, so the directory must be writable. (Not
    # root: a directory closed to root is closed to every writer, and then
    # the ledger is read as it is; see tests/cli/test_cli_read_only_directory.py.)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    from typer.testing import CliRunner

    from idemctl.cli import app

    home = tmp_path / "ledgers"
    home.mkdir()
    path = home / "l.db"
    with Ledger.open(path, clock=clock) as ledger:
        ledger.init()
        ledger.claim("acct", "k", "fp")
    assert sorted(os.listdir(home)) == ["l.db", "l.db-idemctl.lock"]  # WAL and -shm gone with the last connection
    before = path.read_bytes()
    why = (
        f"cannot open the ledger at {path}: SQLite must create its -shm file beside it in {home}, "
        "which this user cannot write to; run idemctl as a user who may write there (the application's), "
        "or make the directory writable for this user"
    )
    with read_only_file(home):
        with pytest.raises(StorageError) as info:
            Ledger.open(path, readonly=True).operator.stats()
        assert str(info.value) == why
        result = CliRunner().invoke(app, ["stats", "--db", str(path)])
        assert (result.exit_code, result.stdout, result.stderr) == (2, "", f"error: {why}\n")
    assert path.read_bytes() == before
    assert sorted(os.listdir(home)) == ["l.db", "l.db-idemctl.lock"]


def test_locked_database_times_out_with_database_locked_error(tmp_path, clock):
    path = tmp_path / "l.db"
    Ledger.open(path).init()
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    ledger = Ledger.open(path, clock=clock, busy_timeout_ms=100)
    calls = []
    with pytest.raises(DatabaseLockedError) as info:
        ledger.handle("acct", "k", "POST", "/", {}, b"", lambda b: (calls.append(b), (200, {}, b""))[1])
    assert isinstance(info.value, LedgerUnavailableError)
    assert str(info.value) == f"database {path} is locked: another writer held it past the 100 ms busy timeout"
    assert calls == []
    blocker.execute("ROLLBACK")
    blocker.close()
    # Once the lock is gone the same ledger works again, and nothing half-done remains.
    assert ledger.lookup("acct", "k") is None
    assert ledger.handle("acct", "k", "POST", "/", {}, b"", noop).status == 200
    ledger.close()


def test_invalid_key_in_single_step_api_is_a_typed_error(ledger):
    with pytest.raises(InvalidKeyError, match=r"invalid Idempotency-Key 'abc\\n'"):
        ledger.claim("acct", "abc\n", "fp")
    assert ledger.operator.stats().total == 0


def test_every_error_is_an_idemctl_error_with_one_line():
    for cls in (DatabaseLockedError, ReadOnlyDatabaseError, NotADatabaseError, LedgerNotFoundError, InvalidKeyError):
        assert issubclass(cls, IdemctlError)


def test_ledger_is_shared_safely_between_threads(ledger):
    errors = []

    def worker(n):
        try:
            for i in range(25):
                a = ledger.handle("acct", f"t{n}-{i}", "POST", "/", {}, b"x", noop)
                assert a.status == 200
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert ledger.operator.stats().completed == 150
