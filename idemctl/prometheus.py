"""Prometheus metrics of the ledger's decisions (the `prometheus` extra).

`instrument(ledger)` subscribes to the ledger's events and keeps:

- ``idemctl_decisions_total{outcome}``: a counter per decision (executed,
  replayed, in_progress, reused, taken_over, fenced_out, ...), so replays
  are told apart from fresh runs; every outcome's series exists from the
  start at 0, so that ``increase()`` and ``rate()`` see the first one;
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
>>> lines = generate_latest(registry).decode().splitlines()
>>> decisions = [line for line in lines if line.startswith("idemctl_decisions_total")]
>>> [line for line in decisions if not line.endswith(" 0.0")]
['idemctl_decisions_total{outcome="executed"} 1.0', 'idemctl_decisions_total{outcome="replayed"} 1.0']
>>> 'idemctl_decisions_total{outcome="fenced_out"} 0.0' in decisions
True
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar, cast

from .errors import IdemctlError, missing_extra

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
    from prometheus_client import multiprocess as _multiprocess
except ImportError as exc:  # the client lives behind an extra, as the engines' drivers do
    raise missing_extra("idemctl.prometheus needs the Prometheus client", "prometheus", exc) from exc

from .leases import HeldShare, LeaseKeeper, LeaseTick
from .ledger import Ledger
from .outcomes import Event, Outcome

# Ledger statements take tenths of a millisecond to tens of milliseconds;
# mutations, milliseconds to seconds.
LEDGER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
APP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Lapses run from a third of the TTL (seconds, usually) up to and past it.
LAPSE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class MetricsRegistryError(IdemctlError, ValueError):
    """The registry already holds a metric of one of idemctl's names that
    idemctl did not register there (another library's, or one made by hand):
    pass another `namespace`, or another registry.

    >>> from idemctl import Ledger
    >>> registry = CollectorRegistry()
    >>> _ = Counter("idemctl_decisions", "made by hand", registry=registry)
    >>> instrument(Ledger.open(":memory:"), registry=registry)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    idemctl.prometheus.MetricsRegistryError: the registry already holds idemctl_* metrics ... another registry
    """


class _DecisionCollectors:
    """The decision metrics of one (registry, namespace), shared by every
    ledger counted into them."""

    def __init__(self, registry: CollectorRegistry, namespace: str) -> None:
        self.decisions = Counter(
            "decisions", "Idempotency decisions by outcome", ["outcome"], namespace=namespace, registry=registry
        )
        # Every outcome from the start, at 0: a counter whose series appears
        # with its first increment at 1 shows no increase() to an alert rule
        # (the first fenced-out decision would page nobody).
        for outcome in Outcome:
            self.decisions.labels(outcome.value)
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


class _LeaseCollectors:
    """The lease renewal metrics of one (registry, namespace), shared by
    every lease keeper counted into them."""

    def __init__(self, registry: CollectorRegistry, namespace: str) -> None:
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
            "lease_late",
            "Lease renewals that came late (over half the TTL)",
            ["stage"],
            namespace=namespace,
            registry=registry,
        )
        for stage in ("done", "running"):  # at 0 from the start, as the decisions are
            self.late.labels(stage)
        self.failures = Counter("lease_failures", "Lease renewals that failed", namespace=namespace, registry=registry)
        self.held = Gauge(
            "leases_held",
            "Reservations this process renews",
            namespace=namespace,
            registry=registry,
            multiprocess_mode="livesum",
        )


C = TypeVar("C", _DecisionCollectors, _LeaseCollectors)
# A registry accepts each metric name once: the collectors made for it, by
# namespace, so that a second `instrument` shares them instead of failing.
_COLLECTORS: weakref.WeakKeyDictionary[CollectorRegistry, dict[tuple[type[Any], str], Any]] = (
    weakref.WeakKeyDictionary()
)
# What `instrument` returned for a ledger, by registry and namespace: asked
# again, it returns the same. Held weakly (the ledger's own subscription keeps
# it alive), so that nothing here keeps a ledger alive.
_INSTRUMENTED: weakref.WeakKeyDictionary[Ledger, dict[tuple[CollectorRegistry, str], weakref.ref[Metrics]]] = (
    weakref.WeakKeyDictionary()
)
_LOCK = threading.RLock()  # instrument() makes its Metrics (and their collectors) holding it


def _collectors(kind: type[C], registry: CollectorRegistry, namespace: str) -> C:
    with _LOCK:
        made = _COLLECTORS.setdefault(registry, {})
        found = made.get((kind, namespace))
        if found is None:
            try:
                found = kind(registry, namespace)
            except ValueError as exc:  # prometheus_client's "Duplicated timeseries in CollectorRegistry"
                raise MetricsRegistryError(
                    f"the registry already holds {namespace}_* metrics that idemctl did not register there ({exc}); "
                    "pass instrument() another namespace or another registry"
                ) from exc
            made[(kind, namespace)] = found
        return cast(C, found)


class LeaseMetrics:
    """The lease renewal metrics, fed by `observe(tick)`: one per lease
    keeper, over the collectors every keeper on the same registry and
    namespace shares (``leases_held`` is their sum)."""

    unsubscribe: Callable[[], None] | None = None

    def __init__(self, *, registry: CollectorRegistry = REGISTRY, namespace: str = "idemctl") -> None:
        shared = _collectors(_LeaseCollectors, registry, namespace)
        self.renewal_seconds = shared.renewal_seconds
        self.lapse_seconds = shared.lapse_seconds
        self.late = shared.late
        self.failures = shared.failures
        self.held = shared.held
        self._held = HeldShare()  # this keeper's share of the shared gauge

    def observe(self, tick: LeaseTick) -> None:
        if tick.late:
            self.late.labels("done" if tick.done else "running").inc()
        if not tick.done:
            return
        if moved := self._held.moved(tick):
            self.held.inc(moved)
        if tick.error is not None:
            self.failures.inc()
            return
        self.renewal_seconds.observe(tick.seconds)
        self.lapse_seconds.observe(tick.lapse_ms / 1000)


class Metrics:
    """The three metrics, fed by `observe(event)`: one per ledger, over the
    collectors every ledger on the same registry and namespace shares."""

    unsubscribe: Callable[[], None] | None = None
    leases: LeaseMetrics | None = None  # set by `instrument` for a ledger that renews leases

    def __init__(self, *, registry: CollectorRegistry = REGISTRY, namespace: str = "idemctl") -> None:
        shared = _collectors(_DecisionCollectors, registry, namespace)
        self.decisions = shared.decisions
        self.ledger_seconds = shared.ledger_seconds
        self.app_seconds = shared.app_seconds

    def observe(self, event: Event) -> None:
        outcome = event.outcome.value
        self.decisions.labels(outcome).inc()
        self.ledger_seconds.labels(outcome).observe(event.ledger_ms / 1000)
        if event.app_ms is not None:
            self.app_seconds.labels(outcome).observe(event.app_ms / 1000)


def instrument(ledger: Ledger, *, registry: CollectorRegistry = REGISTRY, namespace: str = "idemctl") -> Metrics:
    """Count `ledger`'s decisions into `registry` (the default registry
    unless given), and its lease renewals when it renews leases
    (`Metrics.leases`).

    Idempotent: instrumenting the same ledger into the same registry and
    namespace again returns the same `Metrics` (each decision is counted
    once). Several ledgers instrumented into one registry and namespace
    share its metrics (their counts add up); give each its own `namespace`
    to tell them apart. A registry holding metrics of these names that
    idemctl did not register raises `MetricsRegistryError`.

    >>> from idemctl import Ledger
    >>> registry = CollectorRegistry()
    >>> orders, refunds = Ledger.open(":memory:"), Ledger.open(":memory:")
    >>> instrument(orders, registry=registry) is instrument(orders, registry=registry)
    True
    >>> instrument(refunds, registry=registry).decisions is instrument(orders, registry=registry).decisions
    True
    """
    place = (registry, namespace)
    with _LOCK:
        done = _INSTRUMENTED.get(ledger, {}).get(place)
        metrics = done() if done is not None else None
        if metrics is not None:
            return metrics
        metrics = Metrics(registry=registry, namespace=namespace)
        stop = ledger.subscribe(metrics.observe)
        owner = weakref.ref(ledger)

        def unsubscribe() -> None:
            stop()
            alive = owner()
            if alive is not None:
                with _LOCK:
                    _INSTRUMENTED.get(alive, {}).pop(place, None)

        metrics.unsubscribe = unsubscribe
        _INSTRUMENTED.setdefault(ledger, {})[place] = weakref.ref(metrics)
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


__all__ = [
    "LeaseMetrics",
    "Metrics",
    "MetricsRegistryError",
    "instrument",
    "instrument_leases",
    "mark_process_dead",
    "multiprocess_registry",
]
