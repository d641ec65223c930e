"""The timeline of a simulation: what each step did, as a `--json` document
and as lines for a person."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from ..durations import human_duration, iso
from ..outcomes import Outcome, RowView, StoredRow
from ..policy import Policy
from .scenario import Op, Scenario, StepOutcome


def exact_duration(ms: int) -> str:
    """A duration with every unit it holds, unrounded, so that a clock step
    reads as the clock column moves: ``"1 d 1 s"`` is +24:00:01.

    >>> exact_duration(86_401_000), exact_duration(31_000), exact_duration(1_500)
    ('1 d 1 s', '31 s', '1 s 500 ms')
    """
    if ms <= 0:
        return f"{ms} ms"
    parts = []
    rest = ms
    for name, size in (("d", 86_400_000), ("h", 3_600_000), ("min", 60_000), ("s", 1000), ("ms", 1)):
        count, rest = divmod(rest, size)
        if count:
            parts.append(f"{count} {name}")
    return " ".join(parts)


@dataclass(frozen=True)
class TimelineEvent:
    """One line of the timeline: what a step, one batch of a sweep or one
    racing process did (not the ledger's `idemctl.Event`)."""

    step: int  # index of the scenario step that produced it
    at: int  # virtual ms since the epoch
    actor: str
    op: Op
    principal: str | None
    key: str | None
    outcome: Outcome | StepOutcome
    detail: str
    http_status: int | None = None
    generation: int | None = None  # the generation this actor acted as
    row: StoredRow | None = None  # the row after the step (None: no row)
    row_known: bool = True  # False for clock and sweep steps, which concern no single row
    view: RowView | None = None
    deleted: int | None = None
    pid: int | None = None
    expected: str | None = None
    logs: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        if self.outcome in (StepOutcome.RACE_FAILED, StepOutcome.ERROR):
            return False
        return self.expected is None or self.expected == self.outcome.value


@dataclass(frozen=True)
class Timeline:
    """A scenario's run: where, under which policy, and every event in order."""

    scenario: Scenario
    database: str | None  # where it ran, safe to print (no password); None: a temporary database
    policy: Policy
    start: int
    end: int
    reset: tuple[tuple[str, str], ...]  # keys left by an earlier run, purged first
    events: tuple[TimelineEvent, ...]

    @property
    def ok(self) -> bool:
        return all(e.ok for e in self.events)

    def failures(self) -> list[TimelineEvent]:
        return [e for e in self.events if not e.ok]


def timeline_event_json(event: TimelineEvent, start: int) -> dict[str, Any]:
    """One line of a simulated timeline; `t_ms` counts from the timeline's `start`."""
    return {
        "step": event.step,
        "t_ms": event.at - start,
        "at": event.at,
        "actor": event.actor,
        "op": event.op.value,
        "principal": event.principal,
        "key": event.key,
        "outcome": event.outcome.value,
        "http_status": event.http_status,
        "generation": event.generation,
        "detail": event.detail,
        "row": None if event.row is None else {"status": event.row.status.value, "generation": event.row.generation},
        "deleted": event.deleted,
        "pid": event.pid,
        "expected": event.expected,
        "ok": event.ok,
        "logs": list(event.logs),
    }


def timeline_json(timeline: Timeline) -> dict[str, Any]:
    """`simulate --json`: the scenario, where it ran, and every event.

    >>> from idemctl.cli.scenario import builtin
    >>> from idemctl.cli.simulation import run_scenario
    >>> doc = timeline_json(run_scenario(builtin("happy")))
    >>> doc["scenario"], doc["ok"], [e["outcome"] for e in doc["events"]]
    ('happy', True, ['executed', 'advanced', 'replayed', 'inspected'])
    """
    scenario = timeline.scenario
    return {
        "scenario": scenario.name,
        "description": scenario.description,
        "database": timeline.database,
        "pending_ttl_ms": timeline.policy.pending_ttl_ms,
        "retention_ms": timeline.policy.retention_ms,
        "start": timeline.start,
        "end": timeline.end,
        "reset": [{"principal": p, "key": k} for p, k in timeline.reset],
        "ok": timeline.ok,
        "events": [timeline_event_json(e, timeline.start) for e in timeline.events],
    }


# -- for a person ---------------------------------------------------------------------------------
_OUTCOME_STYLE = {
    "executed": "green",
    "taken_over": "yellow",
    "fenced_out": "red",
    "replayed": "cyan",
    "in_progress": "magenta",
    "reused": "magenta",
    "race_failed": "bold red",
    "error": "bold red",
}

# Widths of the t, actor, step, outcome and row-after columns. One fixed-width
# grid per event with its detail on the next line: a six-column table would
# squeeze the detail into a sliver at 80 columns.
_TIMELINE_WIDTHS = (13, 9, 15, 17, 17)


def _clock(ms: int) -> str:
    """A virtual time since the start of the timeline.

    >>> _clock(3_723_004)
    '+1:02:03.004'
    """
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    return f"+{hours}:{minutes:02d}:{rest / 1000:06.3f}"


def _step_words(e: TimelineEvent, timeline: Timeline) -> str:
    step = timeline.scenario.steps[e.step - 1]
    name = e.op.value
    if e.op in (Op.REQUEST, Op.RACE):
        return f"{step.method} {step.path}"
    if e.op in (Op.COMPLETE, Op.RELEASE) and e.generation is not None:
        return f"{name} gen {e.generation}"
    if e.op is Op.ADVANCE:
        return f"advance {exact_duration(step.by_ms)}"
    if e.op is Op.SWEEP:
        return f"sweep ≤{step.batch or timeline.policy.sweep_batch}"
    if e.op is Op.FILL:
        return f"fill {step.count}"
    return name


def _row_words(e: TimelineEvent) -> str:
    if not e.row_known:
        return ""
    if e.row is None:
        return "no row"
    return f"{e.row.status.value} · gen {e.row.generation}"


def _timeline_line(cells: list[Text], terminal: bool) -> Table:
    grid = Table.grid(padding=(0, 1))
    for width in _TIMELINE_WIDTHS:
        if terminal:
            grid.add_column(width=width, overflow="fold")
        else:  # piped: a longer cell pushes the rest of its line on, never onto another line
            grid.add_column(min_width=width, no_wrap=True)
    grid.add_row(*cells)
    return grid


def print_timeline(console: Console, timeline: Timeline) -> None:
    """A simulation for a person: what ran, one event a line with its detail
    under it, then what the ledger logged."""
    sc = timeline.scenario
    where = timeline.database or "a temporary ledger (deleted afterwards)"
    console.print(Text(f"scenario {sc.name}", style="bold") + Text(f": {sc.description}" if sc.description else ""))
    console.print(
        Text(
            f"ledger {where}; TTL {human_duration(timeline.policy.pending_ttl_ms)}, retention "
            f"{human_duration(timeline.policy.retention_ms)}; virtual clock from {iso(timeline.start)}"
        )
    )
    if timeline.reset:
        console.print(Text("reset first (left by an earlier run): " + ", ".join(f"{p}/{k}" for p, k in timeline.reset)))
    terminal = console.is_terminal
    heads = [Text(h, style="bold") for h in ("t", "actor", "step", "outcome", "row after")]
    console.print(_timeline_line(heads, terminal))
    logs: list[str] = []
    for e in timeline.events:
        at = _clock(e.at - timeline.start)
        outcome = Text(e.outcome.value, style=_OUTCOME_STYLE.get(e.outcome.value, ""))
        if e.http_status is not None and e.op in (Op.REQUEST, Op.RACE):
            outcome.append(f" {e.http_status}")
        cells = [Text(at), Text(e.actor), Text(_step_words(e, timeline)), outcome, Text(_row_words(e))]
        console.print(_timeline_line(cells, terminal))
        detail = Text(e.detail, style="dim")
        if not e.ok:
            detail.append(f" — expected {e.expected}" if e.expected else " — failed", style="bold red")
        console.print(Padding(detail, (0, 0, 0, _TIMELINE_WIDTHS[0] + 1), expand=False))
        logs.extend(f"{at} {text}" for text in e.logs)
    for text in logs:
        console.print(Text("log " + text, style="dim"))
