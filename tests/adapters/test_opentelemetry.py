"""OpenTelemetry spans and metrics of the ledger's decisions (idemctl.otel),
through every door: WSGI, ASGI, FastAPI, Django and DRF, Flask, idempotent
functions. Each test reads back its own tracer and meter providers through
the SDK's in-memory exporters, never the global ones."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request, Response
from fastapi.testclient import TestClient
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader, NumberDataPoint
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Span, SpanKind, StatusCode

from idemctl import CallInProgressError, KeyReusedError, Ledger, Outcome, Policy, StorageError
from idemctl.asgi import IdempotencyMiddleware as AsgiMiddleware
from idemctl.leases import LeaseTick
from idemctl.otel import APP_BUCKETS, LAPSE_BUCKETS, LEASE_SPAN, LEDGER_BUCKETS, Attr, Telemetry, instrument
from tests.adapters.test_adapter_contract import CLIENTS, FastApiClient, Orders, Reply, post
from tests.helpers import FakeClock

TTL = 30_000


class FastApiMiddlewareClient(FastApiClient):
    """A FastAPI app under the ASGI middleware (the route class is `fastapi`)."""

    def __init__(self, ledger: Ledger, orders: Orders, **options: object) -> None:
        async def who(scope: dict) -> str | None:
            found = dict(scope["headers"]).get(b"x-user")
            return None if found is None else found.decode()

        app = FastAPI()

        @app.api_route("/orders", methods=["GET", "POST"])
        async def orders_endpoint(request: Request) -> Response:
            status, headers, body = orders.answer(await request.body())
            return Response(content=body, status_code=status, headers=dict(headers))

        app.add_middleware(AsgiMiddleware, ledger=ledger, principal=who, **options)
        self.app = app
        self.client = TestClient(app, raise_server_exceptions=True)


DOORS = {**CLIENTS, "fastapi-middleware": FastApiMiddlewareClient}
ADAPTERS = list(DOORS)  # wsgi, asgi, fastapi, django, drf, flask-view, fastapi-middleware


class Recorder:
    """A tracer and a meter provider of the test's own, read back in memory."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider(shutdown_on_exit=False)
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader], shutdown_on_exit=False)
        # The application's own tracer: it opens the request's span.
        self.tracer = self.tracer_provider.get_tracer("tests.app")

    def instrument(self, ledger: Ledger, **options: Any) -> Telemetry:
        return instrument(ledger, tracer_provider=self.tracer_provider, meter_provider=self.meter_provider, **options)

    def request(self, send: Any) -> tuple[Any, Span]:
        """`send()` inside a request span, as an HTTP instrumentation opens one."""
        with self.tracer.start_as_current_span("POST /orders", kind=SpanKind.SERVER) as span:
            return send(), span

    def decisions(self) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if s.instrumentation_scope.name == "idemctl"]

    def points(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        if data is None:
            return []
        return [
            point
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == name
            for point in metric.data.data_points
        ]

    def counts(self, name: str) -> dict[str, int]:
        """{outcome: value} of a counter, or {outcome: count} of a histogram."""
        out = {}
        for point in self.points(name):
            count = point.count if isinstance(point, HistogramDataPoint) else point.value
            out[str(dict(point.attributes)[Attr.OUTCOME])] = count
        return out


@pytest.fixture
def otel() -> Recorder:
    return Recorder()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make(tmp_path: Path, clock: FakeClock, otel: Recorder) -> Iterator[Any]:
    """An instrumented SQLite ledger (of this test's clock) behind one door."""
    opened: list[Ledger] = []

    def factory(adapter: str, orders: Any, *, policy: Policy | None = None, init: bool = True) -> tuple[Any, Ledger]:
        ledger = Ledger.open(tmp_path / f"ledger-{len(opened)}.db", policy=policy, clock=clock)
        opened.append(ledger)
        if init:
            ledger.init()
        otel.instrument(ledger)
        return DOORS[adapter](ledger, orders), ledger

    yield factory
    for ledger in opened:
        ledger.close()


class FirstRunWaits(Orders):
    """The app: its first run waits for `release`, every later one answers at once."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.first_running = threading.Event()

    def answer(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        if not self.first_running.is_set():
            self.first_running.set()
            self.release.wait(10)
        return super().answer(body)


def durations_apart(span: ReadableSpan) -> dict[str, Any]:
    """The span's attributes without its two durations, once they are checked:
    the ledger's is there always, the mutation's when it ran, and the span
    lasts exactly their sum (it is recorded after the fact, with its times)."""
    attributes = dict(span.attributes or {})
    ledger_s = attributes.pop(Attr.LEDGER_DURATION)
    app_s = attributes.pop(Attr.APP_DURATION, None)
    assert isinstance(ledger_s, float) and ledger_s >= 0
    assert app_s is None or (isinstance(app_s, float) and app_s >= 0)
    assert span.start_time is not None and span.end_time is not None
    assert abs((span.end_time - span.start_time) - (ledger_s + (app_s or 0.0)) * 1e9) < 1_000
    return {**attributes, "ran": app_s is not None}


def child_of(span: ReadableSpan, parent: Span) -> bool:
    context = parent.get_span_context()
    return span.parent is not None and (span.parent.trace_id, span.parent.span_id) == (
        context.trace_id,
        context.span_id,
    )


def attrs(outcome: str, status: int, *, generation: int | None = 1, key: str | None = "k-1", **flags: bool) -> dict:
    expected: dict[str, Any] = {
        Attr.OUTCOME: outcome,
        Attr.REPLAYED: flags.get("replayed", False),
        Attr.WAITED: flags.get("waited", False),
        Attr.FENCED: flags.get("fenced", False),
        Attr.METHOD: "POST",
        Attr.STATUS: status,
        "ran": flags.get("ran", False),
    }
    if generation is not None:
        expected[Attr.GENERATION] = generation
    if key is not None:
        expected[Attr.KEY] = key
    return expected


# -- every door: one span per decision, a child of the request's -------------------------------


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_a_first_call_a_replay_and_two_refusals_are_one_child_span_each(adapter, make, otel):
    client, _ = make(adapter, Orders())
    sent = [
        otel.request(lambda: post(client)),
        otel.request(lambda: post(client)),
        otel.request(lambda: post(client, key=None)),
        otel.request(lambda: post(client, user=None)),
    ]
    assert [reply.status for reply, _ in sent] == [201, 201, 400, 401]
    spans = otel.decisions()
    assert [s.name for s in spans] == [
        "idempotency executed",
        "idempotency replayed",
        "idempotency key_required",
        "idempotency unauthenticated",
    ]
    assert [child_of(span, parent) for span, (_, parent) in zip(spans, sent)] == [True] * 4
    assert [durations_apart(s) for s in spans] == [
        attrs("executed", 201, ran=True),
        attrs("replayed", 201, replayed=True),
        attrs("key_required", 400, generation=None, key=None),
        attrs("unauthenticated", 401, generation=None),
    ]
    # Refusals are the client's to fix: no span is an error.
    assert [s.status.status_code for s in spans] == [StatusCode.UNSET] * 4
    assert [s.kind for s in spans] == [SpanKind.INTERNAL] * 4
    assert otel.counts("idemctl.decisions") == {"executed": 1, "replayed": 1, "key_required": 1, "unauthenticated": 1}
    assert otel.counts("idemctl.ledger.duration") == {
        "executed": 1,
        "replayed": 1,
        "key_required": 1,
        "unauthenticated": 1,
    }
    assert otel.counts("idemctl.app.duration") == {"executed": 1}


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_a_duplicate_that_waited_on_the_claim_is_a_409_in_progress_span_that_says_it_waited(adapter, make, otel):
    orders = FirstRunWaits()
    client, _ = make(adapter, orders, policy=Policy(in_progress_wait_ms=50))
    first: list[tuple[Reply, Span]] = []
    runner = threading.Thread(target=lambda: first.append(otel.request(lambda: post(client))))
    runner.start()
    try:
        assert orders.first_running.wait(10)
        duplicate, parent = otel.request(lambda: post(client))
    finally:
        orders.release.set()
        runner.join(10)
    assert (duplicate.status, first[0][0].status, len(orders.runs)) == (409, 201, 1)
    busy, done = otel.decisions()
    assert child_of(busy, parent) and child_of(done, first[0][1])
    assert durations_apart(busy) == attrs("in_progress", 409, waited=True)
    assert durations_apart(done) == attrs("executed", 201, ran=True)
    assert busy.attributes[Attr.LEDGER_DURATION] >= 0.05  # the wait is the ledger's time
    assert busy.status.status_code is StatusCode.UNSET
    assert otel.counts("idemctl.decisions") == {"in_progress": 1, "executed": 1}


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_a_fenced_out_completion_is_an_error_span_of_the_old_generation(adapter, make, otel, clock):
    orders = FirstRunWaits()
    client, _ = make(adapter, orders)
    late: list[tuple[Reply, Span]] = []
    runner = threading.Thread(target=lambda: late.append(otel.request(lambda: post(client))))
    runner.start()
    try:
        assert orders.first_running.wait(10)
        clock.advance(TTL + 1)
        retry, parent = otel.request(lambda: post(client))  # takes the stale reservation over
    finally:
        orders.release.set()
        runner.join(10)
    assert (retry.status, late[0][0].status, len(orders.runs)) == (201, 201, 2)  # it ran twice
    taken, fenced = otel.decisions()
    assert child_of(taken, parent) and child_of(fenced, late[0][1])
    assert durations_apart(taken) == attrs("taken_over", 201, generation=2, ran=True)
    assert durations_apart(fenced) == attrs("fenced_out", 201, generation=1, fenced=True, ran=True)
    assert (taken.status.status_code, fenced.status.status_code) == (StatusCode.UNSET, StatusCode.ERROR)
    assert fenced.status.description == (
        "a takeover superseded this reservation while it ran; its answer was not stored"
    )
    assert otel.counts("idemctl.decisions") == {"taken_over": 1, "fenced_out": 1}
    assert otel.counts("idemctl.app.duration") == {"taken_over": 1, "fenced_out": 1}


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_an_unavailable_ledger_is_an_error_span_of_its_503(adapter, make, otel):
    client, _ = make(adapter, Orders(), init=False)  # no schema: every statement fails
    reply, parent = otel.request(lambda: post(client))
    assert reply.status == 503
    (span,) = otel.decisions()
    assert child_of(span, parent)
    assert durations_apart(span) == attrs("unavailable", 503, generation=None)
    assert (span.status.status_code, span.status.description) == (
        StatusCode.ERROR,
        "the ledger could not be asked; nothing ran",
    )
    assert otel.counts("idemctl.decisions") == {"unavailable": 1}


# -- idempotent functions ----------------------------------------------------------------------


@pytest.fixture
def ledger(tmp_path: Path, clock: FakeClock, otel: Recorder) -> Iterator[Ledger]:
    with Ledger.open(tmp_path / "calls.db", clock=clock) as opened:
        opened.init()
        otel.instrument(opened)
        yield opened


def call_attrs(outcome: str, generation: int, **flags: bool) -> dict:
    expected = attrs(outcome, 0, generation=generation, key="pay_1", **flags)
    del expected[Attr.METHOD], expected[Attr.STATUS]
    return {**expected, Attr.FUNCTION: "charge"}


def test_an_idempotent_function_records_its_call_replay_refusals_and_fenced_out_completion(ledger, otel, clock):
    started, release = threading.Event(), threading.Event()
    runs: list[int] = []

    @ledger.idempotent(key=lambda payment: payment["id"], principal="billing", name="charge")
    def charge(payment: dict) -> dict:
        runs.append(1)
        if len(runs) == 1:
            started.set()
            release.wait(10)
        return {"charged": payment["amount"]}

    late: list[tuple[Any, Span]] = []
    runner = threading.Thread(target=lambda: late.append(otel.request(lambda: charge({"id": "pay_1", "amount": 5}))))
    runner.start()
    try:
        assert started.wait(10)
        with pytest.raises(CallInProgressError):
            otel.request(lambda: charge({"id": "pay_1", "amount": 5}))
        with pytest.raises(KeyReusedError):
            otel.request(lambda: charge({"id": "pay_1", "amount": 6}))
        clock.advance(TTL + 1)
        taken, taken_parent = otel.request(lambda: charge({"id": "pay_1", "amount": 5}))
    finally:
        release.set()
        runner.join(10)
    replay, replay_parent = otel.request(lambda: charge({"id": "pay_1", "amount": 5}))
    assert (taken, late[0][0], replay, len(runs)) == ({"charged": 5}, {"charged": 5}, {"charged": 5}, 2)
    spans = otel.decisions()
    assert [s.name for s in spans] == [
        "idempotency in_progress",
        "idempotency reused",
        "idempotency taken_over",
        "idempotency fenced_out",
        "idempotency replayed",
    ]
    reused_attrs = call_attrs("reused", 0)
    del reused_attrs[Attr.GENERATION]  # a call refused for another's arguments names no generation
    assert [durations_apart(s) for s in spans] == [
        call_attrs("in_progress", 1),
        reused_attrs,
        call_attrs("taken_over", 2, ran=True),
        call_attrs("fenced_out", 1, fenced=True, ran=True),
        call_attrs("replayed", 2, replayed=True),
    ]
    assert child_of(spans[2], taken_parent) and child_of(spans[3], late[0][1]) and child_of(spans[4], replay_parent)
    assert [s.status.status_code for s in spans] == [StatusCode.UNSET] * 3 + [StatusCode.ERROR, StatusCode.UNSET]
    assert otel.counts("idemctl.decisions") == {
        "in_progress": 1,
        "reused": 1,
        "taken_over": 1,
        "fenced_out": 1,
        "replayed": 1,
    }


def test_a_function_call_that_waited_on_the_first_one_says_so(tmp_path, otel):
    started, release = threading.Event(), threading.Event()
    with Ledger.open(tmp_path / "calls.db", policy=Policy(in_progress_wait_ms=50)) as ledger:
        ledger.init()
        otel.instrument(ledger)

        @ledger.idempotent(key="pay_1", principal="billing", name="charge")
        def charge() -> int:
            if not started.is_set():
                started.set()
                release.wait(10)
            return 5

        runner = threading.Thread(target=charge)
        runner.start()
        try:
            assert started.wait(10)
            with pytest.raises(CallInProgressError):
                otel.request(charge)
        finally:
            release.set()
            runner.join(10)
    busy, done = otel.decisions()
    assert durations_apart(busy) == call_attrs("in_progress", 1, waited=True)
    assert durations_apart(done) == call_attrs("executed", 1, ran=True)


def test_a_function_whose_ledger_is_unavailable_raises_and_records_one_unavailable_error_span(tmp_path, otel):
    with Ledger.open(tmp_path / "never-initialised.db") as missing:
        otel.instrument(missing)

        @missing.idempotent(key="pay_1", principal="billing", name="charge")
        def charge() -> int:
            return 1

        with pytest.raises(StorageError):
            otel.request(charge)
    # Counted like an HTTP door's 503: the ledger could not be asked, nothing ran.
    (span,) = otel.decisions()
    expected = attrs("unavailable", 0, generation=None, key="pay_1")
    del expected[Attr.METHOD], expected[Attr.STATUS]
    assert durations_apart(span) == {**expected, Attr.FUNCTION: "charge"}
    assert (span.status.status_code, span.status.description) == (
        StatusCode.ERROR,
        "the ledger could not be asked; nothing ran",
    )
    assert otel.counts("idemctl.decisions") == {"unavailable": 1}


# -- options, metrics and leases -----------------------------------------------------------------


def test_the_principal_is_recorded_only_when_asked_and_the_key_can_be_left_out(tmp_path, otel):
    with Ledger.open(tmp_path / "l.db") as ledger:
        ledger.init()
        ok = lambda body: (201, {}, b"")  # noqa: E731
        quiet = otel.instrument(ledger, record_key=False)
        ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"", ok)
        quiet.unsubscribe()
        otel.instrument(ledger, record_principal=True)
        ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"", ok)
    without, with_principal = otel.decisions()
    assert (Attr.KEY in without.attributes, Attr.PRINCIPAL in without.attributes) == (False, False)
    assert (with_principal.attributes[Attr.KEY], with_principal.attributes[Attr.PRINCIPAL]) == ("k1", "acct_1")


def test_instrumenting_twice_records_each_decision_once_and_unsubscribe_stops_it(tmp_path, otel):
    with Ledger.open(tmp_path / "l.db") as ledger:
        ledger.init()
        first = otel.instrument(ledger)
        assert otel.instrument(ledger) is first
        ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b""))
        first.unsubscribe()
        ledger.handle("acct_1", "k2", "POST", "/orders", {}, b"", lambda body: (201, {}, b""))
        assert otel.instrument(ledger) is not first
    assert [s.attributes[Attr.KEY] for s in otel.decisions()] == ["k1"]
    assert otel.counts("idemctl.decisions") == {"executed": 1}


def test_the_histograms_are_in_seconds_with_the_prometheus_buckets(tmp_path, otel):
    from idemctl import prometheus

    assert (LEDGER_BUCKETS, APP_BUCKETS, LAPSE_BUCKETS) == (
        prometheus.LEDGER_BUCKETS,
        prometheus.APP_BUCKETS,
        prometheus.LAPSE_BUCKETS,
    )
    with Ledger.open(tmp_path / "l.db") as ledger:
        ledger.init()
        otel.instrument(ledger)
        ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b""))
    (store,), (app,) = otel.points("idemctl.ledger.duration"), otel.points("idemctl.app.duration")
    assert (tuple(store.explicit_bounds), tuple(app.explicit_bounds)) == (LEDGER_BUCKETS, APP_BUCKETS)
    (span,) = otel.decisions()
    assert (store.sum, app.sum) == (span.attributes[Attr.LEDGER_DURATION], span.attributes[Attr.APP_DURATION])


def test_lease_ticks_are_metrics_and_a_late_or_failed_one_is_a_root_span(otel):
    telemetry = Telemetry(tracer_provider=otel.tracer_provider, meter_provider=otel.meter_provider)
    with otel.tracer.start_as_current_span("some request"):  # the renewal thread serves none
        telemetry.observe_tick(LeaseTick(reservations=3, renewed=3, seconds=0.002, lapse_ms=10_000.0, ttl_ms=30_000))
        telemetry.observe_tick(LeaseTick(reservations=2, renewed=2, seconds=0.5, lapse_ms=16_000.0, ttl_ms=30_000))
        telemetry.observe_tick(
            LeaseTick(reservations=2, renewed=None, seconds=31.0, lapse_ms=31_000.0, ttl_ms=30_000, done=False)
        )
        telemetry.observe_tick(
            LeaseTick(reservations=1, renewed=None, seconds=0.01, lapse_ms=9_000.0, ttl_ms=30_000, error="locked")
        )
    spans = otel.decisions()
    assert [s.name for s in spans] == [LEASE_SPAN] * 3
    assert [s.parent for s in spans] == [None] * 3
    assert [dict(s.attributes or {}) for s in spans] == [
        {
            Attr.LEASE_RESERVATIONS: 2,
            Attr.LEASE_RENEWED: 2,
            Attr.LEASE_LAPSE: 16.0,
            Attr.LEASE_TTL: 30.0,
            Attr.LEASE_DONE: True,
        },
        {Attr.LEASE_RESERVATIONS: 2, Attr.LEASE_LAPSE: 31.0, Attr.LEASE_TTL: 30.0, Attr.LEASE_DONE: False},
        {Attr.LEASE_RESERVATIONS: 1, Attr.LEASE_LAPSE: 9.0, Attr.LEASE_TTL: 30.0, Attr.LEASE_DONE: True},
    ]
    assert [(s.status.status_code, s.status.description) for s in spans] == [
        (StatusCode.UNSET, None),
        (StatusCode.ERROR, "a reservation went a whole TTL without renewal"),
        (StatusCode.ERROR, "the renewal failed: locked"),
    ]
    late = {str(dict(p.attributes)[Attr.LEASE_STAGE]): p.value for p in otel.points("idemctl.lease.late")}
    assert late == {"done": 1, "running": 1}
    ((failures,), (held,)) = otel.points("idemctl.lease.failures"), otel.points("idemctl.lease.held")
    assert isinstance(held, NumberDataPoint) and (failures.value, held.value) == (1, 1)
    (renewals,), (lapses,) = otel.points("idemctl.lease.renewal.duration"), otel.points("idemctl.lease.lapse")
    assert (renewals.count, renewals.sum, lapses.count, lapses.sum) == (2, 0.502, 2, 26.0)


def test_a_ledger_that_renews_leases_reports_its_renewals(tmp_path, otel):
    policy = Policy(lease_renewal=True, pending_ttl_ms=300)
    with Ledger.open(tmp_path / "l.db", policy=policy) as ledger:
        ledger.init()
        otel.instrument(ledger)
        ticket = ledger.begin("acct_1", "k1", "POST", "/orders", {}, b"")
        keeper = ledger.leases
        assert keeper is not None
        for _ in range(200):
            if keeper.ticks >= 2:
                break
            threading.Event().wait(0.02)
        ledger.finish(ticket, 201, {}, b"")
    # Closed: the renewing thread has reported its last tick.
    (renewals,) = otel.points("idemctl.lease.renewal.duration")
    assert keeper.ticks >= 2 and renewals.count == keeper.ticks


# -- off costs nothing ---------------------------------------------------------------------------

OFF = """
import json, sys
from idemctl import Ledger, Outcome
import idemctl.asgi, idemctl.wsgi
ledger = Ledger.open(":memory:"); ledger.init()
ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b""))
print(json.dumps({
    "opentelemetry": sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry"),
    "listened": [o.value for o in Outcome if ledger.core.events.heard(o) and o in (Outcome.EXECUTED, Outcome.REPLAYED)],
}))
"""


def test_without_instrument_nothing_of_opentelemetry_is_imported_and_no_event_is_built():
    done = subprocess.run([sys.executable, "-c", OFF], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(done.stdout) == {"opentelemetry": [], "listened": []}


def test_an_unsubscribed_ledger_goes_back_to_building_no_events(tmp_path, otel):
    with Ledger.open(tmp_path / "l.db") as ledger:
        ledger.init()
        telemetry = otel.instrument(ledger)
        assert ledger.core.events.heard(Outcome.EXECUTED) is True
        telemetry.unsubscribe()
        assert ledger.core.events.heard(Outcome.EXECUTED) is False
