"""Prometheus metrics of the ledger's decisions: in process, and scraped from
a real gunicorn whose workers share prometheus_client's multi-process mode."""

from __future__ import annotations

import json
import re

import pytest
import requests
from prometheus_client import CollectorRegistry, Counter, generate_latest

from idemctl import Outcome
from idemctl.leases import LeaseTick
from idemctl.prometheus import LeaseMetrics, MetricsRegistryError, instrument
from tests.e2e.gunicorn_server import GunicornServer


def ok(body: bytes):
    return 201, {}, b"made"


def every_sample(text: str, name: str) -> dict[str, float]:
    """{outcome: value} of one metric family in Prometheus text format."""
    out = {}
    for m in re.finditer(rf'^{name}{{outcome="([a-z_]+)"}} (\S+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def samples(text: str, name: str) -> dict[str, float]:
    """The outcomes counted at least once (every outcome's series is there from the start, at 0)."""
    return {outcome: value for outcome, value in every_sample(text, name).items() if value}


def test_every_outcome_is_a_series_at_zero_before_the_first_decision(ledger):
    registry = CollectorRegistry()
    instrument(ledger, registry=registry)
    text = generate_latest(registry).decode()
    assert every_sample(text, "idemctl_decisions_total") == {outcome.value: 0.0 for outcome in Outcome}
    # The histograms stay per outcome seen: 14 buckets each for 17 outcomes would be noise.
    assert every_sample(text, "idemctl_ledger_seconds_count") == {}


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


def test_instrumenting_the_same_ledger_twice_returns_the_same_metrics_and_counts_once(ledger):
    registry = CollectorRegistry()
    first = instrument(ledger, registry=registry)
    again = instrument(ledger, registry=registry)
    assert again is first
    ledger.handle("acct", "k1", "POST", "/o", {}, b"x", ok)
    assert samples(generate_latest(registry).decode(), "idemctl_decisions_total") == {"executed": 1.0}
    # Once unsubscribed, instrumenting again subscribes afresh (and still counts once).
    first.unsubscribe()
    third = instrument(ledger, registry=registry)
    assert third is not first
    ledger.handle("acct", "k2", "POST", "/o", {}, b"x", ok)
    assert samples(generate_latest(registry).decode(), "idemctl_decisions_total") == {"executed": 2.0}


def test_two_ledgers_on_one_registry_share_its_metrics_or_keep_apart_by_namespace(make_ledger):
    orders, refunds, payouts = make_ledger(), make_ledger(), make_ledger()
    registry = CollectorRegistry()
    instrument(orders, registry=registry)
    instrument(refunds, registry=registry)
    instrument(payouts, registry=registry, namespace="payouts")
    # make_ledger opens them on one database: keys of their own.
    orders.handle("acct", "o1", "POST", "/o", {}, b"x", ok)
    refunds.handle("acct", "r1", "POST", "/r", {}, b"x", ok)
    refunds.handle("acct", "r1", "POST", "/r", {}, b"x", ok)
    payouts.handle("acct", "p1", "POST", "/p", {}, b"x", ok)
    text = generate_latest(registry).decode()
    assert samples(text, "idemctl_decisions_total") == {"executed": 2.0, "replayed": 1.0}
    assert samples(text, "payouts_decisions_total") == {"executed": 1.0}


def test_a_registry_holding_a_foreign_metric_of_the_same_name_is_a_clear_error(ledger):
    registry = CollectorRegistry()
    Counter("idemctl_decisions", "someone else's", registry=registry)
    with pytest.raises(MetricsRegistryError, match="pass instrument\\(\\) another namespace"):
        instrument(ledger, registry=registry)


def test_leases_held_is_the_sum_over_every_keeper_on_one_registry():
    registry = CollectorRegistry()
    a, b = LeaseMetrics(registry=registry), LeaseMetrics(registry=registry)
    a.observe(LeaseTick(reservations=3, renewed=3, seconds=0.001, lapse_ms=10.0, ttl_ms=30_000))
    b.observe(LeaseTick(reservations=2, renewed=2, seconds=0.001, lapse_ms=10.0, ttl_ms=30_000))
    a.observe(LeaseTick(reservations=1, renewed=1, seconds=0.001, lapse_ms=10.0, ttl_ms=30_000))
    assert registry.get_sample_value("idemctl_leases_held") == 3.0
    assert registry.get_sample_value("idemctl_lease_renewal_seconds_count") == 3.0


@pytest.mark.slow
def test_gunicorn_workers_report_every_decision_through_any_one_of_them(tmp_path):
    order = json.dumps({"sku": "metrics", "qty": 1}).encode()
    headers = {"X-Api-Key": "demo-key-A", "Content-Type": "application/json"}
    with GunicornServer(tmp_path, workers=3, metrics=True) as srv:
        for i in range(12):
            first = requests.post(
                srv.url + "/orders", data=order, headers={**headers, "Idempotency-Key": f"m-{i}"}, timeout=10
            )
            again = requests.post(
                srv.url + "/orders", data=order, headers={**headers, "Idempotency-Key": f"m-{i}"}, timeout=10
            )
            assert (first.status_code, again.status_code) == (201, 201)
        reused = requests.post(
            srv.url + "/orders", data=b'{"sku":"x"}', headers={**headers, "Idempotency-Key": "m-0"}, timeout=10
        )
        assert reused.status_code == 409
        # Whichever worker answers the scrape, it reports all workers' counts.
        scrapes = [requests.get(srv.url + "/metrics", timeout=10).text for _ in range(6)]
    for text in scrapes:
        assert samples(text, "idemctl_decisions_total") == {"executed": 12.0, "replayed": 12.0, "reused": 1.0}
        assert set(every_sample(text, "idemctl_decisions_total")) == {outcome.value for outcome in Outcome}
        assert samples(text, "idemctl_app_seconds_count") == {"executed": 12.0}
