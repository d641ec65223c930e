"""`idemctl sweep`: bounded batches until drained, --max-batches, --dry-run,
--retention, and Ctrl-C between batches (a real SIGINT to a real process)."""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from idemctl import Ledger, fingerprint, wall_clock_ms
from idemctl.cli import app
from tests.helpers import FakeClock, read_terminal

HOUR = 3_600_000
FP = fingerprint("POST", "/orders", [], b"{}")
IDEMCTL = Path(sys.executable).with_name("idemctl")


def backlog(ledger: Ledger, clock, *, expired: int, fresh: int, fenced: int = 0) -> None:
    """`expired` completed rows written 30 h ago (plus `fenced` fenced-out
    events as old), and `fresh` completed rows written a minute ago."""
    clock.now = wall_clock_ms() - 30 * HOUR
    for i in range(expired):
        ledger.complete(ledger.claim("acct_A", f"old-{i:04d}", FP), 201, {}, b"{}")
    for i in range(fenced):
        late = ledger.claim("acct_F", f"late-{i}", FP)
        clock.now += 31_000
        ledger.complete(ledger.takeover("acct_F", f"late-{i}", FP), 201, {}, b"{}")
        ledger.complete(late, 201, {}, b"{}")
    clock.now = wall_clock_ms() - 60_000
    for i in range(fresh):
        ledger.complete(ledger.claim("acct_A", f"new-{i:04d}", FP), 201, {}, b"{}")


def sweep(*args: str):
    result = CliRunner().invoke(app, ["sweep", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def test_sweep_drains_the_backlog_in_bounded_batches_and_keeps_fresh_rows(make_ledger, ledger_target, clock):
    ledger = make_ledger()
    backlog(ledger, clock, expired=45, fresh=3)
    result = sweep("--batch-size", "20", "--db", ledger_target)
    assert result.exit_code == 0
    assert result.stderr == ""  # no progress bar when stderr is not a terminal
    assert re.fullmatch(
        r"deleted 45 row\(s\) in 4 batch\(es\) of at most 20, \d+ (ms|s); nothing left past the 1 d retention; "
        r"fenced-out log: 0 event\(s\) older than 30 d deleted\n",
        result.stdout,
    )
    assert ledger.operator.count_expired() == 0
    assert ledger.operator.stats().total == 3


def test_sweep_json_reports_rows_fenced_events_batches_and_why_it_stopped(make_ledger, ledger_target, clock):
    ledger = make_ledger()
    backlog(ledger, clock, expired=5, fresh=1, fenced=2)
    result = sweep("--batch-size", "4", "--json", "--db", ledger_target)
    assert result.exit_code == 0 and result.stderr == ""
    doc = json.loads(result.stdout)
    assert isinstance(doc.pop("elapsed_ms"), int)
    # 7 old rows (5 plain, 2 taken over) in batches of 4: 4, 3, then an empty
    # batch; the 30 h old fenced-out events stay for the log's 30 days.
    assert doc == {
        "dry_run": False,
        "deleted": 7,
        "fenced_deleted": 0,
        "batches": 3,
        "batch_size": 4,
        "stopped": "drained",
        "remaining": 0,
        "retention_ms": 86_400_000,
        "fenced_retention_ms": 30 * 86_400_000,
    }
    assert len(list(ledger.operator.fenced())) == 2


def test_sweep_deletes_fenced_out_events_only_past_their_own_retention_and_says_so(make_ledger, ledger_target, clock):
    ledger = make_ledger()
    backlog(ledger, clock, expired=0, fresh=0, fenced=2)
    dry = sweep("--dry-run", "--fenced-retention", "1d", "--db", ledger_target)
    assert re.fullmatch(
        r"would delete 2 row\(s\) not written since \S+Z \(retention 1 d\) and 2 fenced-out event\(s\) older than "
        r"\S+Z \(retention 1 d\); nothing deleted\n",
        dry.stdout,
    )
    doc = json.loads(sweep("--dry-run", "--json", "--db", ledger_target).stdout)
    assert (doc["would_delete"], doc["would_delete_fenced"], doc["fenced_retention_ms"]) == (2, 0, 30 * 86_400_000)
    result = sweep("--fenced-retention", "1d", "--db", ledger_target)
    assert re.fullmatch(
        r"deleted 2 row\(s\) in 2 batch\(es\) of at most \d+, \d+ (ms|s); nothing left past the 1 d retention; "
        r"fenced-out log: 2 event\(s\) older than 1 d deleted\n",
        result.stdout,
    )
    assert list(ledger.operator.fenced()) == []


def test_sweep_dry_run_counts_and_deletes_nothing(make_ledger, ledger_target, clock):
    ledger = make_ledger()
    backlog(ledger, clock, expired=12, fresh=2)
    result = sweep("--dry-run", "--db", ledger_target)
    assert result.exit_code == 0 and result.stderr == ""
    assert re.fullmatch(
        r"would delete 12 row\(s\) not written since \S+Z \(retention 1 d\) and 0 fenced-out event\(s\) older than "
        r"\S+Z \(retention 30 d\); nothing deleted\n",
        result.stdout,
    )
    doc = json.loads(sweep("--dry-run", "--json", "--db", ledger_target).stdout)
    assert (doc["dry_run"], doc["would_delete"], doc["retention_ms"]) == (True, 12, 86_400_000)
    assert ledger.operator.count_expired() == 12 and ledger.operator.stats().total == 14


def test_sweep_stops_at_max_batches_and_says_how_many_are_left(make_ledger, ledger_target, clock):
    ledger = make_ledger()
    backlog(ledger, clock, expired=25, fresh=0)
    result = sweep("--batch-size", "10", "--max-batches", "2", "--db", ledger_target)
    assert result.exit_code == 0
    assert re.fullmatch(
        r"deleted 20 row\(s\) in 2 batch\(es\) of at most 10, \d+ (ms|s); "
        r"stopped at --max-batches with 5 expired row\(s\) left; fenced-out log: 0 event\(s\) older than 30 d deleted\n",
        result.stdout,
    )
    assert ledger.operator.count_expired() == 5


def test_sweep_retention_override_deletes_younger_rows(make_ledger, ledger_target, clock):
    ledger = make_ledger()
    backlog(ledger, clock, expired=3, fresh=4)  # the fresh ones are a minute old
    doc = json.loads(sweep("--retention", "45s", "--json", "--db", ledger_target).stdout)
    assert (doc["deleted"], doc["retention_ms"]) == (7, 45_000)
    assert ledger.operator.stats().total == 0


def test_sweep_without_batch_size_drains_in_250s_on_sqlite_and_5000s_on_server_engines(
    make_ledger, ledger_target, clock
):
    ledger = make_ledger()
    backlog(ledger, clock, expired=260, fresh=1)
    doc = json.loads(sweep("--json", "--db", ledger_target).stdout)
    # SQLite: 250 + 10, then the empty batch that proves it drained; PostgreSQL, MariaDB: 260, then the
    # empty one; Redis, in 1000s (its batch is one script per bucket): the same.
    expected = {"sqlite": (250, 3), "postgres": (5000, 2), "mysql": (5000, 2), "redis": (1000, 2)}[
        ledger.store.dialect.name
    ]
    assert (doc["batch_size"], doc["batches"], doc["deleted"], doc["stopped"]) == (*expected, 260, "drained")
    assert ledger.operator.drain_batch == expected[0]
    assert ledger.operator.stats().total == 1


def file_with_a_backlog(db: Path, *, expired: int) -> Path:
    """A new SQLite ledger at `db` holding `expired` rows past retention and nothing else."""
    clock = FakeClock()
    with Ledger.open(db, clock=clock) as ledger:
        ledger.init()
        backlog(ledger, clock, expired=expired, fresh=0)
    return db


def test_sweep_batch_size_is_bounded():
    result = CliRunner().invoke(app, ["sweep", "--batch-size", "1000000"])
    assert result.exit_code == 2 and "--batch-size" in result.stderr and result.stdout == ""


@pytest.mark.slow
def test_ctrl_c_stops_the_sweep_between_batches_and_reports_what_was_deleted(tmp_path):
    db = file_with_a_backlog(tmp_path / "big.db", expired=50)
    proc = subprocess.Popen(
        [str(IDEMCTL), "--db", str(db), "sweep", "--batch-size", "10", "--pause", "5s"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with Ledger.open(db, create=False, readonly=True) as watcher:
            deadline = time.monotonic() + 20
            while watcher.operator.count_expired() > 40 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert watcher.operator.count_expired() == 40  # first batch done, now pausing
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (out, err)
    assert err == ""
    assert re.fullmatch(
        r"interrupted: deleted 10 row\(s\) in 1 batch\(es\) of at most 10, \d+ (ms|s); 40 expired row\(s\) left; "
        r"fenced-out log: 0 event\(s\) older than 30 d deleted\n",
        out,
    )
    with Ledger.open(db, create=False) as ledger:
        assert ledger.operator.count_expired() == 40
    assert os.path.exists(db)


@pytest.mark.slow
def test_the_progress_bar_goes_to_stderr_only_when_it_is_a_terminal(tmp_path):
    db = file_with_a_backlog(tmp_path / "tty.db", expired=30)
    master, slave = pty.openpty()
    try:
        proc = subprocess.run(
            [str(IDEMCTL), "--db", str(db), "sweep", "--batch-size", "10", "--pause", "300ms"],
            stdout=subprocess.PIPE,
            stderr=slave,
            text=True,
            timeout=30,
            env={**os.environ, "TERM": "xterm", "COLUMNS": "100"},
        )
        os.close(slave)
        seen = read_terminal(master)
    finally:
        os.close(master)
    assert proc.returncode == 0
    assert proc.stdout.startswith("deleted 30 row(s) in 4 batch(es)")  # stdout: the summary only
    assert b"sweeping" in seen and b"/30" in seen  # stderr (a terminal): the bar, counting rows
