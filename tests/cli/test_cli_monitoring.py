"""`idemctl monitoring`: the shipped rules and dashboard, printed as they are
in the package, or where they are."""

from __future__ import annotations

import shlex

from typer.testing import CliRunner

from idemctl.cli import app
from tests.helpers import ROOT

RULES = (ROOT / "idemctl" / "monitoring" / "rules.yml").read_text(encoding="utf-8")
DASHBOARD = (ROOT / "idemctl" / "monitoring" / "dashboard.json").read_text(encoding="utf-8")


def cli(*args: str):
    result = CliRunner().invoke(app, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def test_rules_and_dashboard_print_the_shipped_files_byte_for_byte():
    rules = cli("monitoring", "rules")
    assert (rules.exit_code, rules.stdout, rules.stderr) == (0, RULES, "")
    dashboard = cli("monitoring", "dashboard")
    assert (dashboard.exit_code, dashboard.stdout, dashboard.stderr) == (0, DASHBOARD, "")


def test_where_prints_where_the_installed_file_is():
    for what, name in (("rules", "rules.yml"), ("dashboard", "dashboard.json")):
        shown = cli("monitoring", what, "--where")
        assert (shown.exit_code, shown.stderr) == (0, "")
        assert shown.stdout == f"{ROOT / 'idemctl' / 'monitoring' / name}\n"


def test_a_runbook_url_points_every_alert_at_the_teams_copy_of_the_runbook():
    shown = cli("monitoring", "rules", "--runbook-url", "https://git.example/ops/runbook.md")
    assert shown.exit_code == 0
    assert shown.stdout == RULES.replace(
        "runbook_url: docs/runbook.md#", "runbook_url: https://git.example/ops/runbook.md#"
    )
    assert shown.stdout.count("runbook_url: https://git.example/ops/runbook.md#") == 9


def test_what_it_cannot_print_is_one_line_on_stderr_and_exit_2():
    for args, error in (
        (["monitoring", "alerts"], "error: WHAT must be rules or dashboard, got 'alerts'\n"),
        (
            ["monitoring", "dashboard", "--runbook-url", "https://x"],
            "error: --runbook-url only applies to `idemctl monitoring rules`\n",
        ),
        (
            ["monitoring", "rules", "--where", "--runbook-url", "https://x"],
            "error: --where prints where the shipped file is; --runbook-url changes the printed text: give one\n",
        ),
        (
            ["monitoring", "rules", "--runbook-url", "https://wiki/run book"],
            "error: the runbook URL must be an address without spaces, quotes or '#' (the rules add the section), "
            "got 'https://wiki/run book'\n",
        ),
    ):
        result = cli(*args)
        assert (result.exit_code, result.stdout, result.stderr) == (2, "", error)


def documented_stats_job() -> list[str]:
    """The stats cron line of docs/observability.md, as words, without `|| page-oncall`."""
    page = (ROOT / "docs" / "observability.md").read_text(encoding="utf-8")
    block = page.split("  # cron, every minute", 1)[1].split("```", 1)[0]
    command = block.split("\n", 1)[1].replace("\\\n", " ").split("||", 1)[0]
    return shlex.split(command)


def test_the_documented_stats_job_exports_the_ttl_and_retention_the_app_uses(tmp_path):
    words = documented_stats_job()
    assert words[:3] == ["idemctl", "--db", "/var/lib/app/idempotency.db"]
    assert (words[words.index("--ttl") + 1], words[words.index("--retention") + 1]) == ("30s", "24h")
    # Run as documented against an app whose Policy has a 3 s TTL and 1 h retention.
    ledger = tmp_path / "idempotency.db"
    output = tmp_path / "idemctl.prom"
    words[2] = str(ledger)
    words[words.index("--output") + 1] = str(output)
    words[words.index("--ttl") + 1] = "3s"
    words[words.index("--retention") + 1] = "1h"
    assert cli("--db", str(ledger), "init").exit_code == 0
    ran = cli(*words[1:])
    assert (ran.exit_code, ran.stdout, ran.stderr) == (0, "", "")
    exported = output.read_text(encoding="utf-8").splitlines()
    assert f'idemctl_ledger_pending_ttl_seconds{{ledger="{ledger}"}} 3' in exported
    assert f'idemctl_ledger_retention_seconds{{ledger="{ledger}"}} 3600' in exported
