"""Scenario engine: replay claim/takeover/complete sequences against a real
ledger under a virtual clock, and return the timeline.

Built-in scenarios are written in the same step language an operator uses in
a ``scenario.toml`` file (one parser, one interpreter), so an incident can be
reproduced exactly as the built-ins demonstrate the contract.

>>> from idemctl.cli.scenario import builtin
>>> timeline = run_scenario(builtin("takeover"))
>>> [e.outcome.value for e in timeline.events][:3]
['claimed', 'advanced', 'taken_over']
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import IdemctlError, ScenarioError
from ..ledger import Ledger, wall_clock_ms
from ..outcomes import Outcome, Reservation, SweepResult
from ..policy import Policy
from .race import race_processes
from .scenario import Op, Scenario, Step, StepOutcome, mutation_answer
from .timeline import Timeline, TimelineEvent, exact_duration
from .words import state_words

MAX_SWEEP_BATCHES = 10_000
# How often a long step reports its progress (rows): often enough for a bar
# to move, rarely enough to cost nothing next to the writes.
PROGRESS_EVERY = 100
Progress = Callable[[str, int, int], None]


class VirtualClock:
    """Milliseconds that only move when told to: by a scenario's steps, or by
    a test (set `now`, or `advance`).

    >>> clock = VirtualClock(1_000)
    >>> clock.advance(500), clock()
    (1500, 1500)
    """

    def __init__(self, start: int) -> None:
        self.now = start

    def __call__(self) -> int:
        return self.now

    def advance(self, ms: int) -> int:
        self.now += ms
        return self.now


# -- running -------------------------------------------------------------------------------
class _LogTap(logging.Handler):
    """Collects the ledger's log records so each timeline line shows what was logged."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")

    def take(self) -> tuple[str, ...]:
        out, self.lines = tuple(self.lines), []
        return out


@contextlib.contextmanager
def _tap_logs() -> Iterator[_LogTap]:
    logger = logging.getLogger("idemctl")
    tap = _LogTap()
    # With a handler attached, logging's last-resort handler stays quiet, so
    # the ledger's warnings show up in the timeline instead of between its lines.
    logger.addHandler(tap)
    try:
        yield tap
    finally:
        logger.removeHandler(tap)


def _short(body: bytes, limit: int = 60) -> str:
    text = body.decode("utf-8", "replace")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _request_detail(outcome: Outcome, status: int, generation: int | None, body: bytes, retry_after: str | None) -> str:
    if outcome is Outcome.EXECUTED:
        return f"claimed generation {generation}, ran the mutation, stored {status} {_short(body)}"
    if outcome is Outcome.TAKEN_OVER:
        return (
            f"took over the stale reservation as generation {generation}, ran the mutation, "
            f"stored {status} {_short(body)}"
        )
    if outcome is Outcome.FENCED_OUT:
        return f"ran as generation {generation} but was fenced out: answered {status}, nothing stored"
    if outcome is Outcome.REPLAYED:
        return f"replayed {status} {_short(body)} from generation {generation}; nothing ran"
    if outcome is Outcome.IN_PROGRESS:
        return f"{status} in progress (Retry-After: {retry_after}); nothing ran"
    if outcome is Outcome.REUSED:
        return f"{status} reused: same key, different fingerprint; nothing ran or replayed"
    if outcome is Outcome.RETRY:
        return f"{status} retry: the row vanished between claim and lookup"
    return f"{status} {outcome.value}"


@dataclass
class _Runner:
    """Runs steps on `ledger` (at `target`, for racing processes), each
    adding its events to the timeline with what the ledger logged."""

    ledger: Ledger
    clock: VirtualClock
    target: str
    tap: _LogTap
    progress: Progress | None = None
    reservations: dict[tuple[str, str, str], Reservation] = field(default_factory=dict)
    # Every reservation a claim or takeover step got, by (principal, key,
    # generation): `generation = N` completes or releases as that owner, with
    # its fencing token (a reservation made up with no token never matches).
    granted: dict[tuple[str, str, int], Reservation] = field(default_factory=dict)
    events: list[TimelineEvent] = field(default_factory=list)

    def emit(self, step: Step, outcome: Outcome | StepOutcome, detail: str, **kw: Any) -> None:
        concerns_row = step.op not in (Op.ADVANCE, Op.SWEEP)
        if concerns_row and "row" not in kw:
            kw["row"] = self.ledger.lookup(step.principal, step.key)
        self.events.append(
            TimelineEvent(
                step=step.index,
                at=self.clock.now,
                actor=kw.pop("actor", step.actor),
                op=step.op,
                principal=step.principal if concerns_row else None,
                key=step.key if concerns_row else None,
                outcome=outcome,
                detail=detail,
                row_known=kw.pop("row_known", concerns_row),
                expected=kw.pop("expected", step.expect),
                logs=self.tap.take(),
                **kw,
            )
        )

    def run(self, step: Step) -> None:
        getattr(self, f"_{step.op.name.lower()}")(step)

    def _reservation_for(self, step: Step) -> Reservation | None:
        held = self.reservations.get((step.actor, step.principal, step.key))
        if step.generation is not None:
            if held is not None and held.generation == step.generation:
                return held
            owner = self.granted.get((step.principal, step.key, step.generation))
            if owner is None:
                # Completing with no token would be fenced out whatever the row
                # holds, and record a fenced-out event nothing caused.
                self.emit(
                    step,
                    StepOutcome.ERROR,
                    f"no step claimed or took over generation {step.generation} of {step.principal}/{step.key}: "
                    "nothing to act as",
                )
            return owner
        if held is None:
            # The parser rules out a missing claim; this is a claim or takeover that did not succeed.
            self.emit(
                step,
                StepOutcome.ERROR,
                f"actor {step.actor} holds no reservation: its claim or takeover did not succeed (give generation = N)",
            )
        return held

    def _hold(self, step: Step, got: Reservation) -> None:
        self.reservations[(step.actor, step.principal, step.key)] = got
        self.granted[(step.principal, step.key, got.generation)] = got

    def _request(self, step: Step) -> None:
        status, headers, body = mutation_answer(step)
        answer = self.ledger.handle(
            step.principal,
            step.key,
            step.method,
            step.path,
            step.headers,
            step.body,
            lambda _body: (status, headers, body),
        )
        retry_after = answer.header("Retry-After")
        detail = _request_detail(answer.outcome, answer.status, answer.generation, answer.body, retry_after)
        self.emit(step, answer.outcome, detail, http_status=answer.status, generation=answer.generation)

    def _claim(self, step: Step) -> None:
        got = self.ledger.claim(step.principal, step.key, step.fingerprint(self.ledger.policy))
        if got is None:
            self.emit(step, StepOutcome.NOT_CLAIMED, "the key already exists: no reservation")
            return
        self._hold(step, got)
        detail = f"claimed generation {got.generation}; the mutation starts and stalls"
        self.emit(step, StepOutcome.CLAIMED, detail, generation=got.generation)

    def _takeover(self, step: Step) -> None:
        got = self.ledger.takeover(step.principal, step.key, step.fingerprint(self.ledger.policy))
        if got is None:
            detail = "not taken over: the row is fresh, completed, gone or for another request"
            self.emit(step, StepOutcome.NOT_TAKEN_OVER, detail)
            return
        self._hold(step, got)
        self.emit(step, StepOutcome.TAKEN_OVER, f"took over as generation {got.generation}", generation=got.generation)

    def _complete(self, step: Step) -> None:
        reservation = self._reservation_for(step)
        if reservation is None:
            return
        status, headers, body = mutation_answer(step)
        done = self.ledger.complete(reservation, status, headers, body)
        if done.stored:
            note = " (over the body cap: stored as the 500 sentinel)" if done.oversize else ""
            detail = f"stored {done.status} {_short(done.body)} as generation {reservation.generation}{note}"
            self.emit(step, StepOutcome.STORED, detail, http_status=done.status, generation=reservation.generation)
            return
        current = done.event.current_generation if done.event is not None else None
        by = f"generation {current}" if current is not None else "a newer generation"
        detail = (
            f"late completion of generation {reservation.generation} fenced out by {by}: its {done.status} was not "
            f"stored; logged at ERROR and recorded; its own client still gets {done.status}"
        )
        self.emit(step, StepOutcome.FENCED_OUT, detail, http_status=done.status, generation=reservation.generation)

    def _release(self, step: Step) -> None:
        reservation = self._reservation_for(step)
        if reservation is None:
            return
        generation = reservation.generation
        if self.ledger.release(reservation):
            detail = f"released generation {generation}: the next retry runs again"
            self.emit(step, StepOutcome.RELEASED, detail, generation=generation)
        else:
            detail = f"nothing released: generation {generation} no longer holds a pending row"
            self.emit(step, StepOutcome.NOT_RELEASED, detail, generation=generation)

    def _advance(self, step: Step) -> None:
        self.clock.advance(step.by_ms)
        self.emit(step, StepOutcome.ADVANCED, f"virtual clock +{exact_duration(step.by_ms)}")

    def _sweep(self, step: Step) -> None:
        batch = step.batch or self.ledger.policy.sweep_batch
        number = 0

        def emit_batch(result: SweepResult) -> None:
            # One timeline line per batch; the step's expectation is checked
            # on its last batch only.
            nonlocal number
            number += 1
            drained = result.deleted == 0
            extra = f" and {result.fenced_deleted} fenced-out events" if result.fenced_deleted else ""
            detail = (
                f"batch {number} (at most {batch}): nothing left past retention"
                if drained
                else f"batch {number} (at most {batch}): deleted {result.keys_deleted} rows{extra}"
            )
            last = drained or not step.until_empty
            self.emit(
                step,
                StepOutcome.DRAINED if drained else StepOutcome.SWEPT,
                detail,
                deleted=result.deleted,
                expected=step.expect if last else None,
            )

        self.ledger.operator.drain(
            batch=batch,
            max_batches=MAX_SWEEP_BATCHES if step.until_empty else 1,
            retention_ms=step.retention_ms,
            on_batch=emit_batch,
        )

    def _inspect(self, step: Step) -> None:
        view = self.ledger.operator.get(step.principal, step.key)
        if view is None:
            detail = "no row: the next request with this key runs the mutation"
            self.emit(step, StepOutcome.NOT_FOUND, detail, row=None)
            return
        fenced = list(self.ledger.operator.fenced(principal=step.principal, key=step.key))
        extra = f"; {len(fenced)} fenced-out event(s) for this key" if fenced else ""
        detail = state_words(view) + extra
        self.emit(step, StepOutcome.INSPECTED, detail, row=view.row, view=view, generation=view.row.generation)

    def _purge(self, step: Step) -> None:
        result = self.ledger.operator.purge(step.principal, step.key, force=step.force)
        outcomes = {"purged": StepOutcome.PURGED, "not_found": StepOutcome.NOT_FOUND}
        outcome = outcomes.get(result.outcome.value, StepOutcome.REFUSED)
        detail = {
            StepOutcome.PURGED: "deleted: the client's next retry runs the mutation again",
            StepOutcome.NOT_FOUND: "no row to purge",
            StepOutcome.REFUSED: (
                "refused: the row is pending and fresh, its owner may still be running (force = true overrides)"
            ),
        }[outcome]
        self.emit(step, outcome, detail)

    def _fill(self, step: Step) -> None:
        policy = self.ledger.policy
        fp = step.fingerprint(policy)
        made = 0
        keys = step.fill_keys()
        for done, key in enumerate(keys, 1):
            got = self.ledger.claim(step.principal, key, fp)
            if got is not None:
                body = json.dumps({"order": key}).encode()
                self.ledger.complete(got, 201, (("Content-Type", "application/json"),), body)
                made += 1
            if self.progress is not None and (done % PROGRESS_EVERY == 0 or done == len(keys)):
                self.progress(f"step {step.index}: fill", done, len(keys))
        first, last = step.fill_keys()[0], step.fill_keys()[-1]
        self.emit(
            replace(step, key=last),
            StepOutcome.FILLED,
            f"{made} completed rows {step.principal}/{first} … {last}",
            row_known=False,
            row=None,
        )

    def _race(self, step: Step) -> None:
        results = race_processes(self.target, step, self.ledger.policy, self.clock.now)
        ran = [r for r in results if r.outcome is not None and r.outcome.ran_mutation]
        for r in results:
            if r.outcome is None:
                detail = f"pid {r.pid}: {r.error}"
                self.emit(step, StepOutcome.ERROR, detail, actor=f"w{r.worker}", pid=r.pid, expected=None)
                continue
            detail = _request_detail(r.outcome, r.status or 0, r.generation, r.body, r.retry_after)
            self.emit(
                step,
                r.outcome,
                f"pid {r.pid}: {detail}",
                actor=f"w{r.worker}",
                pid=r.pid,
                http_status=r.status,
                generation=r.generation,
                expected=None,
            )
        others: dict[str, int] = {}
        for r in results:
            if r.outcome is not None and not r.outcome.ran_mutation:
                others[r.outcome.value] = others.get(r.outcome.value, 0) + 1
        rest = ", ".join(f"{n} {name}" for name, n in sorted(others.items()))
        summary = f"{len(results)} processes, {len(ran)} ran the mutation" + (f"; {rest}" if rest else "")
        outcome = StepOutcome.RACED if len(ran) == 1 else StepOutcome.RACE_FAILED
        self.emit(step, outcome, summary, actor="race")


def run_scenario(
    scenario: Scenario,
    target: str | os.PathLike[str] | None = None,
    *,
    policy: Policy | None = None,
    wall_clock: Callable[[], int] = wall_clock_ms,
    progress: Progress | None = None,
) -> Timeline:
    """Run `scenario` against the existing ledger at `target`, or a
    temporary one when `target` is None. A named ledger must exist and hold
    the schema (`idemctl init`): a mistyped path or URL is an error
    (LedgerNotFoundError, SchemaMissingError), never a new ledger.

    The virtual clock starts early enough that the timeline ends at the wall
    clock's now (unless the scenario sets `start`), so rows written into a
    real ledger have sensible ages when inspected afterwards. The keys the
    scenario writes are purged first (forced), so running it again replays
    the same story instead of finding last run's rows. `progress(what,
    done, total)` hears how the long steps (a `fill`, that first purge) go.

    >>> from idemctl.cli.scenario import builtin
    >>> run_scenario(builtin("happy")).ok
    True
    """
    base = policy or Policy()
    try:
        policy = replace(
            base,
            pending_ttl_ms=scenario.pending_ttl_ms or base.pending_ttl_ms,
            retention_ms=scenario.retention_ms or base.retention_ms,
        )
    except IdemctlError as exc:
        raise ScenarioError(f"{scenario.name}: {exc}") from None
    start = scenario.start_ms if scenario.start_ms is not None else wall_clock() - scenario.span_ms()
    clock = VirtualClock(start)
    with contextlib.ExitStack() as stack:
        if target is None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="idemctl-sim-"))
            where = os.path.join(tmp, "simulation.db")
            ledger = stack.enter_context(Ledger.open(where, policy=policy, clock=clock))
            ledger.init()
        else:
            where = os.fspath(target)
            ledger = stack.enter_context(Ledger.open(where, policy=policy, clock=clock, create=False))
            ledger.require_schema()
        shown = ledger.describe()
        written = scenario.keys()
        reset_keys = []
        for done, pk in enumerate(written, 1):
            if ledger.operator.purge(*pk, force=True).row is not None:
                reset_keys.append(pk)
            if (
                progress is not None
                and len(written) >= PROGRESS_EVERY
                and (done % PROGRESS_EVERY == 0 or done == len(written))
            ):
                progress("purging the keys of an earlier run", done, len(written))
        reset = tuple(reset_keys)
        tap = stack.enter_context(_tap_logs())
        runner = _Runner(ledger, clock, where, tap, progress)
        for step in scenario.steps:
            runner.run(step)
    return Timeline(
        scenario=scenario,
        database=None if target is None else shown,
        policy=policy,
        start=start,
        end=clock.now,
        reset=reset,
        events=tuple(runner.events),
    )
