"""A ledger in a directory nobody may write to (a read-only mount, an
immutable snapshot): the read commands read it as it is when no writer can
exist, and otherwise every command says what is wrong and what to do."""

from __future__ import annotations

import contextlib
import json
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from idemctl import Ledger
from idemctl.cli import app


@contextlib.contextmanager
def closed_directory(path: Path) -> Iterator[None]:
    """No new file in `path`, for anyone (root too): chattr +i, or skip."""
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot make {path} immutable here: {done.stderr.strip() or 'chattr failed'}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=False)


def a_ledger(path: Path) -> None:
    with Ledger.open(path) as ledger:
        ledger.init()
        ledger.complete(ledger.claim("acct_A", "order-42", "fp"), 201, {}, b"{}")  # type: ignore[arg-type]


def cli(*args: str):
    result = CliRunner().invoke(app, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def test_read_commands_read_a_ledger_in_a_directory_no_one_can_write(tmp_path):
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    a_ledger(snapshot / "ledger.db")
    left = sorted(p.name for p in snapshot.iterdir())
    assert left == ["ledger.db", "ledger.db-idemctl.lock"]  # closed cleanly: no -wal or -shm left
    db = str(snapshot / "ledger.db")
    with closed_directory(snapshot):
        stats = cli("--db", db, "stats", "--json")
        inspect = cli("--db", db, "inspect", "order-42", "--principal", "acct_A", "--json")
        sweep = cli("--db", db, "sweep")
    assert (stats.exit_code, stats.stderr) == (0, "")
    assert json.loads(stats.stdout)["total"] == 1
    assert (inspect.exit_code, inspect.stderr) == (0, "")
    # A write still needs the directory, and says so in one line.
    assert (sweep.exit_code, sweep.stdout) == (2, "")
    assert sweep.stderr == (
        f"error: cannot open the ledger at {db}: SQLite must create its -shm file beside it in {snapshot}, "
        "which this user cannot write to; run idemctl as a user who may write there (the application's), "
        "or make the directory writable for this user\n"
    )
    assert sorted(p.name for p in snapshot.iterdir()) == left


def test_a_wal_with_commits_the_file_lacks_is_never_read_around(tmp_path):
    live = tmp_path / "live"
    live.mkdir()
    a_ledger(live / "ledger.db")
    writer = sqlite3.connect(live / "ledger.db")
    writer.execute("PRAGMA wal_autocheckpoint=0")
    writer.execute("UPDATE idempotency_keys SET generation = 2")
    writer.commit()  # in the -wal only
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    shutil.copy(live / "ledger.db", snapshot / "ledger.db")
    shutil.copy(live / "ledger.db-wal", snapshot / "ledger.db-wal")
    writer.close()
    db = str(snapshot / "ledger.db")
    with closed_directory(snapshot):
        stats = cli("--db", db, "stats")
    # Reading the file alone would show generation 1: a wrong answer, so none.
    assert (stats.exit_code, stats.stdout) == (2, "")
    assert stats.stderr == (
        f"error: cannot open the ledger at {db}: SQLite must create its -shm file beside it in {snapshot}, "
        f"which this user cannot write to (and {db}-wal holds commits not yet in the file); run idemctl as a user "
        "who may write there (the application's), or make the directory writable for this user\n"
    )
