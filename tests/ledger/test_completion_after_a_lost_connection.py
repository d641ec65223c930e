"""A completion whose connection is lost is stored again on a fresh one.

The fenced completion is safe to repeat, so a connection-level failure
(ConnectionFailedError) while storing an answer is retried within a bound,
on every engine. These tests put the failure exactly where it matters by
wrapping the store's `complete`: lost before the statement reached the
server, lost after it committed (the reply never came back), lost while a
takeover fenced the owner out. The real thing (a backend terminated, a
connection KILLed) is in tests/storage/test_lost_connection_completion.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from idemctl import AnswerNotStoredError, Ledger, Outcome, Policy, Status, Ticket
from idemctl.errors import ConnectionFailedError, DatabaseLockedError
from idemctl.ledger import steps
from tests.helpers import FakeClock, wrap_store_run

BODY = b'{"sku":"x"}'
HEADERS = {"content-type": "application/json", "location": "/orders/1"}
ANSWER = b'{"id":1}'


def lost(what: str = "server closed the connection unexpectedly") -> ConnectionFailedError:
    return ConnectionFailedError(f"cannot reach the database: {what}")


def wrap_complete(ledger: Ledger, before: Callable[[int], None], after: Callable[[int], None]) -> list[str]:
    """The store's COMPLETE, with `before(n)` and `after(n)` run around the
    n-th one (from 1); the steps run from then on, in order, of those that
    store the answer (COMPLETE, COMPLETED_AS)."""
    calls: list[str] = []

    def around(step: str | None, run: Callable[[], Any]) -> Any:
        if step not in ("complete", "completed_as"):
            return run()
        calls.append(step)
        if step == "completed_as":
            return run()
        n = calls.count("complete")
        before(n)
        ok = run()
        after(n)
        return ok

    wrap_store_run(ledger.store, around)
    return calls


def nothing(n: int) -> None:
    pass


def lose_the_first(n: int) -> None:
    """The connection is lost at the first COMPLETE (before it reaches the
    server, or after it committed, by where it is passed to wrap_complete)."""
    if n == 1:
        raise lost()


def begin(ledger: Ledger, key: str = "k1") -> Ticket:
    ticket = ledger.begin("acct", key, "POST", "/orders", {}, BODY)
    assert isinstance(ticket, Ticket)
    return ticket


def replay_after_the_ttl(
    ledger: Ledger, clock: FakeClock, key: str = "k1"
) -> tuple[int, tuple[tuple[str, str], ...], bytes]:
    clock.advance(ledger.policy.pending_ttl_ms + 1)
    again = ledger.begin("acct", key, "POST", "/orders", {}, BODY)
    assert not isinstance(again, Ticket), "the retry was handed the mutation again"
    assert again.outcome is Outcome.REPLAYED
    return again.wire


def test_a_completion_lost_before_it_reached_the_server_is_stored_on_a_fresh_connection(make_ledger, clock) -> None:
    ledger = make_ledger()
    ticket = begin(ledger)

    calls = wrap_complete(ledger, lose_the_first, nothing)
    answer = ledger.finish(ticket, 201, HEADERS, ANSWER)
    assert calls == ["complete", "complete"]
    assert (answer.outcome, answer.status, answer.body) == (Outcome.EXECUTED, 201, ANSWER)
    row = ledger.lookup("acct", "k1")
    assert row is not None and (row.status, row.response_status, row.generation) == (Status.COMPLETED, 201, 1)
    assert replay_after_the_ttl(ledger, clock) == answer.wire


def test_a_completion_that_committed_before_its_reply_was_lost_is_a_success_not_a_fence(make_ledger, clock) -> None:
    # The first COMPLETE commits and the connection dies before the reply:
    # COMPLETE again finds the row no longer pending, and the read tells
    # "stored by me" (our generation, token and answer) from a takeover.
    ledger = make_ledger()
    ticket = begin(ledger)

    calls = wrap_complete(ledger, nothing, lose_the_first)
    answer = ledger.finish(ticket, 201, HEADERS, ANSWER)
    assert calls == ["complete", "complete", "completed_as"]
    assert answer.outcome is Outcome.EXECUTED
    assert list(ledger.operator.fenced(principal="acct")) == []
    assert replay_after_the_ttl(ledger, clock) == answer.wire


def test_an_oversize_answer_whose_reply_was_lost_is_stored_as_its_sentinel_not_fenced(make_ledger, clock) -> None:
    # The sentinel stores no body (NULL): the read that recognises our own
    # committed try must match it too.
    ledger = make_ledger(policy=Policy(body_cap_bytes=16))
    ticket = begin(ledger)

    calls = wrap_complete(ledger, nothing, lose_the_first)
    answer = ledger.finish(ticket, 201, HEADERS, b"x" * 64)
    assert calls == ["complete", "complete", "completed_as"]
    assert (answer.outcome, answer.status) == (Outcome.EXECUTED, 500)
    row = ledger.lookup("acct", "k1")
    assert row is not None and (row.status, row.response_status, row.response_body) == (Status.COMPLETED, 500, None)
    assert list(ledger.operator.fenced(principal="acct")) == []


def test_a_completion_lost_while_a_takeover_moved_the_row_on_is_fenced_out(make_ledger, clock) -> None:
    ledger = make_ledger()
    other = make_ledger()
    ticket = begin(ledger)
    taken: list[Ticket] = []

    def taken_over_meanwhile(n: int) -> None:
        if n == 1:
            clock.advance(ledger.policy.pending_ttl_ms + 1)
            taken.append(begin(other))
            raise lost()

    calls = wrap_complete(ledger, taken_over_meanwhile, nothing)
    answer = ledger.finish(ticket, 201, HEADERS, b'{"id":"late"}')
    assert calls == ["complete", "complete", "completed_as"]
    assert (answer.outcome, answer.body) == (Outcome.FENCED_OUT, b'{"id":"late"}')
    (new_owner,) = taken
    assert new_owner.outcome is Outcome.TAKEN_OVER
    assert other.finish(new_owner, 201, HEADERS, ANSWER).outcome is Outcome.TAKEN_OVER
    assert [e.superseded_generation for e in ledger.operator.fenced(principal="acct")] == [1]
    assert replay_after_the_ttl(ledger, clock)[2] == ANSWER


def test_a_second_completion_with_another_answer_is_not_taken_for_the_stored_one(make_ledger) -> None:
    ledger = make_ledger()
    reservation = ledger.claim("acct", "k1", "fp")
    assert reservation is not None
    assert ledger.complete(reservation, 201, {}, b"first").stored

    wrap_complete(ledger, lose_the_first, nothing)
    assert ledger.complete(reservation, 201, {}, b"second").stored is False
    row = ledger.lookup("acct", "k1")
    assert row is not None and row.response_body == "first"


@pytest.mark.parametrize(
    "failure",
    [DatabaseLockedError("the row was locked past the busy timeout"), ValueError("a bug")],
    ids=["locked", "not-storage"],
)
def test_only_a_lost_connection_is_retried(make_ledger, failure: Exception) -> None:
    ledger = make_ledger()
    ticket = begin(ledger)

    def fail(n: int) -> None:
        raise failure

    calls = wrap_complete(ledger, fail, nothing)
    with pytest.raises((AnswerNotStoredError, ValueError)):
        ledger.finish(ticket, 201, HEADERS, ANSWER)
    assert calls == ["complete"]
    row = ledger.lookup("acct", "k1")
    assert row is not None and row.status is Status.PENDING


def test_a_connection_lost_on_every_try_gives_up_after_the_bound_with_the_answer(
    make_ledger, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = make_ledger()
    ticket = begin(ledger)

    def fail(n: int) -> None:
        raise lost(f"try {n}")

    calls = wrap_complete(ledger, fail, nothing)
    started = time.monotonic()
    with pytest.raises(AnswerNotStoredError) as caught:
        ledger.finish(ticket, 201, HEADERS, ANSWER)
    spent = time.monotonic() - started
    assert calls == ["complete"] * (1 + len(steps.STORE_RETRY_PAUSES_S))
    assert isinstance(caught.value.cause, ConnectionFailedError)
    assert str(caught.value.cause).endswith(f"try {1 + len(steps.STORE_RETRY_PAUSES_S)}")
    assert caught.value.answer.wire == (201, (("content-type", "application/json"), ("location", "/orders/1")), ANSWER)
    # The pauses between tries, and a generous slack for a loaded machine.
    assert sum(steps.STORE_RETRY_PAUSES_S) <= spent < steps.STORE_RETRY_WITHIN_S + 5


def test_no_try_starts_past_the_time_bound(make_ledger, monkeypatch: pytest.MonkeyPatch) -> None:
    # A try that itself takes long (a connect timeout) uses up the bound:
    # no further one starts once it has passed.
    monkeypatch.setattr(steps, "STORE_RETRY_PAUSES_S", (0.0, 0.0, 0.0, 0.0))
    monkeypatch.setattr(steps, "STORE_RETRY_WITHIN_S", 0.1)
    ledger = make_ledger()
    ticket = begin(ledger)

    def slow_failure(n: int) -> None:
        time.sleep(0.2)
        raise lost()

    calls = wrap_complete(ledger, slow_failure, nothing)
    with pytest.raises(AnswerNotStoredError):
        ledger.finish(ticket, 201, HEADERS, ANSWER)
    assert calls == ["complete", "complete"]


def test_the_database_clock_lost_before_the_completion_is_asked_again(make_ledger, ledger_target: str) -> None:
    make_ledger()  # the schema
    ledger = Ledger.open(ledger_target, clock="database")
    try:
        ticket = begin(ledger)
        asked: list[int] = []

        def around(step: str | None, run: Callable[[], Any]) -> Any:
            # The database's clock is a statement the loop yields, like any other.
            if step == "database_now":
                asked.append(1)
                if len(asked) == 1:
                    raise lost()
            return run()

        wrap_store_run(ledger.store, around)
        answer = ledger.finish(ticket, 201, HEADERS, ANSWER)
        assert answer.outcome is Outcome.EXECUTED and len(asked) == 2
        row = ledger.lookup("acct", "k1")
        assert row is not None and row.status is Status.COMPLETED
    finally:
        ledger.close()
