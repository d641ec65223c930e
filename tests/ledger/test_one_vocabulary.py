"""One vocabulary between the decision loop and the stores.

The loop (idemctl/decision.py and the ledger's steps) yields what it needs
as the store's own values: a Statement, a Turn, Tables, or a Pause. The
synchronous driver runs each with ``store.run(op)``, the asynchronous one
with ``await async_store.run(op)``; nothing resolves a store operation by
name. Here the same loop, and the same Policy-combination model
(test_policy_combinations_model.py), is driven three ways: the synchronous
driver, the asynchronous driver, and a fake in-memory store that answers
the statements in Python. The three must agree on every outcome and on the
sequence of request-path statements asked for."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from idemctl import Answer, Ledger, Outcome, Policy, Status, Ticket, decision
from idemctl.outcomes import FencedEvent, StoredRow, SweepResult
from idemctl.storage import open_engine
from idemctl.storage.aio import AsyncStore
from idemctl.storage.statements import TABLES
from idemctl.storage.store import Statement, Store, StoreOp, Tables, Turn
from tests.helpers import ROOT, FakeClock, step_of
from tests.ledger.test_policy_combinations_model import machine_for

# The parameters that differ from one run of a history to the next by
# design: the principal (a new one per example) and the fencing token (random).
_VARYING = ("principal", "token")


def _entry(op: StoreOp) -> tuple[Any, ...] | None:
    """What a request-path statement asked for, with the varying values masked."""
    step = step_of(op)
    if step is None:
        return None
    assert type(op) is Statement
    return (step, op.write, tuple(sorted((k, "*" if k in _VARYING else v) for k, v in op.params.items())))


class RecordingStore(Store):
    """A Store that notes every request-path statement it runs. The
    database's clock is answered by `clock` (the fake clock), so that a
    history with clock="database" is the same history on every run."""

    def __init__(self, engine: Any, clock: FakeClock, seen: list[tuple[Any, ...]]) -> None:
        super().__init__(engine)
        self.fake_clock, self.seen = clock, seen

    def run(self, op: Any) -> Any:  # type: ignore[override]
        entry = _entry(op)
        if entry is not None:
            self.seen.append(entry)
            if entry[0] == "database_now":
                return self.fake_clock()
        return super().run(op)


@dataclasses.dataclass
class _Row:
    fingerprint: str
    status: Status
    generation: int
    token: int | None
    created_at: int
    updated_at: int
    response_status: int | None = None
    response_body: str | bytes | None = None
    response_headers: str | None = None


class FakeStore(RecordingStore):
    """The store's request path in Python, over a dict: each statement the
    loop yields is answered by what its SQL would do (statements.py), with
    no database at all. It spells the statements as SQLite does (it is
    built on a ``:memory:`` engine only for the dialect)."""

    def __init__(self, clock: FakeClock, seen: list[tuple[Any, ...]]) -> None:
        super().__init__(open_engine(":memory:"), clock, seen)
        self.rows: dict[tuple[str, str], _Row] = {}
        self.events: list[FencedEvent] = []

    def run(self, op: Any) -> Any:  # type: ignore[override]
        if type(op) is Tables:
            return frozenset(TABLES)
        assert type(op) is Statement, f"the request path asked the fake store for {op!r}"
        entry = _entry(op)
        assert entry is not None, f"not a request-path statement: {op.sql}"
        self.seen.append(entry)
        return getattr(self, "_" + entry[0])(**op.params)

    def _stored(self, principal: str, key: str) -> StoredRow | None:
        row = self.rows.get((principal, key))
        if row is None:
            return None
        return StoredRow(
            principal,
            key,
            row.fingerprint,
            row.status,
            row.generation,
            row.response_status,
            row.response_body,
            row.response_headers,
            row.created_at,
            row.updated_at,
        )

    def _database_now(self) -> int:
        return self.fake_clock()

    def _claim(self, principal: str, key: str, fingerprint: str, token: int, now: int) -> int | None:
        if (principal, key) in self.rows:
            return None
        self.rows[principal, key] = _Row(fingerprint, Status.PENDING, 1, token, now, now)
        return 1

    def _lookup(self, principal: str, key: str) -> StoredRow | None:
        return self._stored(principal, key)

    def _takeover(
        self, principal: str, key: str, fingerprint: str, token: int, now: int, stale_before: int, expired_before: int
    ) -> int | None:
        row = self.rows.get((principal, key))
        if row is None:
            return None
        stale = row.status is Status.PENDING and row.fingerprint == fingerprint and row.updated_at < stale_before
        if not (stale or row.updated_at < expired_before):
            return None
        created = now if row.updated_at < expired_before else row.created_at
        self.rows[principal, key] = _Row(fingerprint, Status.PENDING, row.generation + 1, token, created, now)
        return row.generation + 1

    def _mine(self, principal: str, key: str, generation: int, token: int | None) -> _Row | None:
        row = self.rows.get((principal, key))
        return row if row is not None and (row.generation, row.token) == (generation, token) else None

    def _complete(
        self,
        principal: str,
        key: str,
        generation: int,
        token: int | None,
        status: int,
        body: str | bytes | None,
        headers: str,
        now: int,
    ) -> bool:
        row = self._mine(principal, key, generation, token)
        if row is None or row.status is not Status.PENDING:
            return False
        row.status, row.response_status, row.response_body, row.response_headers = (
            Status.COMPLETED,
            status,
            body,
            headers,
        )
        row.updated_at = now
        return True

    def _completed_as(
        self,
        principal: str,
        key: str,
        generation: int,
        token: int | None,
        status: int,
        body: str | bytes | None,
        no_body: int,
        headers: str,
    ) -> bool:
        row = self._mine(principal, key, generation, token)
        return (
            row is not None
            and row.status is Status.COMPLETED
            and row.response_status == status
            and row.response_headers == headers
            and (row.response_body == body or (row.response_body is None and no_body == 1))
        )

    def _release(self, principal: str, key: str, generation: int, token: int | None) -> bool:
        row = self._mine(principal, key, generation, token)
        if row is None or row.status is not Status.PENDING:
            return False
        del self.rows[principal, key]
        return True

    def _record_fenced(self, principal: str, key: str, generation: int, status: int, now: int) -> FencedEvent:
        current = self.rows.get((principal, key))
        event = FencedEvent(
            len(self.events) + 1,
            principal,
            key,
            generation,
            None if current is None else current.generation,
            status,
            now,
        )
        self.events.append(event)
        return event

    # An operator's sweep (the model calls Ledger.sweep), not the request path.
    def sweep(self, now: int, cutoff: int, fenced_cutoff: int, limit: int) -> SweepResult:  # type: ignore[override]
        gone = sorted((row.updated_at, where) for where, row in self.rows.items() if row.updated_at < cutoff)[:limit]
        for _, where in gone:
            del self.rows[where]
        return SweepResult(len(gone), 0, cutoff, fenced_cutoff)


class ThreadlessAsyncStore(AsyncStore):
    """The asynchronous driver's store over a synchronous one: each
    operation is awaited (a real suspension on the event loop) and then run
    by the Store, so the async driver (shielded writes, unshielded reads,
    the orphan path) runs the very ops the sync driver would, on SQLite."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.lands_in_place = True  # writes awaited in the caller's task (idemctl/landing.py)

    async def run(self, op: Any) -> Any:  # type: ignore[override]
        await asyncio.sleep(0)
        return self.store.run(op)


class DriverLedger(Ledger):
    """A Ledger whose begin, finish and abandon drive their steps through
    one chosen driver ("sync", "async"); ``handle`` goes through them."""

    driver = "sync"

    def _drive(self, steps: decision.Steps[Any]) -> Any:
        if self.driver == "sync":
            return decision.run(steps)

        async def on_a_loop() -> Any:
            return await decision.run_async(steps, asyncio.to_thread, store=ThreadlessAsyncStore(self.store))

        return asyncio.run(on_a_loop())

    def begin(self, *args: Any, **kwargs: Any) -> Answer | Ticket:  # type: ignore[override]
        return self._drive(self.begin_steps(*args, **kwargs))  # type: ignore[no-any-return]

    def finish(self, *args: Any, **kwargs: Any) -> Answer:  # type: ignore[override]
        return self._drive(self.finish_steps(*args, **kwargs))  # type: ignore[no-any-return]

    def abandon(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self._drive(self.abandon_steps(*args, **kwargs))


DRIVERS = ("sync", "async", "fake")


def opener(driver: str, fake: FakeClock, seen: list[tuple[Any, ...]], outcomes: list[Any]) -> Callable[..., Ledger]:
    def open_ledger(target: str, policy: Policy, clock: Any) -> Ledger:
        store = FakeStore(fake, seen) if driver == "fake" else RecordingStore(open_engine(target), fake, seen)
        ledger = DriverLedger(store, policy=policy, clock="database" if clock == "database" else fake)
        ledger.driver = "async" if driver == "async" else "sync"
        ledger.subscribe(lambda event: outcomes.append((event.outcome, event.generation, event.status)))
        return ledger

    return open_ledger


class TickingTime:
    """The decision loop's monotonic clock, moved on 10 ms by every reading
    and by every pause it sleeps through: an in-progress wait then polls
    the same number of times through every driver (and at once)."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 0.01
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(autouse=True)
def ticking_time(monkeypatch: pytest.MonkeyPatch) -> TickingTime:
    ticking = TickingTime()
    monkeypatch.setattr(decision, "time", ticking)
    return ticking


def fresh_target(tmp_path: Path, driver: str) -> str:
    """A new SQLite ledger for one driver's run (the fake store needs none)."""
    target = str(tmp_path / f"{driver}.db")
    with Ledger.open(target) as ledger:
        ledger.init()
    return target


def test_the_policy_model_asks_the_same_statements_and_gets_the_same_outcomes_through_every_driver(tmp_path):
    # The same derandomized history, run through each driver: the same
    # draws give the same requests, so any difference is the driver's.
    runs: dict[str, tuple[list[tuple[Any, ...]], list[Any]]] = {}
    for driver in DRIVERS:
        seen: list[tuple[Any, ...]] = []
        outcomes: list[Any] = []
        fake = FakeClock()
        machine = machine_for(fresh_target(tmp_path, driver), fake, opener(driver, fake, seen, outcomes))
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=30,
                stateful_step_count=20,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
            ),
        )
        runs[driver] = (seen, outcomes)
    sync_seen, sync_outcomes = runs["sync"]
    steps_asked = {entry[0] for entry in sync_seen}
    # The history exercised the loop's main branches. A release needs a
    # mutation that raises and asks for it, which a derandomized run of 30
    # examples reaches under some Hypothesis versions and not others: the
    # scripted history below releases through every driver.
    assert {"claim", "lookup", "takeover", "complete"} <= steps_asked, steps_asked
    assert {o[0] for o in sync_outcomes} >= {Outcome.EXECUTED, Outcome.REPLAYED, Outcome.REUSED}
    for driver in ("async", "fake"):
        seen, outcomes = runs[driver]
        assert outcomes == sync_outcomes, f"{driver}: outcomes differ from the sync driver's"
        assert seen == sync_seen, f"{driver}: statements differ from the sync driver's"


def scenario(ledger: Ledger, clock: FakeClock) -> list[Any]:
    """A fixed history through the loop's branches: a new key, its replay,
    a reused key, a wait that times out, a takeover, a fenced-out late
    completion, a release, a completion retried after its reply was lost."""
    body = b'{"sku":"x"}'
    got: list[Any] = []

    def begin(key: str, request: bytes = body) -> Answer | Ticket:
        return ledger.begin("acct", key, "POST", "/orders", {}, request)

    first = begin("k1")
    assert isinstance(first, Ticket)
    got.append(ledger.finish(first, 201, {"content-type": "application/json"}, b'{"id":1}').wire)
    for decided in (begin("k1"), begin("k1", b"other")):
        assert isinstance(decided, Answer)
        got.append((decided.outcome, decided.status))
    stalled = begin("k2")
    assert isinstance(stalled, Ticket)
    busy = begin("k2")
    assert isinstance(busy, Answer)
    got.append((busy.outcome, busy.status))
    clock.advance(ledger.policy.pending_ttl_ms + 1)
    took = begin("k2")
    assert isinstance(took, Ticket)
    got.append(took.outcome)
    late = ledger.finish(stalled, 201, {}, b"late")
    got.append((late.outcome, late.status))
    got.append(ledger.finish(took, 202, {}, b"ok").outcome)
    dropped = begin("k3")
    assert isinstance(dropped, Ticket)
    ledger.abandon(dropped, release=True)
    got.append(ledger.lookup("acct", "k3"))
    again = begin("k3")
    assert isinstance(again, Ticket)
    got.append(again.outcome)
    return got


def test_a_fixed_history_is_the_same_through_the_sync_driver_the_async_driver_and_the_fake_store(tmp_path):
    results = {}
    for driver in DRIVERS:
        seen: list[tuple[Any, ...]] = []
        fake = FakeClock()
        ledger = opener(driver, fake, seen, [])(fresh_target(tmp_path, driver), Policy(pending_ttl_ms=1_000), fake)
        results[driver] = (scenario(ledger, fake), seen)
        ledger.close()
    outcomes, seen = results["sync"]
    assert outcomes[1:5] == [
        (Outcome.REPLAYED, 201),
        (Outcome.REUSED, 409),
        (Outcome.IN_PROGRESS, 409),
        Outcome.TAKEN_OVER,
    ]
    assert outcomes[5] == (Outcome.FENCED_OUT, 201) and outcomes[7] is None and outcomes[8] is Outcome.EXECUTED
    assert [entry[0] for entry in seen] == [
        "claim",
        "complete",  # a new key
        "claim",
        "lookup",  # its replay (SQLite: the lookup follows the lost claim)
        "claim",
        "lookup",  # another request under the key
        "claim",
        "claim",
        "lookup",
        "takeover",  # k2 claimed; its duplicate finds it fresh
        "claim",
        "lookup",
        "takeover",  # past the TTL: taken over
        "complete",
        "record_fenced",  # the stalled owner, fenced out
        "complete",  # the new owner
        "claim",
        "release",
        "lookup",
        "claim",  # released, then claimed afresh
    ]
    for driver in ("async", "fake"):
        assert results[driver] == results["sync"], driver


def test_no_code_path_resolves_a_store_operation_by_name():
    # The message that named a store method is gone, and neither driver
    # nor the async store looks an attribute up by a computed name.
    assert not hasattr(decision, "Call")
    for module in (
        "idemctl/decision.py",
        "idemctl/storage/aio.py",
        "idemctl/storage/store.py",
        "idemctl/storage/store_base.py",
        "idemctl/ledger/steps.py",
        "idemctl/ledger/housekeeping.py",
        "idemctl/ledger/requests.py",
    ):
        tree = ast.parse((ROOT / module).read_text(encoding="utf-8"))
        # The operators' synchronous wrappers (store.py's `runs` and
        # `runs_steps`) find the builder they wrap under its own name, so that
        # a store class with builders of its own (Redis's) runs those: that
        # is a method override, never on the request path, and the only
        # lookups allowed.
        wrappers = [
            node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name in ("runs", "runs_steps")
        ]
        allowed = {id(inner) for wrapper in wrappers for inner in ast.walk(wrapper)}
        by_name = [
            node.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and not (len(node.args) > 1 and isinstance(node.args[1], ast.Constant))
            and id(node) not in allowed
        ]
        assert by_name == [], f"{module} looks an attribute up by a computed name at lines {by_name}"
    # Every operation the loop yields is one a store runs: the async store
    # has one verb, as the Store has.
    ops = {
        "claim",
        "claim_or_read",
        "lookup",
        "takeover",
        "complete",
        "completed_as",
        "release",
        "record_fenced",
        "database_now",
        "sweep",
    }
    assert not ops & set(vars(AsyncStore)), "AsyncStore re-implements a Store operation by name"
    assert {"run", "run_steps"} <= set(vars(AsyncStore))
    assert Turn.__dataclass_fields__.keys() == {"store", "statements"}
