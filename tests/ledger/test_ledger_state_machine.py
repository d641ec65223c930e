"""The ledger against a small model of the contract (SPEC §1, §4, §5; issue 9,
section 10), driven by a Hypothesis state machine on every backend.

Rules: claim, takeover, complete and release by *any* reservation ever issued
(superseded ones and ones whose row was deleted included), purge (forced or
not), sweep, whole requests through `handle` (executed, replayed, reused, in
progress, taken over, failing with and without release) and clock moves
around the TTL and the retention. After every step each key's row must equal
the model's, byte for byte.

The model is the contract, not the code: a reservation is one claim or one
takeover, and only the reservation that currently owns a pending row may
complete or release it. A row deleted (release, purge, sweep) and claimed
again belongs to the new claim alone, even though its `generation` starts at
1 again (SPEC §4.6).

Only the public API is used: reservations come from claim/takeover and are
never built by hand, so the tests keep meaning the same thing when the
reservation's fencing token changes shape.

All machine instances of one test share one ledger (on PostgreSQL, one
schema): each instance writes under a principal of its own and runs its clock
in a range of its own, far after every earlier instance's."""

from __future__ import annotations

import itertools
import secrets
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from idemctl import Ledger, Outcome, Policy, Reservation, State, Status, StoredRow, fingerprint
from idemctl.outcomes import PurgeOutcome
from idemctl.storage import SqliteOptions, Store
from tests.conftest import engine_params, pgbouncer_params
from tests.helpers import EveryWriteInOneTransaction, FakeClock

# The PostgreSQL tests run through PgBouncer (session and transaction pooling) too.
THROUGH_PGBOUNCER = True

TTL = 1_000
RETENTION = 5_000
POLICY = Policy(pending_ttl_ms=TTL, retention_ms=RETENTION)

KEYS = ("k-1", "k-2")
METHOD = "POST"
PATH = "/orders"
REQUEST_HEADERS = {"content-type": "application/json"}
# Two different requests: the same key with the other one is a reuse (409).
REQUEST_BODIES = {"apple": b'{"sku":"apple"}', "pear": b'{"sku":"pear"}'}
FINGERPRINTS = {
    name: fingerprint(METHOD, PATH, REQUEST_HEADERS, body, POLICY.fingerprint_headers)
    for name, body in REQUEST_BODIES.items()
}
# Mostly the same request, so that takeovers and replays happen often.
REQUESTS = st.sampled_from(["apple", "apple", "apple", "pear"])
ANSWER_HEADERS = {"content-type": "text/plain", "x-not-replayed": "dropped"}
STORED_HEADERS = {"content-type": "text/plain"}

CLOCK_START = 1_700_000_000_000
# Far more than one instance can advance in its steps (30 x RETENTION): rows
# earlier instances left behind are all past the retention for a new one.
INSTANCE_SPACING_MS = 10**9


class MutationFailed(Exception):
    """A mutation that raised (rolled back)."""


class Held:
    """A reservation the test holds, with the number the model knows it by."""

    __slots__ = ("n", "reservation")

    def __init__(self, n: int, reservation: Reservation) -> None:
        self.n = n
        self.reservation = reservation

    def __repr__(self) -> str:  # what Hypothesis prints in a failing example
        r = self.reservation
        return f"<reservation #{self.n} of {r.key} at generation {r.generation}>"


@dataclass
class ModelRow:
    fingerprint: str
    generation: int
    owner: int  # the reservation (claim, takeover or handle run) that owns the row
    claimed_by: int  # the claim that created this row: a re-claim after a deletion is a new row
    created_at: int
    updated_at: int
    status: Status = Status.PENDING
    response_status: int | None = None
    body: bytes | None = None
    answered_by: int | None = None  # the reservation whose answer is stored


def answer_body(n: int, binary: bool) -> bytes:
    """A body that names its reservation; the binary flavour is not UTF-8 (stored as a BLOB)."""
    text = f"answer of reservation #{n}".encode()
    return b"\xff\xfe" + text if binary else text


def machine_for(ledger: Ledger, clock: FakeClock, tally: Counter[str] | None = None) -> type[RuleBasedStateMachine]:
    """The state machine class for one open ledger; `tally` counts what the steps did."""
    instances = itertools.count()
    tally = Counter() if tally is None else tally

    class LedgerAgainstModel(RuleBasedStateMachine):
        reservations = Bundle("reservations")

        def __init__(self) -> None:
            super().__init__()
            self.principal = f"sm-{secrets.token_hex(6)}"
            self.rows: dict[str, ModelRow] = {}
            self.numbers = itertools.count()
            self.row_claims: dict[int, int] = {}  # reservation number -> the claim that created its row
            self.stored_answers: Counter[int] = Counter()  # reservation number -> answers the ledger stored
            self.issued: list[Held] = []  # every reservation claim and takeover returned, in order
            self.started = False

        @initialize()
        def start_on_an_empty_ledger(self) -> None:
            clock.now = CLOCK_START + next(instances) * INSTANCE_SPACING_MS
            # Everything earlier instances left is past the retention now.
            while ledger.operator.sweep(batch=100_000).keys_deleted:
                pass
            self.started = True

        # -- helpers -------------------------------------------------------------
        def seen(self, what: str) -> None:
            tally[what] += 1

        def pending_keys(self) -> list[str]:
            return [k for k in KEYS if k in self.rows and self.rows[k].status is Status.PENDING]

        def live_owners(self) -> list[Held]:
            return [held for held in self.issued if self.standing(held.n, held.reservation.key) == "owner"]

        def completed_keys(self) -> list[str]:
            return [k for k in KEYS if k in self.rows and self.rows[k].status is Status.COMPLETED]

        def stale(self, row: ModelRow) -> bool:
            return row.updated_at < clock.now - TTL

        def expired(self, row: ModelRow) -> bool:
            # Past retention a row counts as absent (SPEC §1).
            return row.updated_at < clock.now - RETENTION

        def standing(self, n: int, key: str) -> str:
            """Whether reservation #n may complete or release its key's row now, and if not, why."""
            row = self.rows.get(key)
            if row is None:
                return "row gone"
            if row.claimed_by != self.row_claims[n]:
                return f"row re-claimed by reservation #{row.claimed_by}"
            if row.owner != n:
                return f"superseded by reservation #{row.owner}"
            if row.status is not Status.PENDING:
                return "already completed"
            return "owner"

        def note_stored(self, n: int) -> None:
            self.stored_answers[n] += 1
            assert self.stored_answers[n] == 1, f"reservation #{n} got {self.stored_answers[n]} answers stored"

        def fenced_count(self, key: str) -> int:
            return len(list(self.ledger_fenced(key)))

        def ledger_fenced(self, key: str):
            return ledger.operator.fenced(principal=self.principal, key=key)

        def hold(self, n: int, reservation: Reservation) -> Held:
            held = Held(n, reservation)
            self.issued.append(held)
            return held

        def new_claim(self, key: str, fp: str, n: int | None = None) -> int:
            n = next(self.numbers) if n is None else n
            self.row_claims[n] = n
            self.rows[key] = ModelRow(fp, 1, n, n, clock.now, clock.now)
            return n

        def new_takeover(self, row: ModelRow, fp: str, n: int | None = None) -> int:
            n = next(self.numbers) if n is None else n
            self.row_claims[n] = row.claimed_by
            if self.expired(row):
                # A new operation in the old row: this request's, pending, created now.
                row.fingerprint, row.status, row.created_at = fp, Status.PENDING, clock.now
                row.response_status = row.body = row.answered_by = None
            row.generation += 1
            row.owner = n
            row.updated_at = clock.now
            return n

        # -- single steps --------------------------------------------------------
        @rule(target=reservations, key=st.sampled_from(KEYS), request=REQUESTS)
        def claim(self, key: str, request: str):
            fp = FINGERPRINTS[request]
            expected = key not in self.rows
            got = ledger.claim(self.principal, key, fp)
            assert (got is not None) == expected, f"claim of {key}: the model expects success={expected}, got {got}"
            self.seen("claim: won" if expected else "claim: lost")
            if got is None:
                return multiple()
            # A claim starts at generation 1, also after a deletion (SPEC §2, §4.6).
            assert (got.principal, got.key, got.generation, got.fingerprint) == (self.principal, key, 1, fp)
            return self.hold(self.new_claim(key, fp), got)

        @rule(target=reservations, key=st.sampled_from(KEYS), request=REQUESTS)
        def takeover(self, key: str, request: str):
            return self.take_over(key, FINGERPRINTS[request])

        @precondition(lambda self: self.pending_keys())
        @rule(
            target=reservations,
            data=st.data(),
            stalled=st.booleans(),
            same_request=st.sampled_from([True, True, True, False]),
        )
        def retry_of_a_pending_request_takes_over(self, data: st.DataObject, stalled: bool, same_request: bool):
            """A retry of a pending request (or another request with its key)
            tries to take it over, possibly after its owner stalled past the TTL."""
            key = data.draw(st.sampled_from(self.pending_keys()), label="pending key")
            if stalled:
                clock.advance(TTL + 1)
            fp = self.rows[key].fingerprint
            if not same_request:
                fp = next(f for f in FINGERPRINTS.values() if f != fp)
            return self.take_over(key, fp)

        def take_over(self, key: str, fp: str):
            row = self.rows.get(key)
            expected = row is not None and (
                (row.status is Status.PENDING and row.fingerprint == fp and self.stale(row)) or self.expired(row)
            )
            got = ledger.takeover(self.principal, key, fp)
            assert (got is not None) == expected, f"takeover of {key}: the model expects success={expected}, got {got}"
            self.seen("takeover: took over" if expected else "takeover: refused")
            if got is None:
                return multiple()
            assert row is not None
            assert (got.principal, got.key, got.generation, got.fingerprint) == (
                self.principal,
                key,
                row.generation + 1,
                fp,
            )
            return self.hold(self.new_takeover(row, fp), got)

        # Completions and releases by a reservation from the bundle (Hypothesis
        # mostly draws recent ones) and by one drawn uniformly from all that
        # were ever issued (mostly superseded or deleted ones, the late owners
        # the fencing exists for).
        @rule(held=reservations, status=st.sampled_from([200, 201, 202]), binary=st.booleans())
        def complete(self, held: Held, status: int, binary: bool) -> None:
            self.complete_as(held, status, binary)

        @precondition(lambda self: self.issued)
        @rule(data=st.data(), status=st.sampled_from([200, 201, 202]), binary=st.booleans())
        def any_earlier_reservation_completes(self, data: st.DataObject, status: int, binary: bool) -> None:
            self.complete_as(data.draw(st.sampled_from(self.issued), label="late owner"), status, binary)

        @rule(held=reservations)
        def release(self, held: Held) -> None:
            self.release_as(held)

        @precondition(lambda self: self.issued)
        @rule(data=st.data())
        def any_earlier_reservation_releases(self, data: st.DataObject) -> None:
            self.release_as(data.draw(st.sampled_from(self.issued), label="late owner"))

        @precondition(lambda self: self.live_owners())
        @rule(data=st.data(), answers=st.booleans(), status=st.sampled_from([200, 201, 202]), binary=st.booleans())
        def the_live_owner_answers_or_rolls_back(self, data: st.DataObject, answers: bool, status: int, binary: bool):
            """How a request that holds its key ends: it stores its answer, or
            releases the key because its mutation rolled back. Drawn from the
            owners only, so that every run stores and releases often."""
            held = data.draw(st.sampled_from(self.live_owners()), label="live owner")
            if answers:
                self.complete_as(held, status, binary)
            else:
                self.release_as(held)

        def complete_as(self, held: Held, status: int, binary: bool) -> None:
            key = held.reservation.key
            row = self.rows.get(key)
            standing = self.standing(held.n, key)
            body = answer_body(held.n, binary)
            fenced_before = self.fenced_count(key)
            done = ledger.complete(held.reservation, status, ANSWER_HEADERS, body)
            if done.stored:
                self.note_stored(held.n)
            assert done.stored == (standing == "owner"), (
                f"{held!r} completed and its answer was stored, but: {standing}"
                if done.stored
                else f"{held!r} was fenced out, but the model says it owns the pending row"
            )
            self.seen("complete: stored" if done.stored else f"complete: fenced out, {standing.split(' by ')[0]}")
            # Either way the caller gets exactly what it computed.
            assert (done.status, done.headers, done.body) == (status, tuple(STORED_HEADERS.items()), body)
            if done.stored:
                assert row is not None
                row.status, row.response_status, row.body, row.answered_by = Status.COMPLETED, status, body, held.n
                row.updated_at = clock.now
                assert done.event is None
                assert self.fenced_count(key) == fenced_before
                return
            # Fenced out: recorded durably, with what the row held at that moment.
            assert self.fenced_count(key) == fenced_before + 1
            event = done.event
            assert event is not None
            assert (
                event.principal,
                event.key,
                event.superseded_generation,
                event.computed_status,
                event.fenced_at,
            ) == (
                self.principal,
                key,
                held.reservation.generation,
                status,
                clock.now,
            )
            assert event.current_generation == (None if row is None else row.generation)
            assert next(iter(self.ledger_fenced(key))) == event

        def release_as(self, held: Held) -> None:
            key = held.reservation.key
            standing = self.standing(held.n, key)
            released = ledger.release(held.reservation)
            assert released == (standing == "owner"), (
                f"{held!r} released (deleted) the row, but: {standing}"
                if released
                else f"{held!r} could not release the pending row the model says it owns"
            )
            self.seen("release: deleted" if released else "release: refused")
            if released:
                del self.rows[key]

        @precondition(lambda self: self.issued)
        @rule(data=st.data())
        def a_live_owner_renews_its_lease(self, data: st.DataObject) -> None:
            # The lease keeper's statement, for any reservation ever issued:
            # only the current owner of a pending row moves its updated_at.
            held = data.draw(st.sampled_from(self.issued), label="renewing owner")
            r = held.reservation
            key = r.key
            standing = self.standing(held.n, key)
            row = self.rows.get(key)
            renewed = ledger.store.renew([(r.principal, r.key, r.generation, r.token)], clock.now)
            expected = 1 if standing == "owner" else 0
            if not ledger.store.dialect.returning and row is not None and row.updated_at == clock.now:
                expected = 0  # MariaDB/MySQL count the rows a statement changed, not those it matched
            assert renewed == expected, f"{held!r} renewed {renewed} row(s), but: {standing}"
            self.seen("renew: renewed" if renewed else "renew: refused")
            if renewed:
                self.rows[key].updated_at = clock.now

        @rule(key=st.sampled_from(KEYS), force=st.booleans())
        def purge(self, key: str, force: bool) -> None:
            row = self.rows.get(key)
            result = ledger.operator.purge(self.principal, key, force=force)
            if row is None:
                assert (result.outcome, result.row) == (PurgeOutcome.NOT_FOUND, None)
                return
            # Only a fresh pending row is refused, and only without force.
            deletes = force or row.status is not Status.PENDING or self.stale(row)
            assert result.outcome is (PurgeOutcome.PURGED if deletes else PurgeOutcome.REFUSED_FRESH_PENDING)
            self.seen(f"purge: {result.outcome.value}")
            assert result.row is not None
            self.check_row(key, result.row)
            if deletes:
                del self.rows[key]

        @rule()
        def sweep(self) -> None:
            cutoff = clock.now - RETENTION
            expired = [k for k, r in self.rows.items() if r.updated_at < cutoff]
            result = ledger.operator.sweep()
            assert (result.keys_deleted, result.cutoff) == (len(expired), cutoff)
            self.seen("sweep: deleted rows" if expired else "sweep: nothing expired")
            for k in expired:
                del self.rows[k]

        # Clock moves, as three rules so that each is picked often: up to the
        # TTL (its boundary included: stale means strictly older than the TTL),
        # just past it, and at the retention's boundary (swept means strictly
        # older than the retention).
        @rule(ms=st.integers(1, TTL))
        def advance_clock(self, ms: int) -> None:
            clock.advance(ms)

        @rule()
        def advance_clock_past_the_ttl(self) -> None:
            clock.advance(TTL + 1)

        @rule(extra=st.sampled_from([1, 0]))
        def advance_clock_to_the_retention(self, extra: int) -> None:
            clock.advance(RETENTION + extra)

        # -- whole requests --------------------------------------------------------
        @rule(
            key=st.sampled_from(KEYS),
            request=REQUESTS,
            mutation=st.sampled_from(["answers", "raises", "raises_and_releases"]),
            binary=st.booleans(),
        )
        def handle(self, key: str, request: str, mutation: str, binary: bool) -> None:
            self.request(key, request, mutation, binary)

        @precondition(lambda self: self.completed_keys())
        @rule(data=st.data(), binary=st.booleans())
        def retry_of_a_completed_request(self, data: st.DataObject, binary: bool) -> None:
            """A client retries a request whose answer is stored: the retry
            clients send most, and so a replay in every run (unless the clock
            has since passed the retention, when it runs anew)."""
            key = data.draw(st.sampled_from(self.completed_keys()), label="completed key")
            request = next(name for name, fp in FINGERPRINTS.items() if fp == self.rows[key].fingerprint)
            self.request(key, request, "answers", binary)

        def request(self, key: str, request: str, mutation: str, binary: bool) -> None:
            fp = FINGERPRINTS[request]
            row = self.rows.get(key)
            if row is None or self.expired(row):
                outcome = Outcome.EXECUTED
            elif row.fingerprint != fp:
                outcome = Outcome.REUSED
            elif row.status is Status.COMPLETED:
                outcome = Outcome.REPLAYED
            elif self.stale(row):
                outcome = Outcome.TAKEN_OVER
            else:
                outcome = Outcome.IN_PROGRESS
            runs = outcome in (Outcome.EXECUTED, Outcome.TAKEN_OVER)
            n = next(self.numbers)  # the run's reservation, if it gets one
            body = answer_body(n, binary)
            ran: list[bytes] = []

            def run(request_body: bytes):
                ran.append(request_body)
                if mutation != "answers":
                    raise MutationFailed(f"mutation of run #{n} rolled back")
                return 201, ANSWER_HEADERS, body

            try:
                answer = ledger.handle(
                    self.principal,
                    key,
                    METHOD,
                    PATH,
                    REQUEST_HEADERS,
                    REQUEST_BODIES[request],
                    run,
                    release_on_error=mutation == "raises_and_releases",
                )
            except MutationFailed:
                answer = None
            assert ran == ([REQUEST_BODIES[request]] if runs else []), (
                f"request #{n} on {key}: ran {ran}, model: {outcome}"
            )
            self.seen(f"handle: {outcome.value}")

            if runs:
                if row is None:
                    self.new_claim(key, fp, n)
                    row = self.rows[key]
                else:
                    self.new_takeover(row, fp, n)
                if mutation == "answers":
                    assert answer is not None
                    assert (answer.outcome, answer.generation) == (outcome, row.generation)
                    assert (answer.status, answer.headers, answer.body) == (201, tuple(STORED_HEADERS.items()), body)
                    self.note_stored(n)
                    row.status, row.response_status, row.body, row.answered_by = Status.COMPLETED, 201, body, n
                else:
                    assert answer is None, "a mutation that raised must propagate out of handle"
                    if mutation == "raises_and_releases":
                        del self.rows[key]
                return

            assert answer is not None and answer.outcome is outcome, (
                f"request #{n} on {key}: {answer}, model: {outcome}"
            )
            assert row is not None
            if outcome is Outcome.REPLAYED:
                # The replay is the stored answer, byte for byte.
                assert (answer.status, answer.body, dict(answer.headers)) == (
                    row.response_status,
                    row.body,
                    STORED_HEADERS,
                )
            elif outcome is Outcome.REUSED:
                assert answer.status == 409 and b"idempotency_key_reused" in answer.body
            else:
                assert answer.status == 409 and b"idempotency_key_in_progress" in answer.body

        # -- every row equals the model after every step ------------------------------
        def check_row(self, key: str, got: StoredRow) -> None:
            want = self.rows[key]
            assert (got.principal, got.key, got.fingerprint, got.status, got.generation) == (
                self.principal,
                key,
                want.fingerprint,
                want.status,
                want.generation,
            ), f"row {key}: {got}, but the model has {want}"
            assert (got.created_at, got.updated_at) == (want.created_at, want.updated_at), f"row {key}: {got} vs {want}"
            assert (got.response_status, got.body_bytes) == (want.response_status, want.body), (
                f"row {key} holds {got.body_bytes!r}, the model's stored answer is {want.body!r}"
                f" (from reservation #{want.answered_by})"
            )
            assert got.headers == (STORED_HEADERS if want.status is Status.COMPLETED else {})

        @invariant()
        def rows_equal_the_model(self) -> None:
            if not self.started:
                return
            for key in KEYS:
                got = ledger.lookup(self.principal, key)
                want = self.rows.get(key)
                if want is None:
                    assert got is None, f"row {key} exists ({got}), but the model has none"
                    continue
                assert got is not None, f"row {key} is gone, but the model has {want}"
                self.check_row(key, got)
                if want.updated_at < clock.now - RETENTION:
                    state = State.EXPIRED
                elif want.status is Status.COMPLETED:
                    state = State.COMPLETED
                elif self.stale(want):
                    state = State.PENDING_STALE
                else:
                    state = State.PENDING_FRESH
                view = ledger.operator.get(self.principal, key)
                assert view is not None and view.state is state, f"row {key} shows as {view}, the model says {state}"

    return LedgerAgainstModel


# A passing run takes a few seconds per backend. A failing one shrinks its
# first bug only (report_multiple_bugs=False): each shrink step replays whole
# histories, which on PostgreSQL takes minutes for several bugs at once.
SETTINGS = {
    backend: settings(
        max_examples=examples,
        stateful_step_count=30,
        deadline=None,
        report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    for backend, examples in (
        ("sqlite", 300),
        ("sqlite-group", 300),
        ("postgres", 150),
        ("mysql", 100),
        # Through PgBouncer: the same machine, fewer examples (each costs a pooler round trip more).
        ("pgbouncer-session", 40),
        ("pgbouncer-transaction", 40),
        # Redis: one round trip a step, as PostgreSQL; the cluster's steps go to three primaries.
        ("redis", 40),
        ("redis-cluster", 20),
    )
}


def open_ledger(backend_name: str, target: str, clock: FakeClock) -> Ledger:
    """sqlite-group: every statement run as group commit runs a batch (in a
    transaction of its own), since this machine has one thread."""
    if backend_name != "sqlite-group":
        return Ledger.open(target, policy=POLICY, clock=clock)
    engine = EveryWriteInOneTransaction(target, options=SqliteOptions(group_commit=True))
    assert engine.group_commit
    return Ledger(Store(engine), policy=POLICY, clock=clock)


# What every random run must have exercised, so that passing means something.
# Only what every run does several times over; the rarer interleavings are
# scripted below, step by step, through the same machine.
MUST_HAVE_SEEN = {
    "a takeover": ("takeover: took over", "handle: taken_over"),
    "a stored completion": ("complete: stored",),
    "a fenced-out completion": tuple(
        f"complete: fenced out, {why}" for why in ("row gone", "row re-claimed", "superseded", "already completed")
    ),
    "a release": ("release: deleted",),
    "a refused release": ("release: refused",),
    "a purge": ("purge: purged",),
    "a sweep that deleted": ("sweep: deleted rows",),
    "a request executed": ("handle: executed",),
    "a replay": ("handle: replayed",),
}
# Rarer in a run of 100 examples (MariaDB's), and so scripted below: a reused
# key (another request under a taken key), while pending and once completed.
# A sweep that deletes needs the clock moved past the retention and then a
# sweep: a run of 100 examples or fewer (MariaDB's, PgBouncer's) misses it
# now and then. The scripted runs below run on every backend, PgBouncer
# included: issue_9_sweep_then_reclaim sweeps a row away. Replays and
# releases are not rare: the retry of a completed request and the live
# owner's ending are rules of their own. Each entry: the most examples a run
# may have and miss it.
SCRIPTED_FOR_SHORT_RUNS = {"a sweep that deleted": 100}
# Hypothesis switches rules off at random for whole examples (swarm testing),
# so now and then a run of 100 examples never purges, say, though every step
# it took agreed with the model. Such a run goes on with fresh examples, every
# step still checked, before its coverage counts as missing.
RUNS_UNTIL_ALL_SEEN = 3


@pytest.mark.parametrize(
    "backend_name",
    ["sqlite", "sqlite-group", *pgbouncer_params(["postgres"]), "mysql", *engine_params(["redis", "redis-cluster"])],
)
def test_ledger_agrees_with_the_contract_model_under_random_claims_takeovers_completions_releases_purges_and_sweeps(
    backend_name: str, ledger_target: str
) -> None:
    clock = FakeClock()
    tally: Counter[str] = Counter()
    examples = SETTINGS[backend_name].max_examples
    with open_ledger(backend_name, ledger_target, clock) as ledger:
        ledger.init()
        # One class for every run: its instances' clocks go on after the last run's.
        machine = machine_for(ledger, clock, tally)
        for _ in range(RUNS_UNTIL_ALL_SEEN):
            run_state_machine_as_test(machine, settings=SETTINGS[backend_name])
            missing = [
                what
                for what, events in MUST_HAVE_SEEN.items()
                if not sum(tally[e] for e in events) and examples > SCRIPTED_FOR_SHORT_RUNS.get(what, -1)
            ]
            if not missing:
                break
    assert missing == [], f"the random run never did: {missing}; it did: {dict(tally)}"


# -- scripted runs of the same machine: issue 9's reproductions and the rarer
# interleavings, each step checked against the model as in the random run ----


def issue_9_release_then_reclaim(m) -> Iterator[Callable[[], object]]:
    """A claims and stalls, B takes over and releases (its mutation rolled
    back), C claims at generation 1 again: A's late completion must be fenced
    out, C's stored, and A cannot release C's row."""
    a = m.claim("k-1", "apple")
    m.advance_clock_past_the_ttl()
    b = m.takeover("k-1", "apple")
    m.release(b)
    c = m.claim("k-1", "apple")
    assert (a.reservation.generation, c.reservation.generation) == (1, 1)
    yield lambda: m.complete(a, 201, False)
    yield lambda: m.release(a)
    yield lambda: m.complete(c, 201, False)
    assert m.rows["k-1"].answered_by == c.n


def issue_9_purge_then_another_request_claims(m) -> Iterator[Callable[[], object]]:
    """A's stale row is purged and a different request claims the key: A's
    late completion is fenced out and B's replay returns B's answer."""
    a = m.claim("k-1", "apple")
    m.advance_clock_past_the_ttl()
    yield lambda: m.purge("k-1", False)
    b = m.claim("k-1", "pear")
    yield lambda: m.complete(a, 201, False)
    yield lambda: m.complete(b, 201, True)
    yield lambda: m.handle("k-1", "pear", "answers", False)  # a replay of B's answer
    yield lambda: m.handle("k-1", "apple", "answers", False)  # A's retry: reused


def issue_9_release_on_error_chain(m) -> Iterator[Callable[[], object]]:
    """release_on_error only: A stalls past the TTL and fails, B takes over and
    fails, C runs; A's release must not delete C's live reservation, so D's
    retry finds C in progress instead of running the mutation again."""
    a = m.claim("k-1", "apple")
    m.advance_clock_past_the_ttl()
    b = m.takeover("k-1", "apple")
    yield lambda: m.release(b)
    c = m.claim("k-1", "apple")
    yield lambda: m.release(a)
    yield lambda: m.handle("k-1", "apple", "answers", False)  # D: in progress
    yield lambda: m.complete(c, 201, False)


def issue_9_sweep_then_reclaim(m) -> Iterator[Callable[[], object]]:
    """A stalls past the retention; the sweep deletes its row and C claims the
    key: A can neither complete nor release C's reservation."""
    a = m.claim("k-1", "apple")
    m.advance_clock_to_the_retention(1)
    yield m.sweep
    c = m.claim("k-1", "apple")
    yield lambda: m.release(a)
    yield lambda: m.complete(a, 201, False)
    yield lambda: m.complete(c, 201, False)


def superseded_owner_completes_before_and_after_the_new_owner(m) -> Iterator[Callable[[], object]]:
    """Plain takeover fencing: the superseded owner is fenced out while the new
    owner runs and after it completed; it cannot release either."""
    a = m.claim("k-1", "apple")
    m.advance_clock_past_the_ttl()
    yield lambda: m.takeover("k-1", "pear")  # another request: refused
    yield lambda: m.takeover("k-1", "apple")
    b = m.issued[-1]
    yield lambda: m.complete(a, 200, False)
    yield lambda: m.release(a)
    yield lambda: m.complete(b, 201, True)
    yield lambda: m.complete(a, 202, False)
    yield lambda: m.complete(b, 202, False)  # a second answer for B: refused
    yield lambda: m.purge("k-1", False)


def fresh_pending_row_is_not_purged_without_force(m) -> Iterator[Callable[[], object]]:
    m.claim("k-1", "apple")
    m.advance_clock(TTL)  # exactly the TTL: still fresh
    yield lambda: m.purge("k-1", False)
    yield lambda: m.takeover("k-1", "apple")
    yield lambda: m.handle("k-1", "apple", "answers", False)  # in progress
    m.advance_clock(1)
    yield lambda: m.handle("k-1", "apple", "raises_and_releases", False)  # takes over, fails, releases
    yield lambda: m.handle("k-1", "apple", "answers", False)  # runs again
    yield lambda: m.purge("k-1", True)


def reused_key_while_pending_once_completed_and_past_retention(m) -> Iterator[Callable[[], object]]:
    """Another request under a taken key is refused (409, nothing runs)
    while the first is pending and once it completed; past retention it is
    a new operation and runs."""
    m.claim("k-1", "apple")
    yield lambda: m.handle("k-1", "pear", "answers", False)  # pending: reused
    yield lambda: m.handle("k-2", "apple", "answers", True)
    yield lambda: m.handle("k-2", "pear", "answers", False)  # completed: reused
    yield lambda: m.handle("k-2", "apple", "answers", False)  # the first request: replayed
    m.advance_clock(RETENTION + 1)
    yield lambda: m.handle("k-2", "pear", "answers", False)  # past retention: runs


@pytest.mark.parametrize(
    "scenario",
    [
        reused_key_while_pending_once_completed_and_past_retention,
        issue_9_release_then_reclaim,
        issue_9_purge_then_another_request_claims,
        issue_9_release_on_error_chain,
        issue_9_sweep_then_reclaim,
        superseded_owner_completes_before_and_after_the_new_owner,
        fresh_pending_row_is_not_purged_without_force,
    ],
    ids=lambda f: f.__name__,
)
def test_scripted_interleaving_agrees_with_the_contract_model(backend_name: str, ledger_target: str, scenario) -> None:
    clock = FakeClock()
    with Ledger.open(ledger_target, policy=POLICY, clock=clock) as ledger:
        ledger.init()
        m = machine_for(ledger, clock)()
        try:
            m.start_on_an_empty_ledger()
            for step in scenario(m):
                m.rows_equal_the_model()
                step()
            m.rows_equal_the_model()
        finally:
            m.teardown()
