"""Every row of SPEC §1, through `Ledger.handle`, with exact answers."""

from __future__ import annotations

import json
import logging

import pytest

from idemctl import Outcome, Policy, State, Status, fingerprint
from idemctl.errors import InvalidBodyError
from tests.helpers import wrap_store_run

# A Redis Cluster runs this module too (tests/conftest.py, CLUSTER_OPT_IN).
ON_REDIS_CLUSTER = True

# The PostgreSQL tests run through PgBouncer (session and transaction pooling) too.
THROUGH_PGBOUNCER = True

JSON = ("content-type", "application/json")
HEADERS = {"Content-Type": "application/json"}
BODY = b'{"sku":"widget","qty":1}'


class Mutation:
    """A mutation that counts its runs and answers like a create endpoint."""

    def __init__(self, status: int = 201, body: bytes = b'{"id":1}', headers=None) -> None:
        self.calls: list[bytes] = []
        self.status = status
        self.body = body
        self.headers = (
            headers
            if headers is not None
            else [
                ("Content-Type", "application/json"),
                ("Location", "/orders/1"),
                ("X-Request-Id", "not-replayed"),
                ("Set-Cookie", "session=secret"),
            ]
        )

    def __call__(self, body: bytes):
        self.calls.append(body)
        return self.status, self.headers, self.body


def post(ledger, run, *, principal="acct_A", key="k-1", body=BODY, headers=HEADERS, method="POST", path="/orders"):
    return ledger.handle(principal, key, method, path, headers, body, run)


def test_first_request_runs_once_and_answers_from_what_was_stored(ledger, clock):
    run = Mutation()
    answer = post(ledger, run)
    assert run.calls == [BODY]
    assert answer.outcome is Outcome.EXECUTED
    assert answer.generation == 1
    assert answer.status == 201
    # Only the allowlisted headers survive, lower-cased as stored.
    assert answer.headers == (("content-type", "application/json"), ("location", "/orders/1"))
    assert answer.body == b'{"id":1}'
    assert answer.started_at == clock.now
    row = ledger.lookup("acct_A", "k-1")
    assert row.status is Status.COMPLETED
    assert row.generation == 1
    assert row.response_status == 201
    assert row.response_body == '{"id":1}'
    assert json.loads(row.response_headers) == {"content-type": "application/json", "location": "/orders/1"}
    assert row.response_headers == '{"content-type":"application/json","location":"/orders/1"}'
    assert row.fingerprint == fingerprint("POST", "/orders", HEADERS, BODY)
    assert row.created_at == clock.now


def test_retry_of_completed_request_is_replayed_byte_for_byte_without_running(ledger, clock):
    run = Mutation()
    first = post(ledger, run)
    clock.advance(5_000)
    again = post(ledger, run)
    assert len(run.calls) == 1
    assert again.outcome is Outcome.REPLAYED
    assert (again.status, again.headers, again.body) == (first.status, first.headers, first.body)
    assert again.wire == first.wire


def test_missing_key_is_400_required_and_nothing_runs(ledger):
    run = Mutation()
    for key in (None, ""):
        answer = post(ledger, run, key=key)
        assert answer.status == 400
        assert answer.headers == (JSON,)
        assert answer.body == b'{"error":"idempotency_key_required"}'
        assert answer.outcome is Outcome.KEY_REQUIRED
    assert run.calls == []
    assert ledger.operator.stats().total == 0


@pytest.mark.parametrize("key", ["abc\n", "abc\r\n", "\tabc", "café", "\x7f", "a\x00b", "a" * 256])
def test_invalid_key_is_400_invalid_and_nothing_is_written(ledger, key):
    run = Mutation()
    answer = post(ledger, run, key=key)
    assert answer.status == 400
    assert answer.headers == (JSON,)
    assert answer.body == (
        b'{"error":"idempotency_key_invalid","message":"Idempotency-Key must be 1-255 printable ASCII characters."}'
    )
    assert run.calls == []
    assert ledger.operator.stats().total == 0


def test_key_of_255_characters_is_accepted(ledger):
    run = Mutation()
    assert post(ledger, run, key="a" * 255).status == 201
    assert len(run.calls) == 1


@pytest.mark.parametrize("principal", [None, ""])
def test_no_principal_is_401_and_never_a_shared_namespace(ledger, principal):
    run = Mutation()
    answer = post(ledger, run, principal=principal)
    assert answer.status == 401
    assert answer.headers == (JSON,)
    assert json.loads(answer.body) == {
        "error": "unauthenticated",
        "message": "No authenticated principal for this request.",
    }
    assert run.calls == []
    assert ledger.operator.stats().total == 0


def test_same_key_different_body_is_409_reused_and_nothing_replayed(ledger):
    run = Mutation()
    post(ledger, run)
    answer = post(ledger, run, body=b'{"sku":"other"}')
    assert answer.status == 409
    assert answer.headers == (JSON,)
    assert answer.body == b'{"error":"idempotency_key_reused"}'
    assert answer.outcome is Outcome.REUSED
    assert len(run.calls) == 1


@pytest.mark.parametrize(
    "change",
    [
        {"path": "/orders?x=1"},
        {"method": "PATCH"},
        {"headers": {"Content-Type": "text/plain"}},
        {"headers": {"Content-Type": "application/json", "X-Api-Version": "2"}},
    ],
)
def test_any_fingerprinted_difference_is_reuse(ledger, change):
    run = Mutation()
    post(ledger, run)
    assert post(ledger, run, **change).outcome is Outcome.REUSED
    assert len(run.calls) == 1


def test_headers_outside_the_fingerprint_list_do_not_make_a_retry_a_reuse(ledger):
    run = Mutation()
    post(ledger, run, headers={"Content-Type": "application/json", "User-Agent": "a", "X-Trace-Id": "1"})
    again = post(ledger, run, headers={"content-type": "application/json", "User-Agent": "b"})
    assert again.outcome is Outcome.REPLAYED
    assert len(run.calls) == 1


def test_reuse_status_422_when_policy_says_so(make_ledger):
    ledger = make_ledger(policy=Policy(reuse_status=422))
    run = Mutation()
    post(ledger, run)
    answer = post(ledger, run, body=b"{}")
    assert answer.status == 422
    assert answer.body == b'{"error":"idempotency_key_reused"}'


def test_retry_while_pending_is_409_in_progress_with_retry_after(ledger, clock):
    reservation = ledger.claim("acct_A", "k-1", fingerprint("POST", "/orders", HEADERS, BODY))
    assert reservation.generation == 1
    run = Mutation()
    clock.advance(1_000)
    answer = post(ledger, run)
    assert answer.status == 409
    assert answer.headers == (JSON, ("retry-after", "30"))
    assert answer.body == b'{"error":"idempotency_key_in_progress","retry_after_ms":30000}'
    assert answer.outcome is Outcome.IN_PROGRESS
    assert run.calls == []
    assert ledger.lookup("acct_A", "k-1").generation == 1


def test_in_progress_retry_after_follows_the_policy_ttl(make_ledger):
    ledger = make_ledger(policy=Policy(pending_ttl_ms=1_500))
    ledger.claim("acct_A", "k-1", fingerprint("POST", "/orders", HEADERS, BODY))
    answer = post(ledger, Mutation())
    assert answer.headers == (JSON, ("retry-after", "2"))
    assert answer.body == b'{"error":"idempotency_key_in_progress","retry_after_ms":1500}'


def test_pending_row_with_other_fingerprint_is_reuse_not_in_progress(ledger):
    ledger.claim("acct_A", "k-1", "some-other-fingerprint")
    assert post(ledger, Mutation()).outcome is Outcome.REUSED


def test_stale_pending_is_taken_over_with_generation_2(ledger, clock, caplog):
    fp = fingerprint("POST", "/orders", HEADERS, BODY)
    ledger.claim("acct_A", "k-1", fp)
    clock.advance(30_001)
    run = Mutation()
    with caplog.at_level(logging.WARNING, logger="idemctl"):
        answer = post(ledger, run)
    assert answer.outcome is Outcome.TAKEN_OVER
    assert answer.generation == 2
    assert answer.status == 201
    assert run.calls == [BODY]
    row = ledger.lookup("acct_A", "k-1")
    assert (row.status, row.generation, row.response_status) == (Status.COMPLETED, 2, 201)
    assert "took over stale reservation principal=acct_A key=k-1 as generation 2" in caplog.text


def test_row_vanishing_between_claim_and_lookup_is_409_retry(ledger, monkeypatch):
    # The window is a few microseconds wide in production; force it: the
    # claim lost and saw no row (on PostgreSQL, one committed while it
    # waited), and the lookup after it finds nothing either.
    ledger.claim("acct_A", "k-1", fingerprint("POST", "/orders", HEADERS, BODY))
    wrap_store_run(ledger.store, lambda step, run: None if step in ("claim_or_read", "claim", "lookup") else run())
    run = Mutation()
    answer = post(ledger, run)
    assert answer.status == 409
    assert answer.headers == (JSON,)
    assert answer.body == b'{"error":"idempotency_key_retry","message":"Retry the request."}'
    assert answer.outcome is Outcome.RETRY
    assert run.calls == []


@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS", "PUT"])
def test_unprotected_methods_pass_through_untouched(ledger, method):
    run = Mutation(headers=[("X-Custom", "kept"), ("Set-Cookie", "a=b")])
    answer = ledger.handle("acct_A", None, method, "/orders", {}, b"", run)
    assert answer.outcome is Outcome.PASSTHROUGH
    assert answer.headers == (("X-Custom", "kept"), ("Set-Cookie", "a=b"))
    assert answer.started_at is None
    assert len(run.calls) == 1
    answer = ledger.handle("acct_A", None, method, "/orders", {}, b"", run)
    assert len(run.calls) == 2
    assert ledger.operator.stats().total == 0


def test_protected_methods_come_from_policy(make_ledger):
    ledger = make_ledger(policy=Policy(protected_methods={"PUT"}))
    assert ledger.handle("acct_A", None, "PUT", "/o", {}, b"", Mutation()).status == 400
    assert ledger.handle("acct_A", None, "POST", "/o", {}, b"", Mutation()).outcome is Outcome.PASSTHROUGH


def test_principals_are_isolated_same_key_same_request_two_executions(ledger):
    run = Mutation()
    a = post(ledger, run, principal="acct_A")
    b = post(ledger, run, principal="acct_B")
    assert a.outcome is Outcome.EXECUTED and b.outcome is Outcome.EXECUTED
    assert len(run.calls) == 2
    assert ledger.lookup("acct_A", "k-1").generation == 1
    assert ledger.lookup("acct_B", "k-1").generation == 1
    assert ledger.operator.stats().total == 2


def test_principals_are_isolated_pending_of_one_never_blocks_the_other(ledger):
    ledger.claim("acct_A", "k-1", fingerprint("POST", "/orders", HEADERS, BODY))
    run = Mutation()
    assert post(ledger, run, principal="acct_B").outcome is Outcome.EXECUTED
    # A different request from B with the same key is B's own business, not A's.
    assert post(ledger, run, principal="acct_B", body=b"{}").outcome is Outcome.REUSED
    assert post(ledger, run, principal="acct_A").outcome is Outcome.IN_PROGRESS
    assert ledger.operator.get("acct_A", "k-1").state is State.PENDING_FRESH
    assert len(run.calls) == 1


def test_mutation_that_raises_leaves_the_row_pending(ledger, clock):
    def boom(body):
        raise RuntimeError("card network down")

    with pytest.raises(RuntimeError, match="card network down"):
        post(ledger, boom)
    row = ledger.lookup("acct_A", "k-1")
    assert (row.status, row.generation, row.response_status) == (Status.PENDING, 1, None)
    assert post(ledger, Mutation()).outcome is Outcome.IN_PROGRESS
    clock.advance(30_001)
    assert post(ledger, Mutation()).outcome is Outcome.TAKEN_OVER


def test_release_on_error_deletes_the_reservation_so_the_retry_runs(ledger):
    def boom(body):
        raise ValueError("rolled back")

    with pytest.raises(ValueError):
        ledger.handle("acct_A", "k-1", "POST", "/orders", HEADERS, BODY, boom, release_on_error=True)
    assert ledger.lookup("acct_A", "k-1") is None
    run = Mutation()
    assert post(ledger, run).outcome is Outcome.EXECUTED
    assert len(run.calls) == 1


def test_release_is_fenced_by_generation(ledger, clock):
    fp = fingerprint("POST", "/orders", HEADERS, BODY)
    old = ledger.claim("acct_A", "k-1", fp)
    clock.advance(30_001)
    new = ledger.takeover("acct_A", "k-1", fp)
    assert new.generation == 2
    assert ledger.release(old) is False
    assert ledger.lookup("acct_A", "k-1").generation == 2
    assert ledger.release(new) is True
    assert ledger.lookup("acct_A", "k-1") is None


def test_non_bytes_request_body_is_a_typed_error_and_nothing_is_written(ledger):
    run = Mutation()
    with pytest.raises(InvalidBodyError, match="request body must be bytes, got str"):
        ledger.handle("acct_A", "k-1", "POST", "/orders", HEADERS, "text", run)  # type: ignore[arg-type]
    assert run.calls == []
    assert ledger.operator.stats().total == 0


def test_bytearray_and_memoryview_bodies_are_accepted_as_bytes(ledger):
    run = Mutation()
    post(ledger, run, key="a", body=bytearray(b"xyz"))
    post(ledger, run, key="b", body=memoryview(b"xyz"))
    assert run.calls == [b"xyz", b"xyz"]
    assert ledger.lookup("acct_A", "a").fingerprint == ledger.lookup("acct_A", "b").fingerprint
