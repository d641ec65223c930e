"""`idemctl doctor` on the MariaDB/MySQL test server: the engine reads its
facts through the ledger's own session, and they judge themselves."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from idemctl.cli import app
from idemctl.operations.replication_mysql import MysqlFacts


def test_doctor_on_the_mysql_test_server_reads_and_assesses_its_facts(mysql_server: str) -> None:
    # Nothing of the ledger is read: the server's own settings are.
    result = CliRunner().invoke(app, ["--db", mysql_server, "doctor", "--json"])
    doc = json.loads(result.stdout)
    facts = MysqlFacts(doc["replication"])
    assert doc["engine"] == facts.product and doc["engine"].split()[0] in ("MariaDB", "MySQL")
    assert {"version", "log_bin", "innodb_flush_log_at_trx_commit"} <= set(doc["replication"])
    assert doc["findings"] == [{"severity": f.severity.value, "message": f.message} for f in facts.assess()]
    assert result.exit_code == (0 if doc["ok"] else 1)
    text = CliRunner().invoke(app, ["--db", mysql_server, "doctor"])
    first, *findings = text.stdout.splitlines()
    assert first.endswith(f" ({facts.product})") and "SQLite" not in text.stdout
    assert findings == [f"{f.severity.value}: {f.message}" for f in facts.assess()]
