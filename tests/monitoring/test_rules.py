"""The Prometheus rules shipped in the package: found where the package is
installed, accepted by promtool, every alert proved to fire and to stay
silent by promtool's unit tests, and every name they use real."""

from __future__ import annotations

import re
import subprocess
from importlib import resources

import pytest
import yaml

from idemctl import Outcome
from idemctl.monitoring import MonitoringFile, RunbookUrlError, path, rules_text, text
from tests.helpers import ROOT
from tests.monitoring.promql import (
    exported_names,
    outcome_values,
    recorded_names,
    rules_of,
    series_names,
    write_recording_rules,
)

UNIT_TESTS = ROOT / "tests" / "monitoring" / "rules_test.yml"
ALERTS = [
    "IdemctlFencedOut",
    "IdemctlAnswersNotStored",
    "IdemctlLedgerUnavailable",
    "IdemctlStaleReservationsPilingUp",
    "IdemctlSweepBehind",
    "IdemctlLeaseRenewalLate",
    "IdemctlDecisionMetricsAbsent",
    "IdemctlLedgerStatsAbsent",
    "IdemctlLedgerStatsStale",
]


def github_anchor(heading: str) -> str:
    """The anchor GitHub (and most Markdown renderers) gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_rules_and_the_dashboard_are_package_resources_equal_to_the_source_files():
    for which in MonitoringFile:
        resource = resources.files("idemctl.monitoring").joinpath(which.value)
        assert resource.is_file()
        source = ROOT / "idemctl" / "monitoring" / which.value
        assert text(which) == resource.read_text(encoding="utf-8") == source.read_text(encoding="utf-8")
        assert path(which).read_bytes() == source.read_bytes()


def test_promtool_accepts_every_shipped_rule(promtool):
    shipped = path(MonitoringFile.RULES)
    done = subprocess.run([promtool, "check", "rules", str(shipped)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (len(rules_of("record")), len(rules_of("alert"))) == (15, len(ALERTS))
    count = 15 + len(ALERTS)
    assert f"SUCCESS: {count} rules found" in done.stdout


def test_every_alert_fires_on_its_series_and_stays_silent_otherwise_in_promtool_unit_tests(promtool):
    done = subprocess.run(
        [promtool, "test", "rules", str(UNIT_TESTS)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["Unit", "Testing:", str(UNIT_TESTS), "SUCCESS"]
    # Every alert of the file has a test that expects it firing and one that expects silence.
    cases = [
        case for test in yaml.safe_load(UNIT_TESTS.read_text())["tests"] for case in test.get("alert_rule_test", [])
    ]
    firing = {case["alertname"] for case in cases if case["exp_alerts"]}
    silent = {case["alertname"] for case in cases if not case["exp_alerts"]}
    assert [rule["alert"] for rule in rules_of("alert")] == ALERTS
    assert firing == silent == set(ALERTS)


def test_the_unit_tests_fail_when_an_alert_no_longer_fires(promtool, tmp_path):
    # promtool really compares: a fenced-out alert that waits for six events fails its test.
    broken = text(MonitoringFile.RULES).replace(
        'idemctl_decisions_total{outcome="fenced_out"}[1h])) > 0',
        'idemctl_decisions_total{outcome="fenced_out"}[1h])) > 5',
    )
    assert broken != text(MonitoringFile.RULES)
    (tmp_path / "idemctl" / "monitoring").mkdir(parents=True)
    (tmp_path / "idemctl" / "monitoring" / "rules.yml").write_text(broken)
    (tmp_path / "tests" / "monitoring").mkdir(parents=True)
    (tmp_path / "tests" / "monitoring" / "rules_test.yml").write_text(UNIT_TESTS.read_text())
    done = subprocess.run(
        [promtool, "test", "rules", "tests/monitoring/rules_test.yml"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 1
    assert "alertname: IdemctlFencedOut, time: 32m" in done.stdout + done.stderr


def test_every_alert_links_a_section_of_the_runbook_that_exists():
    runbook = (ROOT / "docs" / "runbook.md").read_text(encoding="utf-8")
    anchors = {github_anchor(line.lstrip("#")) for line in runbook.splitlines() if line.startswith("## ")}
    for rule in rules_of("alert"):
        url = rule["annotations"]["runbook_url"]
        page, _, anchor = url.partition("#")
        assert page == "docs/runbook.md", rule["alert"]
        assert anchor in anchors, f"{rule['alert']}: no section #{anchor} in docs/runbook.md"
        assert rule["labels"]["severity"] in ("page", "warning")
        assert rule["annotations"]["summary"]


def test_the_runbook_anchor_of_a_heading_is_githubs():
    assert (
        github_anchor(" Requests get 503 (the ledger is unavailable)") == "requests-get-503-the-ledger-is-unavailable"
    )
    assert github_anchor("We failed over; did anything run twice?") == "we-failed-over-did-anything-run-twice"


def test_the_rules_read_only_series_idemctl_exports_and_name_only_real_outcomes():
    known = exported_names() | recorded_names()
    assert {"idemctl_decisions_total", "idemctl_ledger_seconds_bucket", "idemctl_lease_late_total"} <= known
    assert {"idemctl_ledger_rows", "idemctl_ledger_stats_timestamp_seconds"} <= known
    outcomes = {outcome.value for outcome in Outcome}
    used: set[str] = set()
    for rule in rules_of("record") + rules_of("alert"):
        names = series_names(rule["expr"])
        assert names, rule
        assert names <= known, f"{rule.get('record') or rule.get('alert')} reads {sorted(names - known)}"
        assert outcome_values(rule["expr"]) <= outcomes, rule["expr"]
        used |= outcome_values(rule["expr"])
    assert used == {"replayed", "in_progress", "taken_over", "fenced_out", "not_stored", "unavailable", "passthrough"}


def test_promtool_refuses_a_query_that_does_not_parse(promtool, tmp_path):
    # What the dashboard test relies on: `check rules` parses every expression.
    bad = write_recording_rules(tmp_path / "bad.yml", {"x:y": "sum(rate(idemctl_decisions_total[5m])"})
    done = subprocess.run([promtool, "check", "rules", str(bad)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "parse error" in done.stdout + done.stderr


def test_a_runbook_url_replaces_the_source_path_in_every_alert():
    rewritten = yaml.safe_load(rules_text(runbook_url="https://git.example/ops/runbook.md"))
    urls = [
        rule["annotations"]["runbook_url"]
        for group in rewritten["groups"]
        for rule in group["rules"]
        if "alert" in rule
    ]
    shipped = [rule["annotations"]["runbook_url"] for rule in rules_of("alert")]
    assert urls == [url.replace("docs/runbook.md", "https://git.example/ops/runbook.md") for url in shipped]
    assert len(urls) == len(ALERTS)


@pytest.mark.parametrize("url", ["", "https://wiki/run book", "https://wiki/page#x", 'https://wiki/"x"'])
def test_a_runbook_url_the_rules_cannot_carry_is_refused(url):
    with pytest.raises(RunbookUrlError, match="the runbook URL must be an address without spaces"):
        rules_text(runbook_url=url)
