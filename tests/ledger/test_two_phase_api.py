"""`Ledger.begin` / `finish` / `abandon`: the request API every adapter shares."""

from __future__ import annotations

import sqlite3

import pytest

from idemctl import AnswerNotStoredError, Ledger, Outcome, Policy, Status, Ticket, fingerprint
from idemctl.errors import DatabaseLockedError

JSON = {"content-type": "application/json"}


def test_begin_gives_a_ticket_then_finish_stores_and_a_retry_is_answered_at_once(ledger):
    ticket = ledger.begin("acct", "k", "POST", "/orders", JSON, b'{"sku":"x"}')
    assert isinstance(ticket, Ticket)
    assert (ticket.outcome, ticket.body, ticket.reservation.generation) == (Outcome.EXECUTED, b'{"sku":"x"}', 1)
    assert ticket.reservation.fingerprint == fingerprint("POST", "/orders", JSON, b'{"sku":"x"}')
    answer = ledger.finish(ticket, 201, {"Content-Type": "application/json", "X-Other": "dropped"}, b'{"id":7}')
    assert (answer.status, answer.headers, answer.body, answer.outcome, answer.generation) == (
        201,
        (("content-type", "application/json"),),
        b'{"id":7}',
        Outcome.EXECUTED,
        1,
    )
    assert answer.started_at == ticket.started_at
    replay = ledger.begin("acct", "k", "POST", "/orders", JSON, b'{"sku":"x"}')
    assert (replay.outcome, replay.status, replay.headers, replay.body) == (
        Outcome.REPLAYED,
        answer.status,
        answer.headers,
        answer.body,
    )
    in_use = ledger.begin("acct", "k", "POST", "/orders", JSON, b'{"sku":"y"}')
    assert (in_use.outcome, in_use.status) == (Outcome.REUSED, 409)


def test_begin_answers_400_401_and_409_in_progress_without_a_ticket(ledger):
    assert ledger.begin(None, "k", "POST", "/", {}, b"").outcome is Outcome.UNAUTHENTICATED
    assert ledger.begin("acct", None, "POST", "/", {}, b"").outcome is Outcome.KEY_REQUIRED
    assert ledger.begin("acct", "bad\n", "POST", "/", {}, b"").outcome is Outcome.KEY_INVALID
    first = ledger.begin("acct", "k", "POST", "/", {}, b"")
    second = ledger.begin("acct", "k", "POST", "/", {}, b"")
    assert isinstance(first, Ticket)
    assert (second.outcome, second.status, second.header("Retry-After")) == (Outcome.IN_PROGRESS, 409, "30")
    assert ledger.operator.stats().total == 1


def test_an_unprotected_method_gets_a_ticket_that_stores_nothing(ledger):
    ticket = ledger.begin(None, None, "GET", "/orders", {}, b"")
    assert (ticket.reservation, ticket.outcome, ticket.started_at) == (None, Outcome.PASSTHROUGH, None)
    answer = ledger.finish(ticket, 200, [("X-Any", "kept")], "text")
    assert (answer.status, answer.headers, answer.body, answer.outcome) == (
        200,
        (("X-Any", "kept"),),
        b"text",
        Outcome.PASSTHROUGH,
    )
    assert ledger.operator.stats().total == 0
    assert ledger.after_response(answer) is None


def test_a_stale_ticket_taken_over_finishes_fenced_out_and_the_event_is_recorded(make_ledger, clock):
    ledger = make_ledger(policy=Policy(pending_ttl_ms=1_000))
    late = ledger.begin("acct", "k", "POST", "/", {}, b"x")
    clock.advance(1_001)
    newer = ledger.begin("acct", "k", "POST", "/", {}, b"x")
    assert newer.outcome is Outcome.TAKEN_OVER and newer.reservation.generation == 2
    assert ledger.finish(newer, 201, {}, b"newer").outcome is Outcome.TAKEN_OVER
    fenced = ledger.finish(late, 201, {}, b"late")
    assert (fenced.outcome, fenced.body, fenced.generation) == (Outcome.FENCED_OUT, b"late", 1)
    assert [(e.superseded_generation, e.current_generation) for e in ledger.operator.fenced()] == [(1, 2)]
    assert ledger.lookup("acct", "k").body_bytes == b"newer"


def test_abandon_keeps_the_reservation_for_a_takeover_unless_asked_to_release(ledger):
    kept = ledger.begin("acct", "kept", "POST", "/", {}, b"")
    ledger.abandon(kept)
    assert ledger.lookup("acct", "kept").status is Status.PENDING
    released = ledger.begin("acct", "gone", "POST", "/", {}, b"")
    ledger.abandon(released, release=True)
    assert ledger.lookup("acct", "gone") is None
    assert isinstance(ledger.begin("acct", "gone", "POST", "/", {}, b""), Ticket)


def test_an_answer_that_cannot_be_stored_raises_with_the_answer_the_app_computed(tmp_path):
    path = tmp_path / "ledger.db"
    ledger = Ledger.open(path, busy_timeout_ms=50)
    ledger.init()
    ticket = ledger.begin("acct", "k", "POST", "/", {}, b"")
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process holds the write lock past the busy timeout
    try:
        with pytest.raises(AnswerNotStoredError) as info:
            ledger.finish(ticket, 201, {"Location": "/orders/1", "X-Internal": "x"}, b"made")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    answer = info.value.answer
    assert (answer.status, answer.headers, answer.body, answer.outcome) == (
        201,
        (("location", "/orders/1"),),
        b"made",
        Outcome.EXECUTED,
    )
    assert isinstance(info.value.cause, DatabaseLockedError)
    assert ledger.lookup("acct", "k").status is Status.PENDING  # a takeover after the TTL recovers it
    ledger.close()


def test_the_single_step_complete_raises_the_storage_error_itself(tmp_path):
    path = tmp_path / "ledger.db"
    ledger = Ledger.open(path, busy_timeout_ms=50)
    ledger.init()
    reservation = ledger.claim("acct", "k", "fp")
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(DatabaseLockedError):
            ledger.complete(reservation, 201, {}, b"")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    ledger.close()
