"""Prometheus metrics of the ledger's decisions: in process, and scraped from
a real gunicorn whose workers share prometheus_client's multi-process mode."""

from __future__ import annotations

import json
import re

import pytest
import requests
from prometheus_client import CollectorRegistry, generate_latest

from idemctl import Outcome
from idemctl.prometheus import instrument
from tests.e2e.gunicorn_server import GunicornServer


def ok(body: bytes):
    return 201, {}, b"made"


def samples(text: str, name: str) -> dict[str, float]:
    """{outcome: value} of one metric family in Prometheus text format."""
    out = {}
    for m in re.finditer(rf'^{name}{{outcome="([a-z_]+)"}} (\S+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def test_counters_and_histograms_follow_the_decisions(ledger, clock):
    registry = CollectorRegistry()
    metrics = instrument(ledger, registry=registry)
    for i in range(3):
        ledger.handle("acct", f"k{i}", "POST", "/o", {}, b"x", ok)
    ledger.handle("acct", "k0", "POST", "/o", {}, b"x", ok)
    ledger.handle("acct", "k0", "POST", "/o", {}, b"other", ok)
    text = generate_latest(registry).decode()
    assert samples(text, "idemctl_decisions_total") == {"executed": 3.0, "replayed": 1.0, "reused": 1.0}
    assert samples(text, "idemctl_app_seconds_count") == {"executed": 3.0}
    assert samples(text, "idemctl_ledger_seconds_count") == {"executed": 3.0, "replayed": 1.0, "reused": 1.0}
    assert metrics.unsubscribe is not None
    metrics.unsubscribe()
    ledger.handle("acct", "k9", "POST", "/o", {}, b"x", ok)
    assert samples(generate_latest(registry).decode(), "idemctl_decisions_total")["executed"] == 3.0
    assert Outcome.EXECUTED.value == "executed"


@pytest.mark.slow
def test_gunicorn_workers_report_every_decision_through_any_one_of_them(tmp_path):
    order = json.dumps({"sku": "metrics", "qty": 1}).encode()
    headers = {"X-Api-Key": "demo-key-A", "Content-Type": "application/json"}
    with GunicornServer(tmp_path, workers=3, metrics=True) as srv:
        for i in range(12):
            first = requests.post(srv.url + "/orders", data=order, headers={**headers, "Idempotency-Key": f"m-{i}"}, timeout=10)
            again = requests.post(srv.url + "/orders", data=order, headers={**headers, "Idempotency-Key": f"m-{i}"}, timeout=10)
            assert (first.status_code, again.status_code) == (201, 201)
        reused = requests.post(srv.url + "/orders", data=b'{"sku":"x"}', headers={**headers, "Idempotency-Key": "m-0"}, timeout=10)
        assert reused.status_code == 409
        # Whichever worker answers the scrape, it reports all workers' counts.
        scrapes = [requests.get(srv.url + "/metrics", timeout=10).text for _ in range(6)]
    for text in scrapes:
        assert samples(text, "idemctl_decisions_total") == {"executed": 12.0, "replayed": 12.0, "reused": 1.0}
        assert samples(text, "idemctl_app_seconds_count") == {"executed": 12.0}
