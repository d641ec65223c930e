"""OpenTelemetry spans and metrics of the ledger's decisions (the `otel` extra).

`instrument(ledger)` subscribes to the ledger's events and records, through
the OpenTelemetry API (the application's SDK exports them):

- a span per decision, named ``idempotency <outcome>`` (``idempotency
  replayed``, ``idempotency in_progress``, ...), a child of the span that is
  current where the ledger decided (the request's, when the application's
  HTTP instrumentation opened one). It is recorded once the decision is
  known, with its real start and end: from the first ledger statement to
  the last (the claim, the mutation, the fenced completion), so spans the
  application opens while the mutation runs are its siblings, not its
  children. Its attributes say what happened (`Attr`): outcome, generation,
  replayed, waited, fenced, the time spent in the ledger and in the
  mutation, the HTTP method and status. The key is recorded
  (``record_key=False`` drops it); the principal only with
  ``record_principal=True``, since it is often a person's identifier;
- span status ERROR only for failures on the server's side: the ledger
  unavailable (503), an answer not stored, a mutation that raised, and a
  fenced-out completion (a takeover ran the request again while this one
  ran). Refusals (400, 401, 409, 413, ...) are the client's to fix and keep
  the status unset, as HTTP server spans keep 4xx;
- metrics mirroring idemctl.prometheus: ``idemctl.decisions`` (a counter by
  ``idemctl.outcome``), ``idemctl.ledger.duration`` and
  ``idemctl.app.duration`` (histograms in seconds, by outcome), and for a
  ledger with ``Policy(lease_renewal=True)`` its lease renewals
  (``idemctl.lease.*``); a renewal that came late or failed is also a span
  of its own, ``idemctl lease_renewal``, outside any request.

Nothing here runs unless `instrument` is called: `import idemctl` imports no
OpenTelemetry, and a ledger nobody listens to builds no events at all.

>>> from opentelemetry.sdk.trace import TracerProvider
>>> from opentelemetry.sdk.trace.export import SimpleSpanProcessor
>>> from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
>>> from idemctl import Ledger
>>> exporter = InMemorySpanExporter()
>>> provider = TracerProvider(); provider.add_span_processor(SimpleSpanProcessor(exporter))
>>> ledger = Ledger.open(":memory:"); _ = ledger.init()
>>> telemetry = instrument(ledger, tracer_provider=provider)
>>> _ = ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b""))
>>> _ = ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b""))
>>> [(s.name, s.attributes["idemctl.replayed"]) for s in exporter.get_finished_spans()]
[('idempotency executed', False), ('idempotency replayed', True)]
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Final

from .errors import missing_extra

try:
    from opentelemetry import context, metrics, trace
    from opentelemetry.util.types import AttributeValue
except ImportError as exc:  # the API lives behind an extra, as the engines' drivers do
    raise missing_extra("idemctl.otel needs the OpenTelemetry API", "otel", exc) from exc

from .leases import HeldShare, LeaseKeeper, LeaseTick
from .ledger import Ledger
from .outcomes import Event, Outcome

# The instrumentation scope's version (the package root is a layer above).
try:
    _VERSION = version("idemctl")
except PackageNotFoundError:  # a source tree that was never installed
    _VERSION = "0.0.0+source"

# The same buckets as idemctl.prometheus's histograms (seconds), offered to
# the SDK as advice: the API's default buckets are for milliseconds.
LEDGER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
APP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LAPSE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)

SCOPE = "idemctl"  # the instrumentation scope of every span and metric
LEASE_SPAN = "idemctl lease_renewal"


class Attr:
    """The attribute names of the spans (docs/observability.md)."""

    OUTCOME: Final = "idemctl.outcome"
    GENERATION: Final = "idemctl.generation"  # the reservation's owner count: 2 after one takeover
    REPLAYED: Final = "idemctl.replayed"
    WAITED: Final = "idemctl.waited"  # it waited on an in-progress duplicate first
    FENCED: Final = "idemctl.fenced"  # completed late: a takeover superseded it, its answer was not stored
    LEDGER_DURATION: Final = "idemctl.ledger.duration"  # seconds in the ledger's statements (and any wait)
    APP_DURATION: Final = "idemctl.app.duration"  # seconds the mutation ran; absent when nothing ran
    KEY: Final = "idemctl.key"
    PRINCIPAL: Final = "idemctl.principal"
    FUNCTION: Final = "code.function.name"  # an idempotent function's name (idemctl.functions)
    METHOD: Final = "http.request.method"
    METHOD_ORIGINAL: Final = "http.request.method_original"
    STATUS: Final = "http.response.status_code"
    LEASE_RESERVATIONS: Final = "idemctl.lease.reservations"
    LEASE_RENEWED: Final = "idemctl.lease.renewed"
    LEASE_LAPSE: Final = "idemctl.lease.lapse"  # seconds the least recently renewed reservation went without renewal
    LEASE_TTL: Final = "idemctl.lease.ttl"
    LEASE_DONE: Final = "idemctl.lease.done"  # False: the watchdog's report of a renewal still running (or failed)
    LEASE_STAGE: Final = "idemctl.lease.stage"  # of the late counter: "done" or "running"


# Server-side failures: the only decisions whose span status is ERROR.
FAILURES: dict[Outcome, str] = {
    Outcome.UNAVAILABLE: "the ledger could not be asked; nothing ran",
    Outcome.NOT_STORED: "the mutation ran but its answer could not be stored",
    Outcome.FAILED: "the mutation raised; its reservation waits for a takeover or was released",
    Outcome.FENCED_OUT: "a takeover superseded this reservation while it ran; its answer was not stored",
}
# HTTP semantic conventions: a method outside this set is recorded as _OTHER.
_METHODS = frozenset({"CONNECT", "DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "QUERY", "TRACE"})
_CALL = "CALL"  # the method of an idempotent function's events (idemctl.functions)
_ROOT = context.Context()  # lease renewals serve no request: their spans start traces of their own


class Telemetry:
    """The spans and metrics of one ledger, fed by `observe(event)` and,
    for a ledger that renews leases, `observe_tick(tick)`."""

    def __init__(
        self,
        *,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
        record_key: bool = True,
        record_principal: bool = False,
    ) -> None:
        self.tracer = trace.get_tracer(SCOPE, _VERSION, tracer_provider)
        meter = metrics.get_meter(SCOPE, _VERSION, meter_provider)
        self.record_key = record_key
        self.record_principal = record_principal
        self.decisions = meter.create_counter("idemctl.decisions", "{decision}", "Idempotency decisions by outcome")

        def seconds(name: str, description: str, buckets: Sequence[float]) -> metrics.Histogram:
            return meter.create_histogram(name, "s", description, explicit_bucket_boundaries_advisory=buckets)

        self.ledger_duration = seconds(
            "idemctl.ledger.duration", "Time spent in the ledger's statements per request", LEDGER_BUCKETS
        )
        self.app_duration = seconds(
            "idemctl.app.duration", "Time the mutation took, for requests that ran it", APP_BUCKETS
        )
        self.lease_renewal_duration = seconds(
            "idemctl.lease.renewal.duration", "Time each lease renewal took", LEDGER_BUCKETS
        )
        self.lease_lapse = seconds(
            "idemctl.lease.lapse",
            "How long reservations had gone without renewal when a renewal landed",
            LAPSE_BUCKETS,
        )
        self.lease_late = meter.create_counter(
            "idemctl.lease.late", "{renewal}", "Lease renewals that came late (over half the TTL)"
        )
        self.lease_failures = meter.create_counter("idemctl.lease.failures", "{renewal}", "Lease renewals that failed")
        self.leases_held = meter.create_up_down_counter(
            "idemctl.lease.held", "{reservation}", "Reservations this process renews"
        )
        self._held = HeldShare()  # this ledger's share of idemctl.lease.held
        self._stops: list[Callable[[], None]] = []

    def attributes(self, event: Event) -> dict[str, AttributeValue]:
        """The span attributes of one decision.

        >>> from idemctl import Outcome
        >>> event = Event(Outcome.IN_PROGRESS, "acct_1", "k1", 1, "POST", "/orders", 409, 150.0, None, 0, True)
        >>> Telemetry().attributes(event)  # doctest: +NORMALIZE_WHITESPACE
        {'idemctl.outcome': 'in_progress', 'idemctl.replayed': False, 'idemctl.waited': True,
         'idemctl.fenced': False, 'idemctl.ledger.duration': 0.15, 'idemctl.generation': 1,
         'http.request.method': 'POST', 'http.response.status_code': 409, 'idemctl.key': 'k1'}
        """
        outcome = event.outcome
        found: dict[str, AttributeValue] = {
            Attr.OUTCOME: outcome.value,
            Attr.REPLAYED: outcome is Outcome.REPLAYED,
            Attr.WAITED: event.waited,
            Attr.FENCED: outcome is Outcome.FENCED_OUT,
            Attr.LEDGER_DURATION: event.ledger_ms / 1000,
        }
        if event.generation is not None:
            found[Attr.GENERATION] = event.generation
        if event.app_ms is not None:
            found[Attr.APP_DURATION] = event.app_ms / 1000
        if event.method == _CALL:
            if event.path:
                found[Attr.FUNCTION] = event.path
        elif event.method in _METHODS:
            found[Attr.METHOD] = event.method
        else:
            found[Attr.METHOD], found[Attr.METHOD_ORIGINAL] = "_OTHER", event.method
        if event.status is not None:
            found[Attr.STATUS] = event.status
        if self.record_key and event.key is not None:
            found[Attr.KEY] = event.key
        if self.record_principal and event.principal is not None:
            found[Attr.PRINCIPAL] = event.principal
        return found

    def observe(self, event: Event) -> None:
        """One decision: its span (ended now, started when its first ledger
        statement did) and its metric points."""
        end = time.time_ns()
        spent_ms = event.ledger_ms + (event.app_ms or 0.0)
        outcome = event.outcome
        span = self.tracer.start_span(
            f"idempotency {outcome.value}", attributes=self.attributes(event), start_time=end - int(spent_ms * 1e6)
        )
        failure = FAILURES.get(outcome)
        if failure is not None:
            span.set_status(trace.Status(trace.StatusCode.ERROR, failure))
        span.end(end)
        by_outcome = {Attr.OUTCOME: outcome.value}
        self.decisions.add(1, by_outcome)
        self.ledger_duration.record(event.ledger_ms / 1000, by_outcome)
        if event.app_ms is not None:
            self.app_duration.record(event.app_ms / 1000, by_outcome)

    def observe_tick(self, tick: LeaseTick) -> None:
        """One lease renewal (or the watchdog's report of one overdue): its
        metric points, and a span when it came late or failed."""
        if tick.late:
            self.lease_late.add(1, {Attr.LEASE_STAGE: "done" if tick.done else "running"})
            self._lease_span(tick)
        elif tick.error is not None:
            self._lease_span(tick)
        if not tick.done:
            return
        if moved := self._held.moved(tick):
            self.leases_held.add(moved)
        if tick.error is not None:
            self.lease_failures.add(1)
            return
        self.lease_renewal_duration.record(tick.seconds)
        self.lease_lapse.record(tick.lapse_ms / 1000)

    def _lease_span(self, tick: LeaseTick) -> None:
        end = time.time_ns()
        attributes: dict[str, AttributeValue] = {
            Attr.LEASE_RESERVATIONS: tick.reservations,
            Attr.LEASE_LAPSE: tick.lapse_ms / 1000,
            Attr.LEASE_TTL: tick.ttl_ms / 1000,
            Attr.LEASE_DONE: tick.done,
        }
        if tick.renewed is not None:
            attributes[Attr.LEASE_RENEWED] = tick.renewed
        span = self.tracer.start_span(
            LEASE_SPAN, _ROOT, attributes=attributes, start_time=end - int(tick.seconds * 1e9)
        )
        if tick.error is not None:
            span.set_status(trace.Status(trace.StatusCode.ERROR, f"the renewal failed: {tick.error}"))
        elif tick.expired:
            span.set_status(trace.Status(trace.StatusCode.ERROR, "a reservation went a whole TTL without renewal"))
        span.end(end)

    def unsubscribe(self) -> None:
        """Stop recording this ledger's decisions (and lease renewals)."""
        stops, self._stops = self._stops, []
        for stop in stops:
            stop()


# What `instrument` returned for a ledger, by its arguments: asked again, it
# returns the same. Held weakly (the ledger's subscription keeps it alive).
_Place = tuple[object, object, bool, bool]
_INSTRUMENTED: weakref.WeakKeyDictionary[Ledger, dict[_Place, weakref.ref[Telemetry]]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def instrument(
    ledger: Ledger,
    *,
    tracer_provider: trace.TracerProvider | None = None,
    meter_provider: metrics.MeterProvider | None = None,
    record_key: bool = True,
    record_principal: bool = False,
) -> Telemetry:
    """Record `ledger`'s decisions as spans and metrics (and its lease
    renewals, when it renews leases) through these providers, or the
    global ones the application's OpenTelemetry setup installed.

    ``record_key`` puts the Idempotency-Key on each span (a client-chosen
    token, meaningful only with its principal); ``record_principal`` the
    principal too, off by default: it is often a user's or an account's
    identifier, which a trace backend may not be allowed to keep.

    Idempotent: the same ledger instrumented again with the same arguments
    returns the same `Telemetry` (each decision is recorded once);
    `Telemetry.unsubscribe` stops it.

    >>> from opentelemetry.sdk.metrics import MeterProvider
    >>> from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    >>> from idemctl import Ledger
    >>> reader = InMemoryMetricReader()
    >>> provider = MeterProvider(metric_readers=[reader])
    >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
    >>> telemetry = instrument(ledger, meter_provider=provider)
    >>> telemetry is instrument(ledger, meter_provider=provider)
    True
    >>> _ = ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b""))
    >>> recorded = reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics
    >>> [(p.attributes, p.value) for m in recorded if m.name == "idemctl.decisions" for p in m.data.data_points]
    [({'idemctl.outcome': 'executed'}, 1)]
    """
    place: _Place = (tracer_provider, meter_provider, record_key, record_principal)
    with _LOCK:
        done = _INSTRUMENTED.get(ledger, {}).get(place)
        telemetry = done() if done is not None else None
        if telemetry is not None:
            return telemetry
        telemetry = Telemetry(
            tracer_provider=tracer_provider,
            meter_provider=meter_provider,
            record_key=record_key,
            record_principal=record_principal,
        )
        telemetry._stops.append(ledger.subscribe(telemetry.observe))
        keeper: LeaseKeeper | None = ledger.leases
        if keeper is not None:
            telemetry._stops.append(keeper.subscribe(telemetry.observe_tick))
        owner = weakref.ref(ledger)

        def forget() -> None:
            alive = owner()
            if alive is not None:
                with _LOCK:
                    _INSTRUMENTED.get(alive, {}).pop(place, None)

        telemetry._stops.append(forget)
        _INSTRUMENTED.setdefault(ledger, {})[place] = weakref.ref(telemetry)
    return telemetry


__all__ = ["FAILURES", "LEASE_SPAN", "SCOPE", "Attr", "Telemetry", "instrument"]
