"""The ledger is its request flow, built on the single steps, and carries
its other parts: what apps call is on `Ledger` (the flow's and the steps'
own methods, or the core's and the housekeeping's bound on the instance,
with no layer between), what
operators call is on `ledger.operator` (the CLI's side), and the old
operator names on the ledger, deprecated, warn once and answer exactly
what the operator answers."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from idemctl import Ledger, Policy
from idemctl.cli import app
from idemctl.ledger import LedgerCore, Operator, deprecated
from idemctl.ledger.housekeeping import Housekeeping
from idemctl.ledger.requests import RequestFlow
from idemctl.ledger.steps import SingleSteps
from idemctl.outcomes import PurgeOutcome, State, Verdict

T0 = 1_700_000_000_000
TTL = 30_000
RETENTION = 3_600_000

# Every name the operator's side kept on the ledger.
OLD_OPERATOR_NAMES = (
    "get",
    "view",
    "pending",
    "fenced",
    "predict",
    "stats",
    "purge",
    "sweep",
    "drain",
    "drain_batch",
    "count_expired",
    "count_fenced_expired",
    "count_rows",
    "copy_to",
)
# What the request gate and the adapters call on a ledger.
GATE_NAMES = {
    "begin_steps": RequestFlow.begin_steps,
    "finish_steps": RequestFlow.finish_steps,
    "abandon_steps": RequestFlow.abandon_steps,
    "begin": RequestFlow.begin,
    "finish": RequestFlow.finish,
    "abandon": RequestFlow.abandon,
    "refuse": RequestFlow.refuse,
    "shape": RequestFlow.shape,
    "handle": RequestFlow.handle,
    "sweep_due": Housekeeping.sweep_due,
    "after_response": Housekeeping.after_response,
    "after_response_steps": Housekeeping.after_response_steps,
    "async_store": LedgerCore.async_store,
    "publish": LedgerCore.publish,
    "subscribe": LedgerCore.subscribe,
    "now": LedgerCore.now,
}


def made(body: bytes) -> Callable[[bytes], tuple[int, dict[str, str], bytes]]:
    return lambda _: (201, {"content-type": "text/plain"}, body)


def a_ledger_with_every_state(clock: list[int]) -> Ledger:
    """Rows completed, pending fresh, pending stale and past retention, and
    one fenced-out event, all at fixed times: two of these are equal."""
    ledger = Ledger.open(":memory:", policy=Policy(pending_ttl_ms=TTL, retention_ms=RETENTION), clock=lambda: clock[0])
    ledger.init()
    ledger.handle("acct_1", "old", "POST", "/orders", {}, b"", made(b"old"))
    late = ledger.claim("acct_1", "fenced", "fp")
    clock[0] += RETENTION + 1
    ledger.handle("acct_1", "done", "POST", "/orders", {}, b"", made(b"done"))
    assert late is not None
    ledger.complete(ledger.takeover("acct_1", "fenced", "fp"), 201, {}, b"new")  # type: ignore[arg-type]
    ledger.complete(late, 201, {}, b"late")
    ledger.claim("acct_2", "stale", "fp")
    clock[0] += TTL + 1
    ledger.claim("acct_2", "fresh", "fp")
    return ledger


def test_the_ledger_is_its_request_flow_built_on_the_single_steps_and_nothing_else():
    assert Ledger.__mro__ == (Ledger, RequestFlow, SingleSteps, object)
    # The operator's side, the housekeeping and the core stay parts it holds.
    ledger = Ledger.open(":memory:")
    assert [type(part) for part in (ledger.core, ledger.operator)] == [LedgerCore, Operator]
    assert not isinstance(ledger, (LedgerCore, Operator, Housekeeping))


def test_what_the_gate_calls_is_on_the_ledger_as_each_parts_own_method():
    ledger = Ledger.open(":memory:")
    # Bound once at opening: calling it goes through no method of the ledger's own.
    assert {name: getattr(ledger, name).__func__ for name in GATE_NAMES} == GATE_NAMES
    assert isinstance(ledger.policy, Policy)
    assert ledger.store is ledger.core.store is ledger.operator.store


def test_what_the_gate_calls_keeps_its_signature():
    ledger = Ledger.open(":memory:")
    # begin, finish and abandon take what their steps take (decision.blocking).
    names = ("begin_steps", "finish_steps", "abandon_steps", "refuse")
    shown = {name: str(inspect.signature(getattr(ledger, name))) for name in names}
    assert shown == {
        "begin_steps": "(principal: 'str | None', key: 'str | None', method: 'str', path_and_query: 'str', "
        "headers: 'HeadersLike | None', body: 'bytes | bytearray | memoryview') -> 'decision.Steps[Answer | Ticket]'",
        "finish_steps": "(ticket: 'Ticket', status: 'int', headers: 'HeadersLike | None', "
        "body: 'bytes | bytearray | memoryview | str | responses.OversizeBody') -> 'decision.Steps[Answer]'",
        "abandon_steps": "(ticket: 'Ticket', *, release: 'bool' = False) -> 'decision.Steps[None]'",
        "refuse": "(refusal: 'tuple[int, responses.Headers, bytes]', outcome: 'Outcome', *, "
        "principal: 'str | None', key: 'str | None', method: 'str', path: 'str') -> 'Answer'",
    }


def test_the_operator_carries_the_reads_and_the_chores_and_none_of_the_request_path():
    operator = Ledger.open(":memory:").operator
    assert isinstance(operator, Operator)
    assert [name for name in OLD_OPERATOR_NAMES if not hasattr(operator, name)] == []
    assert [
        name for name in ("begin", "finish", "abandon", "handle", "claim", "idempotent") if hasattr(operator, name)
    ] == []


@pytest.mark.parametrize("name", [n for n in OLD_OPERATOR_NAMES if n != "drain_batch"])
def test_each_old_name_on_the_ledger_takes_what_the_operators_method_takes(name):
    ledger = Ledger.open(":memory:")
    assert inspect.signature(getattr(ledger, name)).parameters.keys() - {"self"} == set(
        inspect.signature(getattr(ledger.operator, name)).parameters
    )


# One call per old name, made the same way on two equal ledgers: the old
# name on one, the operator's method on the other.
CALLS: dict[str, Callable[[Any, Ledger], Any]] = {
    "get": lambda side, led: side.get("acct_1", "done"),
    "view": lambda side, led: side.view(led.lookup("acct_2", "stale")),
    "pending": lambda side, led: list(side.pending()),
    "pending_stale": lambda side, led: list(side.pending(stale_only=True, principal="acct_2")),
    "fenced": lambda side, led: list(side.fenced(principal="acct_1")),
    "predict": lambda side, led: side.predict("acct_1", "done", "other"),
    "stats": lambda side, led: side.stats(),
    "purge": lambda side, led: (side.purge("acct_1", "done"), side.purge("acct_2", "fresh")),
    "sweep": lambda side, led: side.sweep(batch=1),
    "drain": lambda side, led: side.drain(batch=1),
    "drain_batch": lambda side, led: side.drain_batch,
    "count_expired": lambda side, led: side.count_expired(),
    "count_fenced_expired": lambda side, led: side.count_fenced_expired(fenced_retention_ms=1),
    "count_rows": lambda side, led: side.count_rows(),
}


@pytest.fixture
def no_old_name_warned_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each old name warns once per process: start each test from none.
    monkeypatch.setattr(deprecated, "_warned", set())


@pytest.mark.parametrize("name", sorted(CALLS))
def test_each_old_name_on_the_ledger_warns_once_and_answers_what_the_operator_answers(name, no_old_name_warned_yet):
    old, new = a_ledger_with_every_state([T0]), a_ledger_with_every_state([T0])
    call = CALLS[name]
    called = name.removesuffix("_stale")
    with pytest.warns(DeprecationWarning) as warned:
        answered = call(old, old)
    assert [str(w.message) for w in warned] == [
        f"Ledger.{called} is deprecated: call ledger.operator.{called}, which answers the same"
    ]
    assert warned[0].filename == __file__  # it points at the caller's line
    assert answered == call(new.operator, new)
    # And the two ledgers are still equal: the old name changed what the operator's method did.
    assert old.operator.stats() == new.operator.stats()
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        call(old, old)
    assert again == []  # once per name per process


def test_copy_to_under_its_old_name_warns_and_copies_what_the_operator_copies(no_old_name_warned_yet):
    old, new = a_ledger_with_every_state([T0]), a_ledger_with_every_state([T0])
    into_old, into_new = Ledger.open(":memory:"), Ledger.open(":memory:")
    into_old.init(), into_new.init()
    with pytest.warns(DeprecationWarning, match=r"^Ledger\.copy_to is deprecated"):
        by_old = old.copy_to(into_old)
    by_operator = new.operator.copy_to(into_new.operator)
    assert by_old == by_operator
    assert [v.row for v in into_old.operator.pending(now=T0)] == [v.row for v in into_new.operator.pending(now=T0)]
    assert into_old.operator.count_rows() == into_new.operator.count_rows() == 5


def test_each_old_name_warns_on_its_own(no_old_name_warned_yet):
    ledger = a_ledger_with_every_state([T0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ledger.stats(), ledger.stats(), ledger.count_rows(), ledger.drain_batch, ledger.drain_batch
    assert [str(w.message).split()[0] for w in caught] == ["Ledger.stats", "Ledger.count_rows", "Ledger.drain_batch"]
    assert {w.category for w in caught} == {DeprecationWarning}


def test_the_old_names_answer_about_the_rows_they_are_asked_about():
    # The comparison above must compare something: the answers are real ones.
    clock = [T0]
    ledger = a_ledger_with_every_state(clock).operator
    assert [(v.row.key, v.state) for v in ledger.pending()] == [
        ("stale", State.PENDING_STALE),
        ("fresh", State.PENDING_FRESH),
    ]
    assert ledger.predict("acct_1", "done", "other").verdict is Verdict.REUSED
    assert [e.superseded_generation for e in ledger.fenced()] == [1]
    assert (ledger.count_rows(), ledger.count_expired()) == (5, 1)
    assert ledger.purge("acct_2", "fresh").outcome is PurgeOutcome.REFUSED_FRESH_PENDING


def test_setting_the_clock_moves_every_part_onto_it():
    ledger = Ledger.open(":memory:", clock=lambda: T0)
    ledger.init()
    ledger.clock = lambda: T0 + 5
    assert (ledger.now(), ledger.operator.now(), ledger.core.now()) == (T0 + 5, T0 + 5, T0 + 5)
    ticket = ledger.begin("acct_1", "k1", "POST", "/orders", {}, b"")
    assert ticket.started_at == T0 + 5  # type: ignore[union-attr]


def test_the_cli_reads_through_the_ledgers_operator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    db = str(tmp_path / "l.db")
    with Ledger.open(db) as ledger:
        ledger.init()
        ledger.claim("acct_1", "k1", "fp")
    asked: list[object] = []
    real_stats = Operator.stats

    def stats(self: Operator, **kw: Any) -> Any:
        asked.append(self)
        return real_stats(self, **kw)

    monkeypatch.setattr(Operator, "stats", stats)
    result = CliRunner().invoke(app, ["--db", db, "stats", "--json"], prog_name="idemctl")
    assert result.exit_code == 0, result.stderr
    assert [type(o) for o in asked] == [Operator]
    assert '"pending_fresh": 1' in result.stdout


def test_parts_built_on_one_core_share_its_state():
    core = LedgerCore(Ledger.open(":memory:").store, clock=lambda: T0)
    core.init()
    flow = RequestFlow(core)
    operator = Operator(core, Housekeeping(core))
    flow.handle("acct_1", "k1", "POST", "/orders", {}, b"", made(b"x"))
    assert operator.get("acct_1", "k1").row.response_body == "x"  # type: ignore[union-attr]
