"""Prometheus metrics of the ledger's decisions (the `prometheus` extra).

`instrument(ledger)` subscribes to the ledger's events and keeps:

- ``idemctl_decisions_total{outcome}``: a counter per decision (executed,
  replayed, in_progress, reused, taken_over, fenced_out, ...), so replays
  are told apart from fresh runs;
- ``idemctl_ledger_seconds{outcome}``: time spent in the ledger's own
  statements per request;
- ``idemctl_app_seconds{outcome}``: time the mutation took, for requests
  that ran it;

and, for a ledger with ``Policy(lease_renewal=True)``, its lease renewals
(leases.py):

- ``idemctl_lease_renewal_seconds``: how long each renewal took;
- ``idemctl_lease_lapse_seconds``: how long reservations had gone without a
  renewal when each one landed (a third of the TTL plus the renewal's time
  when healthy; at the TTL a retry may take a live owner over): alert on
  its high quantiles against the TTL;
- ``idemctl_lease_late_total{stage}``: renewals that came late (more than
  half the TTL without one), ``stage="done"`` counted when one lands,
  ``stage="running"`` when the watchdog sees one overdue while it runs
  (or after one failed);
- ``idemctl_lease_failures_total``: renewals that failed (the next one
  tries again);
- ``idemctl_leases_held``: reservations the process renews (live sum
  across workers in multi-process mode).

Under gunicorn (pre-forked workers) use prometheus_client's multi-process
mode: set ``PROMETHEUS_MULTIPROC_DIR`` to an empty directory before the
workers start, expose the metrics with `multiprocess_registry()`, and mark
dead workers in the gunicorn config (docs/observability.md).

>>> from prometheus_client import CollectorRegistry, generate_latest
>>> from idemctl import Ledger
>>> ledger = Ledger.open(":memory:"); _ = ledger.init()
>>> registry = CollectorRegistry()
>>> metrics = instrument(ledger, registry=registry)
>>> _ = ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b""))
>>> _ = ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b""))
>>> [line for line in generate_latest(registry).decode().splitlines() if line.startswith("idemctl_decisions_total")]
['idemctl_decisions_total{outcome="executed"} 1.0', 'idemctl_decisions_total{outcome="replayed"} 1.0']
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import multiprocess as _multiprocess

from .leases import LeaseKeeper, LeaseTick
from .ledger import Ledger
from .outcomes import Event

# Ledger statements take tenths of a millisecond to tens of milliseconds;
# mutations, milliseconds to seconds.
LEDGER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
APP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Lapses run from a third of the TTL (seconds, usually) up to and past it.
LAPSE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class LeaseMetrics:
    """The lease renewal metrics, fed by `observe(tick)`."""

    unsubscribe: Callable[[], None] | None = None

    def __init__(self, *, registry: CollectorRegistry = REGISTRY, namespace: str = "idemctl") -> None:
        self.renewal_seconds = Histogram(
            "lease_renewal_seconds",
            "Time each lease renewal took",
            namespace=namespace,
            registry=registry,
            buckets=LEDGER_BUCKETS,
        )
        self.lapse_seconds = Histogram(
            "lease_lapse_seconds",
            "How long reservations had gone without renewal when a renewal landed",
            namespace=namespace,
            registry=registry,
            buckets=LAPSE_BUCKETS,
        )
        self.late = Counter(
            "lease_late", "Lease renewals that came late (over half the TTL)", ["stage"], namespace=namespace,
            registry=registry,
        )
        self.failures = Counter("lease_failures", "Lease renewals that failed", namespace=namespace, registry=registry)
        self.held = Gauge(
            "leases_held",
            "Reservations this process renews",
            namespace=namespace,
            registry=registry,
            multiprocess_mode="livesum",
        )

    def observe(self, tick: LeaseTick) -> None:
        if tick.late:
            self.late.labels("done" if tick.done else "running").inc()
        if not tick.done:
            return
        self.held.set(tick.reservations)
        if tick.error is not None:
            self.failures.inc()
            return
        self.renewal_seconds.observe(tick.seconds)
        self.lapse_seconds.observe(tick.lapse_ms / 1000)


class Metrics:
    """The three metrics, fed by `observe(event)`."""

    unsubscribe: Callable[[], None] | None = None
    leases: LeaseMetrics | None = None  # set by `instrument` for a ledger that renews leases

    def __init__(self, *, registry: CollectorRegistry = REGISTRY, namespace: str = "idemctl") -> None:
        self.decisions = Counter(
            "decisions", "Idempotency decisions by outcome", ["outcome"], namespace=namespace, registry=registry
        )
        self.ledger_seconds = Histogram(
            "ledger_seconds",
            "Time spent in the ledger's statements per request",
            ["outcome"],
            namespace=namespace,
            registry=registry,
            buckets=LEDGER_BUCKETS,
        )
        self.app_seconds = Histogram(
            "app_seconds",
            "Time the mutation took, for requests that ran it",
            ["outcome"],
            namespace=namespace,
            registry=registry,
            buckets=APP_BUCKETS,
        )

    def observe(self, event: Event) -> None:
        outcome = event.outcome.value
        self.decisions.labels(outcome).inc()
        self.ledger_seconds.labels(outcome).observe(event.ledger_ms / 1000)
        if event.app_ms is not None:
            self.app_seconds.labels(outcome).observe(event.app_ms / 1000)


def instrument(
    ledger: Ledger, *, registry: CollectorRegistry = REGISTRY, namespace: str = "idemctl"
) -> Metrics:
    """Count `ledger`'s decisions into `registry` (the default registry
    unless given), and its lease renewals when it renews leases
    (`Metrics.leases`)."""
    metrics = Metrics(registry=registry, namespace=namespace)
    metrics.unsubscribe = ledger.subscribe(metrics.observe)
    if ledger.leases is not None:
        metrics.leases = instrument_leases(ledger.leases, registry=registry, namespace=namespace)
    return metrics


def instrument_leases(
    keeper: LeaseKeeper, *, registry: CollectorRegistry = REGISTRY, namespace: str = "idemctl"
) -> LeaseMetrics:
    """The lease renewal metrics of one `LeaseKeeper` (`ledger.leases`)."""
    leases = LeaseMetrics(registry=registry, namespace=namespace)
    leases.unsubscribe = keeper.subscribe(leases.observe)
    return leases


def multiprocess_registry() -> CollectorRegistry:
    """A registry that collects every worker's values (PROMETHEUS_MULTIPROC_DIR
    must be set): serve `generate_latest(multiprocess_registry())` on /metrics."""
    registry = CollectorRegistry()
    _multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    return registry


def mark_process_dead(pid: int) -> None:
    """For gunicorn's `child_exit` hook: drop a dead worker's live gauges."""
    _multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]


__all__ = ["LeaseMetrics", "Metrics", "instrument", "instrument_leases", "mark_process_dead", "multiprocess_registry"]
