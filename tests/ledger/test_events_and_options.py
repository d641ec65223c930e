"""What the ledger reports (events, the structured log) and the opt-in
contract options: waiting for the first answer, which answers are kept, the
validity header, Retry-After from the row, the database's clock and JSON
fingerprints. Defaults stay the recipe's behaviour."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from email.utils import formatdate

import pytest

from idemctl import Event, Ledger, Outcome, Policy, Status
from idemctl.errors import SchemaMissingError

TTL = 30_000
DAY = 86_400_000


def ok(status: int = 201, body: bytes = b'{"id":1}'):
    return lambda _body: (status, {"content-type": "application/json"}, body)


def test_every_decision_of_a_scripted_run_emits_one_event_with_its_outcome(make_ledger, clock):
    ledger = make_ledger(policy=Policy(pending_ttl_ms=TTL))
    events: list[Event] = []
    ledger.subscribe(events.append)
    h = ledger.handle
    h("acct", "k1", "POST", "/o", {}, b"a", ok())  # executed
    h("acct", "k1", "POST", "/o", {}, b"a", ok())  # replayed
    h("acct", "k1", "POST", "/o", {}, b"b", ok())  # reused
    h("acct", None, "POST", "/o", {}, b"a", ok())  # key_required
    h("acct", "bad\n", "POST", "/o", {}, b"a", ok())  # key_invalid
    h(None, "k1", "POST", "/o", {}, b"a", ok())  # unauthenticated
    stalled = ledger.begin("acct", "k2", "POST", "/o", {}, b"a")  # (claimed: no event until it ends)
    h("acct", "k2", "POST", "/o", {}, b"a", ok())  # in_progress
    clock.advance(TTL + 1)
    h("acct", "k2", "POST", "/o", {}, b"a", ok())  # taken_over
    ledger.finish(stalled, 201, {}, b"late")  # fenced_out
    with pytest.raises(RuntimeError):
        h("acct", "k3", "POST", "/o", {}, b"a", _raise)  # failed
    h("acct", "k4", "GET", "/o", {}, b"", ok(200))  # passthrough: not a ledger decision
    assert [e.outcome for e in events] == [
        Outcome.EXECUTED,
        Outcome.REPLAYED,
        Outcome.REUSED,
        Outcome.KEY_REQUIRED,
        Outcome.KEY_INVALID,
        Outcome.UNAUTHENTICATED,
        Outcome.IN_PROGRESS,
        Outcome.TAKEN_OVER,
        Outcome.FENCED_OUT,
        Outcome.FAILED,
    ]
    first = events[0]
    assert (first.principal, first.key, first.generation, first.method, first.path, first.status) == (
        "acct",
        "k1",
        1,
        "POST",
        "/o",
        201,
    )
    assert first.ledger_ms > 0 and first.app_ms is not None and first.app_ms >= 0
    assert events[1].app_ms is None and events[1].ledger_ms > 0  # a replay ran nothing
    assert (events[7].generation, events[8].generation) == (2, 1)
    assert events[9].status is None and events[9].app_ms is not None


def _raise(body: bytes):
    raise RuntimeError("mutation failed")


def test_an_unreachable_ledger_emits_unavailable_then_raises(tmp_path):
    ledger = Ledger.open(tmp_path / "never-initialised.db")
    events: list[Event] = []
    ledger.subscribe(events.append)
    with pytest.raises(SchemaMissingError):
        ledger.handle("acct", "k", "POST", "/o", {}, b"", ok())
    assert [(e.outcome, e.status) for e in events] == [(Outcome.UNAVAILABLE, 503)]


def test_a_failing_listener_never_fails_a_request_and_unsubscribe_stops_delivery(ledger, caplog):
    def broken(event: Event) -> None:
        raise ValueError("listener bug")

    seen: list[Outcome] = []
    stop_broken = ledger.subscribe(broken)
    stop_seen = ledger.subscribe(lambda e: seen.append(e.outcome))
    with caplog.at_level(logging.ERROR, logger="idemctl"):
        answer = ledger.handle("acct", "k", "POST", "/o", {}, b"", ok())
    assert answer.outcome is Outcome.EXECUTED and seen == [Outcome.EXECUTED]
    assert "an idemctl event listener failed on executed" in caplog.text
    stop_broken()
    stop_seen()
    ledger.handle("acct", "k", "POST", "/o", {}, b"", ok())
    assert seen == [Outcome.EXECUTED]


def test_non_trivial_decisions_log_one_structured_line_with_the_fields_in_extra(ledger, caplog):
    with caplog.at_level(logging.INFO, logger="idemctl.events"):
        ledger.handle("acct", "k", "POST", "/o", {}, b"a", ok())  # executed: routine, not logged
        ledger.handle("acct", "k", "POST", "/o", {}, b"a", ok())  # replayed: routine
        ledger.handle("acct", "k", "POST", "/o", {}, b"b", ok())  # reused: logged
    records = [r for r in caplog.records if r.name == "idemctl.events"]
    assert len(records) == 1
    record = records[0]
    assert (record.levelno, record.idemctl_outcome, record.idemctl_principal, record.idemctl_key) == (
        logging.INFO,
        "reused",
        "acct",
        "k",
    )
    assert (record.idemctl_status, record.idemctl_generation, record.idemctl_method, record.idemctl_path) == (
        409,
        1,
        "POST",
        "/o",
    )
    assert record.getMessage().startswith("reused POST /o principal=acct key=k generation=1 status=409 ledger=")


def test_waiting_for_the_first_answer_turns_a_stampede_into_one_run_and_identical_answers(make_ledger):
    ledger = make_ledger(policy=Policy(in_progress_wait_ms=10_000), clock_fn=None)
    gate = threading.Event()
    runs: list[int] = []

    def slow(body: bytes):
        runs.append(1)
        gate.wait(5)
        return 201, {"content-type": "application/json", "location": "/orders/1"}, b'{"id":1}'

    answers = []
    barrier = threading.Barrier(20)

    def one() -> None:
        barrier.wait(5)
        answers.append(ledger.handle("acct", "stampede", "POST", "/o", {}, b"x", slow))

    threads = [threading.Thread(target=one) for _ in range(20)]
    for t in threads:
        t.start()
    threading.Timer(0.3, gate.set).start()
    for t in threads:
        t.join(15)
    assert len(runs) == 1
    assert Counter(a.outcome for a in answers) == Counter({Outcome.EXECUTED: 1, Outcome.REPLAYED: 19})
    assert {a.wire for a in answers} == {
        (201, (("content-type", "application/json"), ("location", "/orders/1")), b'{"id":1}')
    }


def test_without_the_wait_a_duplicate_still_gets_409_at_once(make_ledger):
    ledger = make_ledger()
    ledger.begin("acct", "k", "POST", "/o", {}, b"x")
    assert ledger.handle("acct", "k", "POST", "/o", {}, b"x", ok()).outcome is Outcome.IN_PROGRESS


def test_a_wait_that_runs_out_answers_409_in_progress(make_ledger):
    ledger = make_ledger(policy=Policy(in_progress_wait_ms=150), clock_fn=None)
    ledger.begin("acct", "k", "POST", "/o", {}, b"x")  # never finishes
    answer = ledger.handle("acct", "k", "POST", "/o", {}, b"x", ok())
    assert (answer.outcome, answer.status, answer.header("retry-after")) == (Outcome.IN_PROGRESS, 409, "30")


def test_an_event_says_whether_its_request_waited_on_an_in_progress_duplicate(make_ledger):
    ledger = make_ledger(policy=Policy(in_progress_wait_ms=150), clock_fn=None)
    events: list[Event] = []
    ledger.subscribe(events.append)
    ledger.begin("acct", "stuck", "POST", "/o", {}, b"x")  # never finishes
    ledger.handle("acct", "stuck", "POST", "/o", {}, b"x", ok())  # waits 150 ms, then 409
    first = ledger.begin("acct", "done", "POST", "/o", {}, b"x")
    threading.Timer(0.05, lambda: ledger.finish(first, 201, {}, b"made")).start()
    ledger.handle("acct", "done", "POST", "/o", {}, b"x", ok())  # waits, then replays
    gone = ledger.begin("acct", "gone", "POST", "/o", {}, b"x")
    threading.Timer(0.05, lambda: ledger.abandon(gone, release=True)).start()
    ledger.handle("acct", "gone", "POST", "/o", {}, b"x", ok())  # waits, then claims and runs
    assert [(e.key, e.outcome, e.waited) for e in events] == [
        ("stuck", Outcome.IN_PROGRESS, True),
        ("done", Outcome.EXECUTED, False),
        ("done", Outcome.REPLAYED, True),
        ("gone", Outcome.FAILED, False),
        ("gone", Outcome.EXECUTED, True),
    ]


def test_without_the_wait_no_event_says_it_waited(make_ledger):
    ledger = make_ledger()
    events: list[Event] = []
    ledger.subscribe(events.append)
    ledger.begin("acct", "k", "POST", "/o", {}, b"x")
    ledger.handle("acct", "k", "POST", "/o", {}, b"x", ok())
    ledger.handle("acct", "k2", "POST", "/o", {}, b"x", ok())
    assert [(e.outcome, e.waited) for e in events] == [(Outcome.IN_PROGRESS, False), (Outcome.EXECUTED, False)]


def test_a_policy_that_does_not_keep_5xx_releases_the_key_so_the_retry_runs(make_ledger):
    ledger = make_ledger(policy=Policy(keep_answer=lambda status, headers: status < 500))
    runs: list[int] = []

    def flaky(body: bytes):
        runs.append(1)
        return (503, {"content-type": "text/plain"}, b"busy") if len(runs) == 1 else (201, {}, b"made")

    first = ledger.handle("acct", "k", "POST", "/o", {}, b"x", flaky)
    assert (first.outcome, first.status, first.body) == (Outcome.NOT_KEPT, 503, b"busy")
    assert ledger.lookup("acct", "k") is None
    second = ledger.handle("acct", "k", "POST", "/o", {}, b"x", flaky)
    assert (second.outcome, second.status, len(runs)) == (Outcome.EXECUTED, 201, 2)
    assert ledger.handle("acct", "k", "POST", "/o", {}, b"x", flaky).body == b"made"


def test_the_validity_header_says_until_when_the_answer_is_replayed(make_ledger, clock):
    ledger = make_ledger(policy=Policy(expires_header="Idempotency-Expires"))
    first = ledger.handle("acct", "k", "POST", "/o", {}, b"x", ok())
    clock.advance(60_000)
    replay = ledger.handle("acct", "k", "POST", "/o", {}, b"x", ok())
    row = ledger.lookup("acct", "k")
    expected = formatdate((row.updated_at + DAY) / 1000, usegmt=True)
    assert first.header("idempotency-expires") == replay.header("idempotency-expires") == expected
    assert first.wire == replay.wire
    assert ledger.lookup("acct", "k").response_headers == '{"content-type":"application/json"}'  # not stored


def test_retry_after_from_the_row_counts_down_to_the_takeover(make_ledger, clock):
    ledger = make_ledger(policy=Policy(retry_after_from_row=True))
    ledger.begin("acct", "k", "POST", "/o", {}, b"x")
    clock.advance(25_500)
    answer = ledger.handle("acct", "k", "POST", "/o", {}, b"x", ok())
    assert (answer.header("retry-after"), answer.body) == (
        "5",
        b'{"error":"idempotency_key_in_progress","retry_after_ms":4501}',
    )


def test_json_fingerprints_ignore_key_order_whitespace_and_named_fields(make_ledger):
    ledger = make_ledger(policy=Policy(fingerprint_body="json", fingerprint_ignore_fields=("sent_at", "meta.trace")))
    json_ct = {"content-type": "application/json"}
    first = ledger.handle(
        "acct", "k", "POST", "/o", json_ct, b'{"sku":"tea","qty":2,"sent_at":1,"meta":{"trace":"a"}}', ok()
    )
    same = ledger.handle(
        "acct", "k", "POST", "/o", json_ct, b'{ "qty": 2, "sku": "tea", "sent_at": 2, "meta": {"trace": "x"} }', ok()
    )
    other = ledger.handle("acct", "k", "POST", "/o", json_ct, b'{"sku":"tea","qty":3}', ok())
    assert (first.outcome, same.outcome, other.outcome) == (Outcome.EXECUTED, Outcome.REPLAYED, Outcome.REUSED)


def test_the_default_fingerprint_stays_byte_exact(make_ledger):
    ledger = make_ledger()
    json_ct = {"content-type": "application/json"}
    ledger.handle("acct", "k", "POST", "/o", json_ct, b'{"a":1,"b":2}', ok())
    assert ledger.handle("acct", "k", "POST", "/o", json_ct, b'{"b":2,"a":1}', ok()).outcome is Outcome.REUSED


def test_hosts_with_skewed_clocks_agree_when_the_database_clock_decides(make_ledger, ledger_target):
    from idemctl import wall_clock_ms

    ten_minutes = 600_000
    first = make_ledger(policy=Policy(pending_ttl_ms=TTL), clock_fn=lambda: wall_clock_ms() - ten_minutes)
    first.begin("acct", "k", "POST", "/o", {}, b"x")  # its host's clock is 10 min behind
    # A host trusting its own clock sees the row as 10 minutes old and takes it over at once.
    own = Ledger.open(ledger_target, policy=Policy(pending_ttl_ms=TTL))
    # The same hosts agreeing on the database's clock: the row is fresh.
    behind = Ledger.open(ledger_target, policy=Policy(pending_ttl_ms=TTL), clock="database")
    try:
        fresh = behind.handle("acct", "k2", "POST", "/o", {}, b"x", ok())
        assert fresh.outcome is Outcome.EXECUTED
        behind_view = behind.operator.get("acct", "k2")
        assert abs(behind_view.row.updated_at - wall_clock_ms()) < 60_000  # the database's now, not a skewed one
        stalled = behind.begin("acct", "k3", "POST", "/o", {}, b"x")
        assert stalled.outcome is Outcome.EXECUTED
        ahead = Ledger.open(ledger_target, policy=Policy(pending_ttl_ms=TTL), clock="database")
        try:
            assert ahead.handle("acct", "k3", "POST", "/o", {}, b"x", ok()).outcome is Outcome.IN_PROGRESS
        finally:
            ahead.close()
        assert own.handle("acct", "k", "POST", "/o", {}, b"x", ok()).outcome is Outcome.TAKEN_OVER
        assert own.lookup("acct", "k").status is Status.COMPLETED
    finally:
        own.close()
        behind.close()
