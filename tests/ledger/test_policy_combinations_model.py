"""Whole requests under a random Policy, against the contract's promises, on
every backend.

Hypothesis draws a Policy (pending TTL, retention, body and header caps,
keep_answer, reuse status, in-progress wait, expiry header, fingerprint
mode, clock) and then a history of requests, owners that stall mid-mutation
and finish late, storage failures after the mutation ran, sweeps and clock
jumps. After each step the ledger must keep the promises:

- the mutation runs only when the key is absent, past retention, released,
  or held by a stale reservation: at most once per live reservation;
- every retry of a completed key within retention gets the first answer,
  byte for byte;
- an answer the app computed is either stored and returned, or returned
  with FENCED_OUT / NOT_KEPT, or carried by AnswerNotStoredError: never lost.

With clock="database" the clock cannot jump, so the drawn TTL is long and the
history has no jumps."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from idemctl import Answer, AnswerNotStoredError, Ledger, Outcome, Policy, StorageError, Ticket
from idemctl.responses import as_problem, not_stored
from tests.helpers import FakeClock, wrap_store_run

KEYS = ("k1", "k2")
# Request bodies: 0 and 1 are the same JSON in another spelling (one request
# with fingerprint_body="json", two without); 2 is another request.
REQUESTS = (b'{"sku":"tea","n":1}', b'{"n":1, "sku":"tea"}', b'{"sku":"coffee","n":1}')
REPLAYABLE = ("content-type", "location", "set-cookie")
JSON = {"content-type": "application/json"}
ANSWER_HEADERS = (
    (),
    (("Content-Type", "text/plain"), ("Location", "/orders/1")),
    (("Set-Cookie", "a=1; Path=/"), ("X-Other", "x"), ("Set-Cookie", "b=2")),
    (("Location", "/" + "l" * 60),),
)
NULL_BODY = frozenset({204, 205, 304})


def _no_5xx(status: int, headers: tuple[tuple[str, str], ...]) -> bool:
    return status < 500


@st.composite
def policies(draw: st.DrawFn) -> tuple[Policy, str]:
    clock = draw(st.sampled_from(["fake", "fake", "database"]))
    ttl = 60_000 if clock == "database" else draw(st.sampled_from([1_000, 5_000]))
    policy = Policy(
        pending_ttl_ms=ttl,
        retention_ms=ttl * draw(st.sampled_from([2, 5])),
        body_cap_bytes=draw(st.sampled_from([8, 64, 16_384])),
        header_cap_bytes=draw(st.sampled_from([2, 40, 8_192])),
        keep_answer=draw(st.sampled_from([None, _no_5xx])),
        reuse_status=draw(st.sampled_from([409, 422])),
        in_progress_wait_ms=draw(st.sampled_from([0, 0, 15])),
        expires_header=draw(st.sampled_from([None, "idempotency-expires"])),
        fingerprint_body=draw(st.sampled_from(["raw", "json"])),
        replayable_headers=REPLAYABLE,
    )
    return policy, clock


@dataclass
class Row:
    request: int
    updated_at: int
    owner: int  # the reservation that holds (or completed) the row
    wire: tuple[int, tuple[tuple[str, str], ...], bytes] | None = None  # the first answer, once completed


def expected_answer(policy: Policy, status: int, headers: tuple[tuple[str, str], ...], body: bytes):
    """What the ledger stores for an app's answer (before any expiry header)."""
    order = {name: i for i, name in enumerate(policy.replayable_headers)}
    kept = sorted(((n.lower(), v) for n, v in headers if n.lower() in order), key=lambda pair: order[pair[0]])
    grouped: dict[str, list[str]] = {}
    for name, value in kept:
        grouped.setdefault(name, []).append(value)
    stored = json.dumps({n: v[0] if len(v) == 1 else v for n, v in grouped.items()}, separators=(",", ":"))
    if len(stored.encode()) > policy.header_cap_bytes or len(body) > policy.body_cap_bytes:
        # Nothing of the app's answer is sent: the ledger's own error, shaped as its refusals are.
        return as_problem(not_stored()) if policy.problem_details else not_stored()
    return status, tuple(kept), b"" if status in NULL_BODY else body


def machine_for(
    target: str, fake: FakeClock, open_ledger: Callable[[str, Policy, Any], Ledger] | None = None
) -> type[RuleBasedStateMachine]:
    """The model over ledgers on `target`; `open_ledger(target, policy, clock)`
    opens each (by default `Ledger.open`; tests/ledger/test_one_vocabulary.py
    drives the same model through each driver of the decision loop)."""
    opener = open_ledger or (lambda where, policy, clock: Ledger.open(where, policy=policy, clock=clock))

    class PolicyCombinations(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.principal = f"pc-{secrets.token_hex(6)}"
            self.rows: dict[str, Row] = {}
            self.stalled: list[tuple[int, Ticket, int]] = []  # (reservation, ticket, request)
            self.reservations = 0
            self.ledger: Ledger | None = None

        @initialize(drawn=policies())
        def open_ledger(self, drawn: tuple[Policy, str]) -> None:
            self.policy, self.clock_kind = drawn
            fake.advance(10**9)  # far past every earlier history's rows
            clock = "database" if self.clock_kind == "database" else fake
            self.ledger = opener(target, self.policy, clock)

        def teardown(self) -> None:
            if self.ledger is not None:
                self.ledger.close()

        # -- the model ---------------------------------------------------------------
        def now(self) -> int:
            assert self.ledger is not None
            return self.ledger.now()

        def same(self, a: int, b: int) -> bool:
            return a == b or (self.policy.fingerprint_body == "json" and {a, b} == {0, 1})

        def live(self, key: str, now: int) -> Row | None:
            row = self.rows.get(key)
            if row is not None and row.updated_at < now - self.policy.retention_ms:
                return None  # past retention: absent
            return row

        def verdict(self, key: str, request: int, now: int) -> str:
            row = self.live(key, now)
            if row is None:
                return "new"
            if not self.same(row.request, request):
                return "reused"
            if row.wire is not None:
                return "replay"
            if row.updated_at < now - self.policy.pending_ttl_ms:
                return "takeover"
            return "in_progress"

        def claimed(self, key: str, request: int, now: int) -> int:
            self.reservations += 1
            self.rows[key] = Row(request, now, self.reservations)
            return self.reservations

        # -- whole requests ----------------------------------------------------------
        @rule(
            key=st.sampled_from(KEYS),
            request=st.sampled_from([0, 0, 1, 2]),
            status=st.sampled_from([201, 200, 204, 503]),
            headers=st.sampled_from(ANSWER_HEADERS),
            size=st.sampled_from([0, 20, 100]),
            store_fails=st.sampled_from([False, False, False, True]),
        )
        def request(self, key, request, status, headers, size, store_fails) -> None:
            ledger = self.ledger
            assert ledger is not None
            now = self.now()
            verdict = self.verdict(key, request, now)
            body = bytes([65 + request]) * size
            runs: list[bytes] = []
            armed = [False]

            def app(request_body: bytes):
                runs.append(request_body)
                armed[0] = store_fails  # storage fails from here on: the mutation has run
                return status, headers, body

            restore = self.storage_fails_when(armed)
            try:
                answer = ledger.handle(self.principal, key, "POST", "/orders", JSON, REQUESTS[request], app)
            except AnswerNotStoredError as exc:
                answer, lost = exc.answer, True
            else:
                lost = False
            finally:
                restore()
            runs_expected = verdict in ("new", "takeover")
            assert len(runs) == (1 if runs_expected else 0), f"{verdict}: the mutation ran {len(runs)} times"
            if not runs_expected:
                assert not lost
                self.check_answer_without_run(key, verdict, answer)
                return
            computed = expected_answer(self.policy, status, headers, body)
            kept = self.policy.keep_answer is None or status < 500
            if lost:
                # Never stored, and the caller holds the computed answer: the row
                # stays pending under this run's reservation.
                assert kept and store_fails
                assert answer.wire == computed
                self.claimed_or_taken(key, request, now)
                return
            assert not store_fails or not kept
            if not kept:
                assert (answer.outcome, answer.wire) == (Outcome.NOT_KEPT, computed)
                self.rows.pop(key, None)  # released: the next retry runs again
                return
            assert answer.outcome is (Outcome.EXECUTED if verdict == "new" else Outcome.TAKEN_OVER)
            self.claimed_or_taken(key, request, now)
            row = self.rows[key]
            row.updated_at = self.stamp_of(key, now)
            row.wire = self.with_expiry(computed, row.updated_at)
            assert answer.wire == row.wire

        def claimed_or_taken(self, key: str, request: int, now: int) -> None:
            row = self.live(key, now)
            if row is None:
                self.claimed(key, request, now)
            else:
                self.reservations += 1
                row.owner = self.reservations
            self.rows[key].updated_at = self.stamp_of(key, now)

        def stamp_of(self, key: str, expected: int) -> int:
            """The row's updated_at: `expected` on the fake clock; whatever the
            database's clock said on the other."""
            assert self.ledger is not None
            got = self.ledger.lookup(self.principal, key)
            assert got is not None
            if self.clock_kind == "fake":
                assert got.updated_at == expected
            return got.updated_at

        def storage_fails_when(self, armed: list[bool]):
            """Make the statements finish runs fail once `armed[0]` is set: the
            completion, and with clock="database" reading the clock first."""
            ledger = self.ledger
            assert ledger is not None
            store = ledger.store
            real_clock = ledger.clock

            def complete(step, run):
                if armed[0] and step == "complete":
                    raise StorageError("the database went away")
                return run()

            def clock() -> int:
                if armed[0]:
                    raise StorageError("the database went away")
                return real_clock()

            wrap_store_run(store, complete)
            if self.clock_kind == "database":
                ledger.clock = clock

            def restore() -> None:
                store.__dict__.pop("run", None)
                ledger.clock = real_clock

            return restore

        def with_expiry(self, wire, stamp: int):
            name = self.policy.expires_header
            if name is None:
                return wire
            from email.utils import formatdate

            until = formatdate((stamp + self.policy.retention_ms) / 1000, usegmt=True)
            return wire[0], (*wire[1], (name, until)), wire[2]

        def check_answer_without_run(self, key: str, verdict: str, answer: Answer) -> None:
            row = self.rows[key]
            if verdict == "replay":
                # The first answer, byte for byte, for every retry within retention.
                assert answer.outcome is Outcome.REPLAYED
                assert answer.wire == row.wire
                if self.policy.expires_header:
                    assert row.updated_at + self.policy.retention_ms >= self.now()
            elif verdict == "reused":
                assert (answer.outcome, answer.status) == (Outcome.REUSED, self.policy.reuse_status)
            else:
                assert (answer.outcome, answer.status) == (Outcome.IN_PROGRESS, 409)

        # -- owners that stall, and finish late ---------------------------------------
        @rule(key=st.sampled_from(KEYS), request=st.sampled_from([0, 2]))
        def an_owner_stalls_mid_mutation(self, key: str, request: int) -> None:
            ledger = self.ledger
            assert ledger is not None
            now = self.now()
            verdict = self.verdict(key, request, now)
            decision = ledger.begin(self.principal, key, "POST", "/orders", JSON, REQUESTS[request])
            if verdict in ("new", "takeover"):
                assert isinstance(decision, Ticket), f"{verdict}: got {decision}"
                self.claimed_or_taken(key, request, now)
                self.stalled.append((self.rows[key].owner, decision, request))
            else:
                assert isinstance(decision, Answer)
                self.check_answer_without_run(key, verdict, decision)

        @precondition(lambda self: self.stalled)
        @rule(data=st.data(), status=st.sampled_from([201, 503]))
        def a_stalled_owner_finishes_late(self, data: st.DataObject, status: int) -> None:
            ledger = self.ledger
            assert ledger is not None
            owner, ticket, _request = self.stalled.pop(data.draw(st.integers(0, len(self.stalled) - 1)))
            key = ticket.reservation.key
            now = self.now()
            # A reservation past retention that nobody took over or swept is still
            # its owner's: its answer is stored, which only saves a rerun.
            row = self.rows.get(key)
            computed = expected_answer(self.policy, status, (), b"late")
            answer = ledger.finish(ticket, status, (), b"late")
            kept = self.policy.keep_answer is None or status < 500
            owns = row is not None and row.owner == owner and row.wire is None
            if not kept:
                assert (answer.outcome, answer.wire) == (Outcome.NOT_KEPT, computed)
                if owns:
                    self.rows.pop(key)
                return
            if owns:
                assert row is not None
                row.updated_at = self.stamp_of(key, now)
                row.wire = self.with_expiry(computed, row.updated_at)
                assert (answer.outcome, answer.wire) == (ticket.outcome, row.wire)
            else:
                # Fenced out: the caller still gets what it computed; nothing changes.
                assert (answer.outcome, answer.wire) == (Outcome.FENCED_OUT, computed)

        # -- time and housekeeping ----------------------------------------------------
        @precondition(lambda self: self.clock_kind == "fake")
        @rule(jump=st.sampled_from(["ms", "ttl", "past ttl", "retention", "past retention"]))
        def the_clock_jumps(self, jump: str) -> None:
            p = self.policy
            fake.advance(
                {
                    "ms": 1,
                    "ttl": p.pending_ttl_ms,
                    "past ttl": p.pending_ttl_ms + 1,
                    "retention": p.retention_ms,
                    "past retention": p.retention_ms + 1,
                }[jump]
            )

        @rule()
        def sweep(self) -> None:
            ledger = self.ledger
            assert ledger is not None
            now = self.now()
            ledger.operator.sweep(batch=100)
            for key in [k for k, r in self.rows.items() if r.updated_at < now - self.policy.retention_ms]:
                del self.rows[key]

        @invariant()
        def the_ledger_holds_the_models_answers(self) -> None:
            ledger = self.ledger
            if ledger is None:
                return
            now = self.now()
            for key in KEYS:
                row = self.live(key, now)
                got = ledger.lookup(self.principal, key)
                if row is None:
                    assert got is None or got.updated_at < now - self.policy.retention_ms
                    continue
                assert got is not None and got.updated_at == row.updated_at
                assert (got.status.value == "completed") == (row.wire is not None)

    return PolicyCombinations


SETTINGS = {
    backend: settings(
        max_examples=examples,
        stateful_step_count=25,
        deadline=None,
        report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    for backend, examples in (("sqlite", 150), ("postgres", 60), ("mysql", 40), ("redis", 15))
}


def test_every_policy_combination_keeps_the_contracts_promises(ledger_target, backend_name):
    Ledger.open(ledger_target).init()
    run_state_machine_as_test(machine_for(ledger_target, FakeClock()), settings=SETTINGS[backend_name])


@pytest.mark.parametrize("backend_name", ["sqlite"])
def test_the_model_finds_a_mutation_that_runs_again_beside_the_body_cap(ledger_target, monkeypatch):
    # The model exists to find bugs like this one: keep_answer judging the
    # oversize sentinel's 500 instead of the app's status. The request flow
    # is the ledger's part that finishes; ledgers opened from here on use it.
    from idemctl.ledger.requests import RequestFlow

    real_finish = RequestFlow.finish

    def judging_the_sentinel(self, ticket, status, headers, body):
        if self.policy.body_cap_bytes < len(body if isinstance(body, bytes) else b""):
            status = 500
        return real_finish(self, ticket, status, headers, body)

    monkeypatch.setattr(RequestFlow, "finish", judging_the_sentinel)
    Ledger.open(ledger_target).init()
    with pytest.raises(AssertionError):
        run_state_machine_as_test(
            machine_for(ledger_target, FakeClock()),
            # Finding it is the point, not shrinking it.
            settings=settings(SETTINGS["sqlite"], max_examples=300, database=None, phases=[Phase.generate]),
        )
