"""`check_failover` and `idemctl doctor`: which replication settings keep a
completion the ledger acknowledged across a failover, as read from the
server. The live servers' side (a real primary and standby) is in
test_postgres_failover.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from idemctl import Ledger
from idemctl.cli import app
from idemctl.replication import ReplicationSettings, Severity, assess, check_failover

# --help and tables are wrapped to this terminal width (tests/cli/conftest.py).
TERMINAL_COLUMNS = "200"


def severities(settings: ReplicationSettings) -> list[str]:
    return [f.severity.value for f in assess(settings)]


def test_asynchronous_replication_with_a_connected_standby_is_a_warning_naming_the_settings_to_use() -> None:
    (finding,) = assess(ReplicationSettings("on", "", False, ("replica1=async",)))
    assert finding.severity is Severity.WARNING
    assert "replication is asynchronous" in finding.message
    assert "set synchronous_standby_names and synchronous_commit=on or remote_apply" in finding.message


@pytest.mark.parametrize("commit", ["on", "remote_apply"])
def test_a_connected_synchronous_standby_with_commits_that_wait_for_it_is_ok(commit: str) -> None:
    (finding,) = assess(ReplicationSettings(commit, "*", False, ("replica1=sync",)))
    assert finding.severity is Severity.OK
    assert finding.message.startswith(f"synchronous replication (synchronous_standby_names='*', synchronous_commit={commit})")


@pytest.mark.parametrize("commit", ["off", "local"])
def test_a_session_whose_commits_do_not_wait_for_the_synchronous_standby_is_a_warning(commit: str) -> None:
    (finding,) = assess(ReplicationSettings(commit, "FIRST 1 (replica1)", False, ("replica1=sync",)))
    assert finding.severity is Severity.WARNING
    assert finding.message.startswith(f"synchronous_commit is {commit} for the ledger's session")


def test_remote_write_is_ok_with_a_note_that_a_crash_of_both_servers_is_not_covered() -> None:
    assert severities(ReplicationSettings("remote_write", "*", False, ("replica1=sync",))) == ["ok", "note"]


def test_a_named_synchronous_standby_that_is_not_connected_is_a_warning_that_commits_will_hang() -> None:
    (finding,) = assess(ReplicationSettings("on", "replica1", False, ("replica2=async",)))
    assert finding.severity is Severity.WARNING
    assert "no synchronous standby is connected" in finding.message
    assert severities(ReplicationSettings("on", "replica1", False, ())) == ["warning"]


def test_standbys_whose_state_the_role_cannot_see_are_a_note_not_a_verdict() -> None:
    assert severities(ReplicationSettings("on", "*", False, ("replica1=unknown",))) == ["ok", "note"]


def test_a_server_without_standbys_is_a_note() -> None:
    assert severities(ReplicationSettings("on", "", False, ())) == ["note"]


def test_a_standby_is_a_warning_that_every_request_is_refused() -> None:
    (finding,) = assess(ReplicationSettings("on", "", True, ()))
    assert finding.severity is Severity.WARNING
    assert finding.message.startswith("this server is a standby (in recovery): it accepts no writes")


def test_a_sqlite_ledger_has_no_replication_to_check(tmp_path: Path) -> None:
    with Ledger.open(str(tmp_path / "l.db")) as ledger:
        ledger.init()
        check = check_failover(ledger)
    assert check.ok and check.settings is None
    assert [f.severity for f in check.findings] == [Severity.OK]


def test_doctor_on_a_sqlite_ledger_says_there_is_nothing_to_fail_over_to(tmp_path: Path) -> None:
    db = str(tmp_path / "l.db")
    with Ledger.open(db) as ledger:
        ledger.init()
    result = CliRunner().invoke(app, ["--db", db, "doctor"])
    assert (result.exit_code, result.stdout) == (
        0,
        f"{db}\nok: SQLite: the ledger is a file on one host; there is no replication to fail over to\n",
    )
    doc = json.loads(CliRunner().invoke(app, ["--db", db, "doctor", "--json"]).stdout)
    assert doc == {
        "ledger": db,
        "ok": True,
        "replication": None,
        "findings": [
            {"severity": "ok", "message": "SQLite: the ledger is a file on one host; there is no replication to fail over to"}
        ],
    }


def test_doctor_without_a_ledger_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["--db", str(tmp_path / "none.db"), "doctor"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1


def test_doctor_on_the_test_server_reads_its_replication_settings(postgres_server: str) -> None:
    result = CliRunner().invoke(app, ["--db", postgres_server, "doctor", "--json"])
    doc = json.loads(result.stdout)
    replication = doc["replication"]
    assert set(replication) == {"synchronous_commit", "synchronous_standby_names", "in_recovery", "standbys"}
    expected = assess(ReplicationSettings(**{**replication, "standbys": tuple(replication["standbys"])}))
    assert doc["findings"] == [{"severity": f.severity.value, "message": f.message} for f in expected]
    assert result.exit_code == (0 if doc["ok"] else 1)
