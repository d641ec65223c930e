"""A stalled owner that completes after a takeover is fenced out."""

from __future__ import annotations

import logging
import threading

from idemctl import Outcome, Status, fingerprint

HEADERS = {"Content-Type": "application/json"}
BODY = b'{"amount":100}'
FP = fingerprint("POST", "/charges", HEADERS, BODY)


def test_late_generation_1_completion_is_rejected_logged_and_recorded(ledger, clock, caplog):
    a = ledger.claim("acct_A", "k-1", FP)
    clock.advance(30_001)
    b = ledger.takeover("acct_A", "k-1", FP)
    assert (a.generation, b.generation) == (1, 2)
    clock.advance(100)
    done_b = ledger.complete(b, 201, {"Content-Type": "application/json"}, b'{"charge":"B"}')
    assert done_b.stored is True
    clock.advance(100)
    with caplog.at_level(logging.ERROR, logger="idemctl"):
        done_a = ledger.complete(a, 201, {"Content-Type": "application/json"}, b'{"charge":"A"}')
    # A still gets its own computed answer...
    assert done_a.stored is False
    assert (done_a.status, done_a.body) == (201, b'{"charge":"A"}')
    assert done_a.headers == (("content-type", "application/json"),)
    # ...but the ledger keeps B's.
    row = ledger.lookup("acct_A", "k-1")
    assert (row.status, row.generation, row.response_body) == (Status.COMPLETED, 2, '{"charge":"B"}')
    # Logged at ERROR on the idemctl logger.
    records = [r for r in caplog.records if r.name == "idemctl" and r.levelno == logging.ERROR]
    assert len(records) == 1
    assert "fenced out: principal=acct_A key=k-1 generation=1 was superseded by generation 2" in records[0].getMessage()
    # Recorded durably.
    events = list(ledger.fenced())
    assert len(events) == 1
    e = events[0]
    assert (e.principal, e.key, e.superseded_generation, e.current_generation, e.computed_status, e.fenced_at) == (
        "acct_A",
        "k-1",
        1,
        2,
        201,
        clock.now,
    )
    assert done_a.event == e


def test_fenced_owner_before_new_owner_completes_cannot_steal_the_row(ledger, clock):
    a = ledger.claim("acct_A", "k-1", FP)
    clock.advance(30_001)
    b = ledger.takeover("acct_A", "k-1", FP)
    assert ledger.complete(a, 200, {}, b"A").stored is False
    row = ledger.lookup("acct_A", "k-1")
    assert (row.status, row.generation, row.response_status) == (Status.PENDING, 2, None)
    assert ledger.complete(b, 200, {}, b"B").stored is True
    assert ledger.lookup("acct_A", "k-1").response_body == "B"


def test_through_handle_the_replay_returns_the_new_owners_answer(ledger, clock):
    """Worker A stalls inside its mutation; B takes over and completes; A wakes up."""
    a_inside = threading.Event()
    a_release = threading.Event()
    results = {}

    def slow_a(body):
        a_inside.set()
        assert a_release.wait(10)
        return 201, {"Content-Type": "application/json"}, b'{"by":"A"}'

    def run_a():
        results["a"] = ledger.handle("acct_A", "k-1", "POST", "/charges", HEADERS, BODY, slow_a)

    t = threading.Thread(target=run_a)
    t.start()
    assert a_inside.wait(10)
    clock.advance(30_001)
    b = ledger.handle(
        "acct_A",
        "k-1",
        "POST",
        "/charges",
        HEADERS,
        BODY,
        lambda body: (201, {"Content-Type": "application/json"}, b'{"by":"B"}'),
    )
    assert (b.outcome, b.generation, b.body) == (Outcome.TAKEN_OVER, 2, b'{"by":"B"}')
    a_release.set()
    t.join(10)
    a = results["a"]
    assert (a.outcome, a.generation, a.body) == (Outcome.FENCED_OUT, 1, b'{"by":"A"}')
    replay = ledger.handle("acct_A", "k-1", "POST", "/charges", HEADERS, BODY, lambda body: (500, {}, b"never"))
    assert (replay.outcome, replay.body) == (Outcome.REPLAYED, b'{"by":"B"}')
    assert [(e.superseded_generation, e.current_generation) for e in ledger.fenced(principal="acct_A", key="k-1")] == [
        (1, 2)
    ]


def test_completion_of_a_released_row_is_fenced_with_no_current_generation(ledger):
    a = ledger.claim("acct_A", "k-1", FP)
    assert ledger.release(a) is True
    done = ledger.complete(a, 200, {}, b"late")
    assert done.stored is False
    assert done.event.current_generation is None
    assert ledger.lookup("acct_A", "k-1") is None


def test_double_completion_by_the_same_owner_is_fenced_and_keeps_the_first(ledger):
    a = ledger.claim("acct_A", "k-1", FP)
    assert ledger.complete(a, 200, {}, b"first").stored is True
    assert ledger.complete(a, 200, {}, b"second").stored is False
    assert ledger.lookup("acct_A", "k-1").response_body == "first"
