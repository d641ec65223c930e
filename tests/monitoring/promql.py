"""What the monitoring tests know about PromQL and about the series idemctl
exports: the names an expression reads, and every name it may read."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from idemctl import Ledger
from idemctl.cli.documents import stats_prometheus
from idemctl.monitoring import MonitoringFile, text
from idemctl.prometheus import LeaseMetrics, instrument

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
# A name that is not a function's (no parenthesis after it) and not part of a number.
_NAME = re.compile(r"(?<![\w:.])([A-Za-z_:][\w:]*)(?![\w:]|\s*\()")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "by", "without", "on", "ignoring"}
_OUTCOME = re.compile(r'outcome\s*(=~|!~|!=|=)\s*"([^"]*)"')


def series_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads.

    >>> sorted(series_names('sum by (le) (rate(a_bucket{job=~"$job"}[5m])) / b:c:rate5m offset 1h > 0.99'))
    ['a_bucket', 'b:c:rate5m']
    """
    bare = _GROUPING.sub("", _RANGE.sub("", _MATCHERS.sub("", _STRING.sub('""', expr))))
    return {name for name in _NAME.findall(bare) if name.lower() not in _KEYWORDS}


def outcome_values(expr: str) -> set[str]:
    """Every outcome an expression's matchers name (alternatives of a regex too).

    >>> sorted(outcome_values('x{outcome=~"fenced_out|not_stored"} / x{outcome!="passthrough"}'))
    ['fenced_out', 'not_stored', 'passthrough']
    """
    return {value for _, pattern in _OUTCOME.findall(expr) for value in pattern.split("|")}


def exported_names() -> set[str]:
    """Every series name `instrument()` (with lease renewal) registers and
    `idemctl stats --format prometheus` writes."""
    registry = CollectorRegistry()
    instrument(Ledger.open(":memory:"), registry=registry)
    LeaseMetrics(registry=registry)
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}
    names = set()
    for family in registry.collect():
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    ledger = Ledger.open(":memory:")
    ledger.init()
    textfile = stats_prometheus("l.db", replace(ledger.operator.stats(), storage_bytes=1), ledger.policy)
    names.update(line.split()[2] for line in textfile.splitlines() if line.startswith("# TYPE "))
    return names


def shipped_rules() -> dict:
    return yaml.safe_load(text(MonitoringFile.RULES))


def rules_of(kind: str) -> list[dict]:
    """Every rule of the shipped file with a `record` or an `alert` key."""
    return [rule for group in shipped_rules()["groups"] for rule in group["rules"] if kind in rule]


def recorded_names() -> set[str]:
    return {rule["record"] for rule in rules_of("record")}


def write_recording_rules(path: Path, exprs: dict[str, str]) -> Path:
    """A rule file recording each expression, for `promtool check rules` to parse."""
    rules = [{"record": name, "expr": expr} for name, expr in exprs.items()]
    path.write_text(yaml.safe_dump({"groups": [{"name": "parse", "rules": rules}]}), encoding="utf-8")
    return path
