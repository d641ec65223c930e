"""The Grafana dashboard shipped in the package, checked without Grafana: a
dashboard of the current JSON model, every panel placed and bound to the
datasource variable, every query parsed by promtool and reading only series
idemctl exports or its recording rules define."""

from __future__ import annotations

import json
import re
import subprocess

from idemctl import Outcome
from idemctl.monitoring import MonitoringFile, text
from tests.monitoring.promql import (
    exported_names,
    outcome_values,
    recorded_names,
    series_names,
    write_recording_rules,
)

DASHBOARD = json.loads(text(MonitoringFile.DASHBOARD))
PANELS = DASHBOARD["panels"]
GRAPHS = [panel for panel in PANELS if panel["type"] != "row"]
VARIABLES = {variable["name"]: variable for variable in DASHBOARD["templating"]["list"]}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# What Grafana puts in place of each variable before Prometheus sees a query.
SUBSTITUTIONS = {"$__rate_interval": "5m", "$job": ".*", "$instance": ".*", "$ledger": ".*"}


def queries() -> dict[str, str]:
    """{a recording rule name for the query: the query as Prometheus receives it}."""
    out = {}
    for panel in GRAPHS:
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in SUBSTITUTIONS.items():
                expr = expr.replace(variable, value)
            out[f"dashboard:panel_{panel['id']}_{target['refId']}"] = expr
    return out


def test_the_dashboard_is_of_grafanas_current_json_model():
    assert DASHBOARD["schemaVersion"] == 41  # Grafana 12's classic model; Grafana migrates older ones on import
    for key in ("uid", "title", "panels", "templating", "time", "annotations", "editable", "refresh", "version"):
        assert key in DASHBOARD, key
    assert (DASHBOARD["uid"], DASHBOARD["title"]) == ("idemctl", "idemctl")
    assert "id" not in DASHBOARD  # Grafana assigns it on import
    assert DASHBOARD["time"] == {"from": "now-6h", "to": "now"}


def test_every_panel_has_a_unique_id_and_a_place_on_the_grid_without_overlap():
    ids = [panel["id"] for panel in PANELS]
    assert len(ids) == len(set(ids)) == 13
    cells: dict[tuple[int, int], int] = {}
    for panel in PANELS:
        grid = panel["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"}, panel["title"]
        assert all(isinstance(v, int) and v >= 0 for v in grid.values()), panel["title"]
        assert grid["w"] >= 1 and grid["h"] >= 1 and grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps panel {cells[(x, y)]}"
                cells[(x, y)] = panel["id"]


def test_every_panel_and_query_reads_the_datasource_variable():
    assert VARIABLES["datasource"]["type"] == "datasource"
    assert VARIABLES["datasource"]["query"] == "prometheus"
    for panel in GRAPHS:
        assert panel["type"] == "timeseries"
        assert panel["title"] and panel["description"]
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs))
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
    for name in ("job", "instance", "ledger"):
        assert VARIABLES[name]["datasource"] == DATASOURCE
        assert VARIABLES[name]["type"] == "query"


def test_every_variable_a_query_uses_is_defined_and_every_one_defined_is_used():
    used = set()
    for panel in GRAPHS:
        for target in panel["targets"]:
            used |= set(re.findall(r"\$(\w+)", target["expr"]))
    assert used == {"__rate_interval", "job", "instance", "ledger"}
    assert set(VARIABLES) == {"datasource", "job", "instance", "ledger"}
    assert set(SUBSTITUTIONS) == {f"${name}" for name in used}


def test_promtool_parses_every_query_of_the_dashboard_and_its_variables(promtool, tmp_path):
    exprs = queries()
    assert len(exprs) == 19
    for name in ("job", "instance", "ledger"):  # label_values(METRIC{…}, label): the metric selector must parse
        found = re.fullmatch(r"label_values\((.+), (\w+)\)", VARIABLES[name]["query"]["query"])
        assert found and found.group(2) == name
        exprs[f"dashboard:variable_{name}"] = found.group(1).replace("$job", ".*")
    rules = write_recording_rules(tmp_path / "dashboard_queries.yml", exprs)
    done = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in done.stdout


def test_every_query_reads_only_series_idemctl_exports_or_records_and_real_outcomes():
    known = exported_names() | recorded_names()
    outcomes = {outcome.value for outcome in Outcome}
    read: set[str] = set()
    for name, expr in queries().items():
        names = series_names(expr)
        assert names, name
        assert names <= known, f"{name} reads {sorted(names - known)}: {expr}"
        assert outcome_values(expr) <= outcomes, expr
        read |= names
    # The panels the dashboard promises: decisions, ledger latency, backlog and oldest pending, fenced-out.
    assert {
        "idemctl_decisions_total",
        "idemctl_ledger_seconds_bucket",
        "idemctl:ledger_expired_rows:max",
        "idemctl:ledger_oldest_pending_age_seconds:max",
        "idemctl_ledger_fenced_out_events",
    } <= read
