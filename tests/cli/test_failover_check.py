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
from idemctl.operations.replication import ReplicationSettings, Severity, assess, check_failover
from idemctl.operations.replication_mysql import MysqlFacts, assess_mysql

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
    assert finding.message.startswith(
        f"synchronous replication (synchronous_standby_names='*', synchronous_commit={commit})"
    )


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
        f"{db} (SQLite)\nok: SQLite: the ledger is a file on one host; there is no replication to fail over to\n",
    )
    doc = json.loads(CliRunner().invoke(app, ["--db", db, "doctor", "--json"]).stdout)
    assert doc == {
        "ledger": db,
        "engine": "SQLite",
        "ok": True,
        "replication": None,
        "findings": [
            {
                "severity": "ok",
                "message": "SQLite: the ledger is a file on one host; there is no replication to fail over to",
            }
        ],
    }


def test_doctor_without_a_ledger_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["--db", str(tmp_path / "none.db"), "doctor"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1


def test_doctor_on_the_test_server_reads_its_replication_settings(postgres_server: str) -> None:
    result = CliRunner().invoke(app, ["--db", postgres_server, "doctor", "--json"])
    doc = json.loads(result.stdout)
    assert doc["engine"] == "PostgreSQL"
    replication = doc["replication"]
    assert set(replication) == {"synchronous_commit", "synchronous_standby_names", "in_recovery", "standbys"}
    expected = assess(ReplicationSettings(**{**replication, "standbys": tuple(replication["standbys"])}))
    assert doc["findings"] == [{"severity": f.severity.value, "message": f.message} for f in expected]
    assert result.exit_code == (0 if doc["ok"] else 1)


def test_doctor_on_postgresql_names_the_engine_and_never_sqlite(postgres_server: str) -> None:
    result = CliRunner().invoke(app, ["--db", postgres_server, "doctor"])
    first, *findings = result.stdout.splitlines()
    assert first.endswith(" (PostgreSQL)")
    assert findings and "SQLite" not in result.stdout
    assert all(line.split(": ", 1)[0] in ("ok", "note", "warning") for line in findings)


# -- MariaDB and MySQL --------------------------------------------------------------------------

PLAIN = {
    "version": "10.11.19-MariaDB-0+deb12u1",
    "wsrep_on": "OFF",
    "read_only": "OFF",
    "log_bin": "ON",
    "binlog_format": "ROW",
    "sync_binlog": "1",
    "innodb_flush_log_at_trx_commit": "1",
    "rpl_semi_sync_master_enabled": "OFF",
    "rpl_semi_sync_master_wait_point": "AFTER_SYNC",
    "slaves_connected": "0",
    "slaves_running": "0",
    "rpl_semi_sync_master_status": "OFF",
}
GALERA = {
    **PLAIN,
    "wsrep_on": "ON",
    "wsrep_sync_wait": "3",
    "wsrep_cluster_name": "payments",
    "wsrep_cluster_status": "Primary",
    "wsrep_local_state_comment": "Synced",
    "wsrep_cluster_size": "3",
}


def mysql_findings(**values: str) -> list[tuple[str, str]]:
    return [(f.severity.value, f.message) for f in assess_mysql(MysqlFacts({**PLAIN, **values}))]


def galera_findings(**values: str) -> list[tuple[str, str]]:
    return [(f.severity.value, f.message) for f in assess_mysql(MysqlFacts({**GALERA, **values}))]


def test_asynchronous_mariadb_replicas_are_a_warning_naming_semi_sync() -> None:
    ((severity, message),) = mysql_findings(slaves_connected="2")
    assert severity == "warning"
    assert message.startswith("replication is asynchronous (2 replica(s) connected, rpl_semi_sync_master_enabled=OFF)")


def test_active_semi_sync_after_sync_is_ok_and_after_commit_adds_a_note() -> None:
    semi = {"slaves_connected": "1", "rpl_semi_sync_master_enabled": "ON", "rpl_semi_sync_master_status": "ON"}
    assert [s for s, _ in mysql_findings(**semi)] == ["ok"]
    assert mysql_findings(**semi)[0][1].startswith("semi-synchronous replication (1 replica(s) connected)")
    assert [s for s, _ in mysql_findings(**semi, rpl_semi_sync_master_wait_point="AFTER_COMMIT")] == ["ok", "note"]


def test_semi_sync_that_fell_back_to_asynchronous_is_a_warning() -> None:
    ((severity, message),) = mysql_findings(
        slaves_connected="1", rpl_semi_sync_master_enabled="ON", rpl_semi_sync_master_status="OFF"
    )
    assert severity == "warning" and message.startswith("semi-synchronous replication is enabled but inactive")


def test_what_stops_every_write_on_a_plain_server_is_a_warning() -> None:
    assert mysql_findings(read_only="ON")[0][1].startswith("read_only is ON: this server refuses the ledger's writes")
    assert mysql_findings(slaves_running="1")[0][1].startswith("this server is a replica")
    assert mysql_findings(binlog_format="STATEMENT")[0] == (
        "warning",
        "binlog_format is STATEMENT: the server refuses writes under READ COMMITTED, which the ledger's sessions "
        "use, so every claim fails; set it to ROW or MIXED",
    )


def test_commits_not_flushed_at_acknowledgement_are_a_warning_on_one_server_and_a_note_on_galera() -> None:
    assert mysql_findings(innodb_flush_log_at_trx_commit="2")[0][0] == "warning"
    assert [s for s, _ in galera_findings(innodb_flush_log_at_trx_commit="2")] == ["ok", "note"]


def test_a_server_without_a_binary_log_is_a_note_and_sync_binlog_matters_only_with_one() -> None:
    assert [s for s, _ in mysql_findings(log_bin="OFF", sync_binlog="0")] == ["note"]
    assert mysql_findings(log_bin="OFF")[0][1].startswith("the binary log is off")
    assert [s for s, _ in mysql_findings(sync_binlog="0")] == ["note", "note"]


def test_a_synced_galera_node_of_three_with_causal_reads_is_ok() -> None:
    assert galera_findings() == [
        (
            "ok",
            "Galera cluster 'payments' of 3 nodes, this node Synced in the Primary component, wsrep_sync_wait=3 for "
            "the ledger's session: every node certifies a completion before it is acknowledged, and the ledger's "
            "reads wait for the cluster's earlier commits",
        )
    ]


def test_galera_without_causal_reads_or_outside_the_primary_component_is_a_warning() -> None:
    ((severity, message),) = galera_findings(wsrep_sync_wait="0")
    assert severity == "warning" and message.startswith("Galera: wsrep_sync_wait is 0 for the ledger's session")
    assert [s for s, _ in galera_findings(wsrep_sync_wait="1")] == ["ok", "note"]
    ((severity, message),) = galera_findings(wsrep_cluster_status="non-Primary")
    assert severity == "warning" and "not in a Primary component (wsrep_cluster_status=non-Primary)" in message
    assert [s for s, _ in galera_findings(wsrep_local_state_comment="Donor/Desynced")] == ["warning"]


def test_galera_of_one_node_is_a_warning_and_of_two_a_note() -> None:
    assert [s for s, _ in galera_findings(wsrep_cluster_size="1")] == ["warning"]
    assert [s for s, _ in galera_findings(wsrep_cluster_size="2")] == ["ok", "note"]


def test_doctor_on_a_plain_mariadb_server_names_it_and_checks_its_replication(mysql_server: str) -> None:
    result = CliRunner().invoke(app, ["--db", mysql_server, "doctor", "--json"])
    doc = json.loads(result.stdout)
    assert doc["engine"].startswith("MariaDB 10.")
    assert doc["replication"]["wsrep_on"] == "OFF"
    expected = assess_mysql(MysqlFacts(doc["replication"]))
    assert doc["findings"] == [{"severity": f.severity.value, "message": f.message} for f in expected]
    assert result.exit_code == (0 if doc["ok"] else 1)
    text = CliRunner().invoke(app, ["--db", mysql_server, "doctor"]).stdout
    assert text.splitlines()[0] == f"{mysql_server} ({doc['engine']})"
    # Neither another engine's verdict nor a Galera cluster's on a plain server.
    assert "SQLite" not in text
    assert not any(line.split(": ", 1)[1].startswith("Galera") for line in text.splitlines()[1:])


@pytest.mark.slow
@pytest.mark.xdist_group("galera")  # on the worker that runs the cluster (tests/storage/test_galera.py)
def test_doctor_on_a_galera_node_checks_the_cluster_and_the_ledgers_causal_reads(
    galera_cluster, galera_database
) -> None:
    node = galera_cluster.nodes[2]
    with Ledger.open(node.url(galera_database)) as ledger:
        ledger.init()
    result = CliRunner().invoke(app, ["--db", node.url(galera_database), "doctor"])
    assert result.exit_code == 0, result.stdout
    first, finding, note = result.stdout.splitlines()
    assert first.startswith(f"{node.url(galera_database)} (MariaDB 10.")
    # The test cluster's nodes flush their redo log once a second (tests/galera.py).
    assert note.startswith("note: innodb_flush_log_at_trx_commit is 2: a completion survives as long as one node")
    assert finding == (
        "ok: Galera cluster 'idemctl_test' of 3 nodes, this node Synced in the Primary component, wsrep_sync_wait=3 "
        "for the ledger's session: every node certifies a completion before it is acknowledged, and the ledger's "
        "reads wait for the cluster's earlier commits"
    )
    forced = CliRunner().invoke(app, ["--db", node.url(galera_database, "wsrep_sync_wait=0"), "doctor", "--json"])
    doc = json.loads(forced.stdout)
    assert (forced.exit_code, doc["ok"], doc["replication"]["wsrep_cluster_size"]) == (1, False, "3")
    assert [f["severity"] for f in doc["findings"]] == ["warning", "note"]
    assert doc["findings"][0]["message"].startswith("Galera: wsrep_sync_wait is 0 for the ledger's session")
