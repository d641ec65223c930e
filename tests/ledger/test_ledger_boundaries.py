"""The exact edges: TTL, retention and the stored body cap."""

from __future__ import annotations

import pytest

from idemctl import Outcome, Policy, State, Status, fingerprint
from idemctl.responses import not_stored

HEADERS = {"Content-Type": "application/json"}
BODY = b"{}"
FP = fingerprint("POST", "/orders", HEADERS, BODY)


def answer_with(body: bytes, status: int = 200, content_type: str = "text/plain"):
    calls = []

    def run(request_body):
        calls.append(request_body)
        return status, {"Content-Type": content_type}, body

    run.calls = calls  # type: ignore[attr-defined]
    return run


def post(ledger, run, key="k-1"):
    return ledger.handle("acct_A", key, "POST", "/orders", HEADERS, BODY, run)


def test_pending_row_exactly_ttl_old_is_still_in_progress(ledger, clock):
    ledger.claim("acct_A", "k-1", FP)
    clock.advance(30_000)
    assert ledger.operator.get("acct_A", "k-1").state is State.PENDING_FRESH
    assert post(ledger, answer_with(b"x")).outcome is Outcome.IN_PROGRESS
    assert ledger.lookup("acct_A", "k-1").generation == 1


def test_pending_row_one_millisecond_past_ttl_is_taken_over(ledger, clock):
    ledger.claim("acct_A", "k-1", FP)
    clock.advance(30_001)
    assert ledger.operator.get("acct_A", "k-1").state is State.PENDING_STALE
    answer = post(ledger, answer_with(b"x"))
    assert (answer.outcome, answer.generation) == (Outcome.TAKEN_OVER, 2)


def test_takeover_restarts_the_ttl_so_a_second_takeover_needs_another_full_ttl(ledger, clock):
    ledger.claim("acct_A", "k-1", FP)
    clock.advance(30_001)
    assert ledger.takeover("acct_A", "k-1", FP).generation == 2
    clock.advance(30_000)
    assert ledger.takeover("acct_A", "k-1", FP) is None
    clock.advance(1)
    assert ledger.takeover("acct_A", "k-1", FP).generation == 3


def test_takeover_never_touches_a_completed_row(ledger, clock):
    post(ledger, answer_with(b"done"))
    clock.advance(10 * 60_000)
    assert ledger.takeover("acct_A", "k-1", FP) is None
    assert ledger.lookup("acct_A", "k-1").generation == 1


def test_row_exactly_retention_old_is_kept_one_ms_older_is_swept(ledger, clock):
    post(ledger, answer_with(b"done"))
    created = clock.now
    clock.advance(86_400_000)
    assert ledger.operator.sweep().keys_deleted == 0
    assert ledger.operator.get("acct_A", "k-1").state is State.COMPLETED
    clock.advance(1)
    assert ledger.operator.get("acct_A", "k-1").state is State.EXPIRED
    result = ledger.operator.sweep()
    assert (result.keys_deleted, result.cutoff) == (1, created + 1)
    assert ledger.lookup("acct_A", "k-1") is None


def test_completion_time_not_claim_time_starts_the_retention(ledger, clock):
    fp = FP
    res = ledger.claim("acct_A", "k-1", fp)
    clock.advance(20_000)
    ledger.complete(res, 201, {}, b"ok")
    clock.advance(86_400_000 - 20_000 + 1)
    assert ledger.operator.sweep().keys_deleted == 0
    clock.advance(20_000)
    assert ledger.operator.sweep().keys_deleted == 1


def test_body_of_exactly_the_cap_is_stored(ledger):
    body = b"x" * 16_384
    answer = post(ledger, answer_with(body))
    assert (answer.status, len(answer.body)) == (200, 16_384)
    row = ledger.lookup("acct_A", "k-1")
    assert row.response_status == 200
    assert row.response_body == "x" * 16_384


def test_body_one_byte_over_the_cap_becomes_the_500_sentinel(ledger):
    answer = post(ledger, answer_with(b"x" * 16_385))
    # The ledger's own JSON error, not the app's text/plain over a body that is not there.
    assert answer.wire == not_stored()
    assert answer.headers == (("content-type", "application/json"),)
    row = ledger.lookup("acct_A", "k-1")
    assert (row.status, row.response_status, row.response_body) == (Status.COMPLETED, 500, None)
    assert row.response_headers == '{"content-type":"text/plain"}'  # the row is as before
    replay = post(ledger, answer_with(b"never"))
    assert (replay.outcome, replay.wire) == (Outcome.REPLAYED, not_stored())
    assert replay.wire == answer.wire


def test_cap_counts_utf8_bytes_not_characters(ledger):
    euros = "€" * 6_000  # 6 000 characters, 18 000 UTF-8 bytes
    answer = post(ledger, answer_with(euros.encode("utf-8")))
    assert answer.status == 500
    assert ledger.lookup("acct_A", "k-1").response_body is None


def test_utf8_body_just_under_the_cap_is_kept_whole(ledger):
    body = ("€" * 5_461).encode("utf-8")  # 16 383 bytes
    answer = post(ledger, answer_with(body))
    assert (answer.status, answer.body) == (200, body)


def test_custom_body_cap(make_ledger):
    ledger = make_ledger(policy=Policy(body_cap_bytes=10))
    assert post(ledger, answer_with(b"0123456789"), key="a").status == 200
    assert post(ledger, answer_with(b"0123456789A"), key="b").status == 500


@pytest.mark.parametrize("status", [204, 205, 304])
def test_null_body_statuses_never_carry_a_body(ledger, status):
    answer = post(ledger, answer_with(b"should not be sent", status=status))
    assert (answer.status, answer.body) == (status, b"")
    replay = post(ledger, answer_with(b"x"))
    assert (replay.outcome, replay.status, replay.body) == (Outcome.REPLAYED, status, b"")
