"""End to end: a real Prometheus scrapes a real gunicorn (three workers,
prometheus_client's multi-process mode) running the WSGI middleware, with
the shipped rules loaded. A worker outlives its pending TTL, a retry takes
its reservation over, the late completion is fenced out: Prometheus's own
API then shows the decisions exactly as driven and IdemctlFencedOut firing."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import pytest
import requests

from idemctl import Outcome, State
from idemctl.monitoring import MonitoringFile, path
from tests.e2e.gunicorn_server import GunicornServer
from tests.monitoring.prometheus_server import PrometheusServer, prometheus_or_skip

pytestmark = pytest.mark.slow

T = TypeVar("T")
ACCOUNT_A = {"X-Api-Key": "demo-key-A", "Content-Type": "application/json"}
JOB = "orders"


def post_order(srv: GunicornServer, key: str, sku: str) -> requests.Response:
    body = json.dumps({"sku": sku, "qty": 1}, separators=(",", ":"))
    return requests.post(srv.url + "/orders", data=body, headers={**ACCOUNT_A, "Idempotency-Key": key}, timeout=30)


def eventually(
    what: str, probe: Callable[[], T], done: Callable[[T], bool], prom: PrometheusServer, timeout: float
) -> T:
    """Poll `probe` until `done` holds (a scrape and a rule evaluation happen every second)."""
    deadline = time.monotonic() + timeout
    while True:
        seen = probe()
        if done(seen):
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s; last seen: {seen}\n{prom.log()[-3000:]}")
        time.sleep(0.25)


def decisions(prom: PrometheusServer) -> dict[str, float]:
    found = prom.query(f'sum by (outcome) (idemctl_decisions_total{{job="{JOB}"}})')
    return {dict(labels)["outcome"]: value for labels, value in found.items()}


def firing(prom: PrometheusServer) -> list[tuple[str, dict[str, str]]]:
    return sorted((a["labels"]["alertname"], a["labels"]) for a in prom.alerts() if a["state"] == "firing")


def test_a_fenced_out_completion_is_scraped_exactly_and_fires_the_shipped_alert(tmp_path):
    binary = prometheus_or_skip()
    (tmp_path / "app").mkdir()
    (tmp_path / "prometheus").mkdir()
    srv = GunicornServer(tmp_path / "app", workers=3, pending_ttl_ms=2000, metrics=True)
    # The example's three workers each switch a fresh orders database to WAL
    # as they boot, and SQLite can refuse one of them at once ("database is
    # locked"): the database starts in WAL mode, so none has to.
    with contextlib.closing(sqlite3.connect(srv.orders_path)) as orders:
        orders.execute("PRAGMA journal_mode=wal")
    with srv:
        assert srv.port is not None
        with PrometheusServer(
            binary,
            tmp_path / "prometheus",
            targets={JOB: f"127.0.0.1:{srv.port}"},
            rule_files=[path(MonitoringFile.RULES)],
        ) as prom:
            # The shipped rules loaded, both groups, every rule healthy.
            groups = {g["name"]: g for g in prom.rule_groups()}
            assert sorted(groups) == ["idemctl-alerts", "idemctl-recording"]
            # Before any decision, every outcome is a series at 0: the
            # fenced-out counter's first increment is then an increase().
            eventually(
                "every outcome scraped at 0",
                lambda: decisions(prom),
                lambda seen: seen == {outcome.value: 0.0 for outcome in Outcome},
                prom,
                20,
            )

            for i in range(3):
                assert post_order(srv, f"scrape-{i}", f"sku-scrape-{i}").status_code == 201
            assert post_order(srv, "scrape-0", "sku-scrape-0").status_code == 201  # a replay

            key, sku = "scrape-stalled", "sku-scrape-stalled"
            srv.hold(key)
            late: dict[str, requests.Response] = {}
            first = threading.Thread(target=lambda: late.setdefault("response", post_order(srv, key, sku)))
            first.start()
            stalled_pid = srv.held_pid(key)
            assert post_order(srv, key, sku).status_code == 409  # in progress: the owner is fresh
            with srv.ledger() as ledger:
                view = ledger.operator.get("acct_A", key)
                assert view is not None and view.takeover_in_ms is not None
                time.sleep(view.takeover_in_ms / 1000 + 0.05)
                assert ledger.operator.get("acct_A", key).state is State.PENDING_STALE
            new_owner = post_order(srv, key, sku)
            assert new_owner.status_code == 201  # took the reservation over
            srv.release(key, stalled_pid)  # the first owner completes too late: fenced out
            first.join(30)
            assert late["response"].status_code == 201
            assert srv.count_orders(sku) == 2  # the mutation ran twice: what the alert is for

            driven = {"executed": 3.0, "replayed": 1.0, "in_progress": 1.0, "taken_over": 1.0, "fenced_out": 1.0}
            seen = eventually(
                "the decisions as driven",
                lambda: decisions(prom),
                lambda seen: {k: v for k, v in seen.items() if v} == driven,
                prom,
                20,
            )
            assert set(seen) == {outcome.value for outcome in Outcome}

            alerts = eventually("IdemctlFencedOut firing", lambda: firing(prom), lambda seen: bool(seen), prom, 20)
            assert alerts == [("IdemctlFencedOut", {"alertname": "IdemctlFencedOut", "job": JOB, "severity": "page"})]
            (alert,) = [a for a in prom.alerts() if a["state"] == "firing"]
            assert alert["annotations"]["runbook_url"] == "docs/runbook.md#fenced-out-events-appeared"
            assert (
                alert["annotations"]["summary"] == f"{JOB}: a completion was fenced out: a mutation may have run twice"
            )

            # The recording rules computed from the same scrapes (their group
            # is evaluated on its own tick: it may lag the alert's by one).
            rates = eventually(
                "the recorded rates of the decisions as driven",
                lambda: prom.query("idemctl:decisions:rate5m"),
                lambda rates: {dict(labels)["outcome"] for labels, value in rates.items() if value > 0} == set(driven),
                prom,
                10,
            )
            assert all(dict(labels)["job"] == JOB for labels in rates)
            (fenced_rate,) = prom.query("idemctl:fenced_out:rate5m").items()
            assert fenced_rate[0] == (("__name__", "idemctl:fenced_out:rate5m"), ("job", JOB)) and fenced_rate[1] > 0
            # The 503 share is 0, not absent: every outcome's series exists.
            unavailable = prom.query("idemctl:unavailable:ratio_rate5m")
            assert unavailable == {(("__name__", "idemctl:unavailable:ratio_rate5m"), ("job", JOB)): 0.0}
