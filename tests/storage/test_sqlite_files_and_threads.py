"""What a SQLite ledger leaves on the machine: its files' permissions, and
the connections of threads that have ended."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from idemctl import Ledger, Outcome, StorageError
from idemctl.cli import app
from idemctl.errors import SchemaMissingError
from tests.helpers import sqlite_connections_open


def mode_of(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def ok(body: bytes):
    return 201, {}, b"ok"


@pytest.fixture
def open_umask():
    old = os.umask(0o022)  # the usual umask, which would give 0644
    yield
    os.umask(old)


def test_a_new_ledger_and_its_companion_files_are_owner_only(tmp_path, open_umask):
    path = tmp_path / "ledger.db"
    with Ledger.open(path) as ledger:
        ledger.init()
        assert ledger.handle("acct", "k", "POST", "/o", {}, b"x", ok).outcome is Outcome.EXECUTED
        names = sorted(os.listdir(tmp_path))
        assert names == ["ledger.db", "ledger.db-idemctl.lock", "ledger.db-shm", "ledger.db-wal"]
        assert {name: mode_of(tmp_path / name) for name in names} == {name: 0o600 for name in names}


def test_group_access_is_an_explicit_choice_and_umask_does_not_change_it(tmp_path, open_umask):
    path = tmp_path / "shared.db"
    with Ledger.open(path, file_mode=0o660) as ledger:
        ledger.init()
        ledger.handle("acct", "k", "POST", "/o", {}, b"x", ok)
        assert {n: mode_of(tmp_path / n) for n in os.listdir(tmp_path)} == {
            "shared.db": 0o660,
            "shared.db-wal": 0o660,
            "shared.db-shm": 0o660,
            "shared.db-idemctl.lock": 0o660,
        }


def test_an_existing_ledger_keeps_the_permissions_its_operator_gave_it(tmp_path, open_umask):
    path = tmp_path / "ledger.db"
    Ledger.open(path).init()
    os.chmod(path, 0o640)
    with Ledger.open(path, file_mode=0o600) as ledger:
        assert ledger.init().action.value == "already up to date"
    assert mode_of(path) == 0o640


def test_cli_init_takes_a_file_mode_and_refuses_one_the_owner_cannot_use(tmp_path, open_umask, monkeypatch):
    monkeypatch.chdir(tmp_path)
    done = CliRunner().invoke(app, ["--db", "g.db", "init", "--file-mode", "660"])
    assert (done.exit_code, done.stdout) == (0, "g.db: created (schema version 3)\n")
    assert mode_of(tmp_path / "g.db") == 0o660
    bad = CliRunner().invoke(app, ["--db", "h.db", "init", "--file-mode", "0440"])
    assert bad.exit_code == 2
    assert bad.stderr == "error: --file-mode 0440 must let the owner read and write, e.g. 600 or 660\n"
    assert not (tmp_path / "h.db").exists()


def test_a_file_mode_the_owner_cannot_use_is_refused_by_the_library(tmp_path):
    with pytest.raises(StorageError, match=r"file mode 0o400 must let the owner read and write the ledger"):
        Ledger.open(tmp_path / "x.db", file_mode=0o400)


def test_opening_and_reading_a_missing_ledger_never_creates_a_file(tmp_path):
    path = tmp_path / "nope.db"
    ledger = Ledger.open(path)
    for read in (
        ledger.operator.stats,
        lambda: ledger.operator.get("acct", "k"),
        lambda: list(ledger.operator.pending()),
    ):
        with pytest.raises(SchemaMissingError, match=r"has no idempotency ledger \(ledger\.init\(\) creates it\)$"):
            read()
    assert ledger.schema_version() is None and list(ledger.operator.fenced()) == []
    ledger.close()
    assert os.listdir(tmp_path) == []


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_connections_of_finished_threads_are_closed(tmp_path):
    """A server that starts a thread per request must not keep a connection
    (and its file descriptors) per finished thread."""
    path = tmp_path / "ledger.db"
    ledger = Ledger.open(path)
    ledger.init()
    ledger.handle("acct", "warm", "POST", "/o", {}, b"x", ok)
    fds_before = _fds()
    outcomes: list[Outcome] = []

    def one_request(i: int) -> None:
        outcomes.append(ledger.handle("acct", f"k{i}", "POST", "/o", {}, b"x", ok).outcome)

    def wave(first: int) -> None:
        for start in range(first, first + 1500, 100):
            threads = [threading.Thread(target=one_request, args=(i,)) for i in range(start, start + 100)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

    wave(0)
    # Only the main thread's connection is left open. SQLite keeps the
    # database descriptors of closed connections for reuse while another
    # connection of the process holds locks on the file: as many as ran at
    # once (100), not one per finished thread.
    assert sqlite_connections_open(path) == 1
    after_one_wave = _fds()
    assert after_one_wave <= fds_before + 150
    wave(1500)
    assert outcomes == [Outcome.EXECUTED] * 3000
    assert sqlite_connections_open(path) == 1
    assert _fds() <= fds_before + 150  # flat: another 1500 threads added nothing per thread
    assert ledger.operator.stats().completed == 3001
    ledger.close()
    assert sqlite_connections_open(path) == 0
    assert _fds() < fds_before


def test_a_forked_child_never_closes_the_parents_connection(tmp_path):
    path = tmp_path / "ledger.db"
    ledger = Ledger.open(path)
    ledger.init()
    ledger.handle("acct", "parent", "POST", "/o", {}, b"x", ok)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            answer = ledger.handle("acct", "child", "POST", "/o", {}, b"x", ok)
            ledger.close()
            code = 0 if answer.outcome is Outcome.EXECUTED else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's own connection still works after the child closed its ledger.
    assert ledger.handle("acct", "after", "POST", "/o", {}, b"x", ok).outcome is Outcome.EXECUTED
    assert ledger.operator.stats().completed == 3
    ledger.close()


def test_processes_creating_one_ledger_at_once_all_succeed_and_leave_no_staging_files(tmp_path):
    """Every process finds either no file or a whole WAL ledger: the file is
    prepared under a private name and linked into place."""
    import subprocess
    import sys

    path = tmp_path / "raced.db"
    go = tmp_path / "go"
    code = (
        "import os, sys, time\n"
        "from idemctl import Ledger\n"
        "while not os.path.exists(sys.argv[2]): time.sleep(0.001)\n"
        "ledger = Ledger.open(sys.argv[1]); print(ledger.init().action.value); ledger.close()\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(path), str(go)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(8)
    ]
    go.touch()
    results = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0] * 8, results
    actions = sorted(out.strip() for out, _ in results)
    assert actions.count("created") == 1 and actions.count("already up to date") == 7
    assert sorted(os.listdir(tmp_path)) == ["go", "raced.db"]
    assert mode_of(path) == 0o600
