"""Scenario engine: replay claim/takeover/complete sequences against a real
ledger under a virtual clock, and return the timeline.

Built-in scenarios are written in the same step language an operator uses in
a ``scenario.toml`` file (one parser, one interpreter), so an incident can be
reproduced exactly as the built-ins demonstrate the contract.

>>> timeline = run_scenario(builtin("takeover"))  # doctest: +SKIP
>>> [e.outcome.value for e in timeline.events][:3]  # doctest: +SKIP
['claimed', 'advanced', 'taken_over']
"""

from __future__ import annotations

import base64
import contextlib
import enum
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from .durations import human_duration, parse_duration
from .errors import IdemctlError
from .fingerprint import fingerprint
from .ledger import Ledger, wall_clock_ms
from .outcomes import Outcome, Reservation, RowView, StoredRow
from .policy import Policy
from .render import state_words

DEFAULT_PRINCIPAL = "acct_A"
DEFAULT_METHOD = "POST"
DEFAULT_PATH = "/orders"
DEFAULT_BODY = '{"sku":"book","qty":1}'
DEFAULT_HEADERS: tuple[tuple[str, str], ...] = (("Content-Type", "application/json"),)
MAX_SWEEP_BATCHES = 10_000
RACE_TIMEOUT_S = 60.0


class ScenarioError(IdemctlError, ValueError):
    """A scenario that cannot run: unknown name, malformed file, bad step."""


class Op(enum.Enum):
    """The step language. Each op is one ledger call (or the clock)."""

    REQUEST = "request"  # Ledger.handle: the whole request path, mutation included
    CLAIM = "claim"  # Ledger.claim: take the reservation and stall (no completion)
    TAKEOVER = "takeover"  # Ledger.takeover
    COMPLETE = "complete"  # Ledger.complete with the actor's (or a given) generation
    RELEASE = "release"  # Ledger.release
    ADVANCE = "advance"  # move the virtual clock
    SWEEP = "sweep"  # Ledger.sweep, one batch or until empty
    INSPECT = "inspect"  # Ledger.get: the derived state in words
    PURGE = "purge"  # Ledger.purge
    FILL = "fill"  # N completed rows at the current virtual time (a sweep backlog)
    RACE = "race"  # N real OS processes send the same request at once


class StepOutcome(enum.Enum):
    """Outcomes of the single steps (`request` steps report an `Outcome`)."""

    CLAIMED = "claimed"
    NOT_CLAIMED = "not_claimed"
    TAKEN_OVER = "taken_over"
    NOT_TAKEN_OVER = "not_taken_over"
    STORED = "stored"
    FENCED_OUT = "fenced_out"
    RELEASED = "released"
    NOT_RELEASED = "not_released"
    ADVANCED = "advanced"
    SWEPT = "swept"
    DRAINED = "drained"  # a sweep batch found nothing left to delete
    INSPECTED = "inspected"
    NOT_FOUND = "not_found"
    PURGED = "purged"
    REFUSED = "refused"
    FILLED = "filled"
    RACED = "raced"  # the race summary: exactly one process ran the mutation
    RACE_FAILED = "race_failed"  # zero or several processes ran it
    ERROR = "error"


_KNOWN_OUTCOMES = sorted({o.value for o in StepOutcome} | {o.value for o in Outcome})

# Fields each op accepts besides `do`, `actor` and `expect`.
_REQUEST_FIELDS = {"principal", "key", "method", "path", "headers", "body"}
_OP_FIELDS: dict[Op, set[str]] = {
    Op.REQUEST: _REQUEST_FIELDS | {"response"},
    Op.CLAIM: set(_REQUEST_FIELDS),
    Op.TAKEOVER: set(_REQUEST_FIELDS),
    Op.COMPLETE: {"principal", "key", "generation", "response"},
    Op.RELEASE: {"principal", "key", "generation"},
    Op.ADVANCE: {"by"},
    Op.SWEEP: {"batch", "retention", "until_empty"},
    Op.INSPECT: {"principal", "key"},
    Op.PURGE: {"principal", "key", "force"},
    Op.FILL: {"principal", "prefix", "count"},
    Op.RACE: _REQUEST_FIELDS | {"response", "workers", "hold"},
}
_TOP_FIELDS = {"name", "description", "principal", "key", "ttl", "retention", "start", "step"}


@dataclass(frozen=True)
class Response:
    """What a mutation answers (a `request`/`race` step) or a `complete` stores."""

    status: int = 201
    headers: tuple[tuple[str, str], ...] = DEFAULT_HEADERS
    body: str | None = None  # None: {"order": KEY, "by": ACTOR}, so replays show who ran


@dataclass(frozen=True)
class Step:
    """One parsed step. Fields an op does not use keep their defaults."""

    index: int  # 1-based position in the scenario
    op: Op
    actor: str
    principal: str
    key: str
    method: str = DEFAULT_METHOD
    path: str = DEFAULT_PATH
    headers: tuple[tuple[str, str], ...] = DEFAULT_HEADERS
    body: bytes = DEFAULT_BODY.encode()
    response: Response = Response()
    generation: int | None = None
    by_ms: int = 0
    batch: int | None = None
    retention_ms: int | None = None
    until_empty: bool = False
    force: bool = False
    count: int = 0
    prefix: str = "backlog-"
    workers: int = 0
    hold_ms: int = 200
    expect: str | None = None

    def fill_keys(self) -> list[str]:
        return [f"{self.prefix}{i:04d}" for i in range(1, self.count + 1)]

    def fingerprint(self, policy: Policy) -> str:
        return fingerprint(self.method, self.path, self.headers, self.body, policy.fingerprint_headers)


@dataclass(frozen=True)
class Scenario:
    """A named, validated sequence of steps.

    >>> builtin("happy").steps[0].op
    <Op.REQUEST: 'request'>
    """

    name: str
    description: str
    steps: tuple[Step, ...]
    pending_ttl_ms: int | None = None
    retention_ms: int | None = None
    start_ms: int | None = None  # None: the timeline ends at the wall clock's now
    source: str = "scenario"  # file name or "built-in NAME", for error messages

    def keys(self) -> list[tuple[str, str]]:
        """Every (principal, key) the scenario writes, in first-use order."""
        seen: dict[tuple[str, str], None] = {}
        for step in self.steps:
            if step.op is Op.FILL:
                for key in step.fill_keys():
                    seen[(step.principal, key)] = None
            elif step.op not in (Op.ADVANCE, Op.SWEEP):
                seen[(step.principal, step.key)] = None
        return list(seen)

    def span_ms(self) -> int:
        return sum(s.by_ms for s in self.steps if s.op is Op.ADVANCE)


@dataclass(frozen=True)
class Event:
    """One line of the timeline."""

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
    scenario: Scenario
    database: str | None  # where it ran, safe to print (no password); None: a temporary database
    policy: Policy
    start: int
    end: int
    reset: tuple[tuple[str, str], ...]  # keys left by an earlier run, purged first
    events: tuple[Event, ...]

    @property
    def ok(self) -> bool:
        return all(e.ok for e in self.events)

    def failures(self) -> list[Event]:
        return [e for e in self.events if not e.ok]


class VirtualClock:
    """Milliseconds that only move when a step says so."""

    def __init__(self, start: int) -> None:
        self.now = start

    def __call__(self) -> int:
        return self.now

    def advance(self, ms: int) -> None:
        self.now += ms


# -- parsing ------------------------------------------------------------------------------
def _where(source: str, index: int | None, op: str | None = None) -> str:
    if index is None:
        return source
    return f"{source}: step {index}" + (f' (do = "{op}")' if op else "")


def _string(value: object, what: str, where: str) -> str:
    if not isinstance(value, str):
        raise ScenarioError(f"{where}: {what} must be a string, got {value!r}")
    return value


def _integer(value: object, what: str, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ScenarioError(f"{where}: {what} must be an integer >= {minimum}, got {value!r}")
    return value


def _duration(value: object, what: str, where: str) -> int:
    text = _string(value, what, where)
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise ScenarioError(f"{where}: {what}: {exc}") from None


def _headers(value: object, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, Mapping) or not all(isinstance(v, str) for v in value.values()):
        raise ScenarioError(f"{where}: headers must be a table of strings, e.g. headers = {{\"Content-Type\" = \"application/json\"}}")
    return tuple((str(k), v) for k, v in value.items())


def _response(value: object, where: str) -> Response:
    if not isinstance(value, Mapping):
        raise ScenarioError(f"{where}: response must be a table, e.g. response = {{status = 201, body = '{{\"id\":1}}'}}")
    unknown = set(value) - {"status", "headers", "body"}
    if unknown:
        raise ScenarioError(f"{where}: unknown response field {sorted(unknown)[0]!r} (allowed: body, headers, status)")
    status = _integer(value.get("status", 201), "response.status", where, 100)
    if status > 999:
        raise ScenarioError(f"{where}: response.status must be 100-999, got {status}")
    headers = _headers(value["headers"], where) if "headers" in value else DEFAULT_HEADERS
    body = _string(value["body"], "response.body", where) if "body" in value else None
    return Response(status, headers, body)


def _step(raw: object, index: int, source: str, defaults: dict[str, str]) -> Step:
    where = _where(source, index)
    if not isinstance(raw, Mapping):
        raise ScenarioError(f"{where}: must be a table ([[step]]), got {raw!r}")
    if "do" not in raw:
        raise ScenarioError(f"{where}: missing `do` (one of: {', '.join(o.value for o in Op)})")
    do = raw["do"]
    try:
        op = Op(do)
    except ValueError:
        raise ScenarioError(f"{where}: unknown step {do!r} (one of: {', '.join(o.value for o in Op)})") from None
    where = _where(source, index, op.value)
    allowed = _OP_FIELDS[op] | {"do", "actor", "expect"}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ScenarioError(f"{where}: unknown field {unknown[0]!r} (allowed: {', '.join(sorted(allowed - {'do'}))})")
    actor_default = "clock" if op is Op.ADVANCE else ("sweeper" if op is Op.SWEEP else "A")
    kw: dict[str, Any] = {
        "index": index,
        "op": op,
        "actor": _string(raw.get("actor", actor_default), "actor", where),
        "principal": _string(raw.get("principal", defaults["principal"]), "principal", where),
        "key": _string(raw.get("key", defaults["key"]), "key", where),
    }
    if "method" in raw:
        kw["method"] = _string(raw["method"], "method", where).upper()
    if "path" in raw:
        kw["path"] = _string(raw["path"], "path", where)
    if "headers" in raw:
        kw["headers"] = _headers(raw["headers"], where)
    if "body" in raw:
        kw["body"] = _string(raw["body"], "body", where).encode("utf-8")
    if "response" in raw:
        kw["response"] = _response(raw["response"], where)
    if "generation" in raw:
        kw["generation"] = _integer(raw["generation"], "generation", where, 1)
    if op is Op.ADVANCE:
        if "by" not in raw:
            raise ScenarioError(f'{where}: missing `by`, e.g. by = "31s"')
        kw["by_ms"] = _duration(raw["by"], "by", where)
    if "batch" in raw:
        kw["batch"] = _integer(raw["batch"], "batch", where, 1)
    if "retention" in raw:
        kw["retention_ms"] = _duration(raw["retention"], "retention", where)
    for flag in ("until_empty", "force"):
        if flag in raw:
            if not isinstance(raw[flag], bool):
                raise ScenarioError(f"{where}: {flag} must be true or false, got {raw[flag]!r}")
            kw[flag] = raw[flag]
    if op is Op.FILL:
        if "count" not in raw:
            raise ScenarioError(f"{where}: missing `count`, e.g. count = 50")
        kw["count"] = _integer(raw["count"], "count", where, 1)
        if "prefix" in raw:
            kw["prefix"] = _string(raw["prefix"], "prefix", where)
    if op is Op.RACE:
        kw["workers"] = _integer(raw.get("workers", 4), "workers", where, 2)
        if kw["workers"] > 64:
            raise ScenarioError(f"{where}: workers must be at most 64, got {kw['workers']}")
        if "hold" in raw:
            kw["hold_ms"] = _duration(raw["hold"], "hold", where)
    if "expect" in raw:
        expect = _string(raw["expect"], "expect", where)
        if expect not in _KNOWN_OUTCOMES:
            raise ScenarioError(f"{where}: expect {expect!r} is not an outcome (one of: {', '.join(_KNOWN_OUTCOMES)})")
        kw["expect"] = expect
    return Step(**kw)


def parse_scenario(doc: Mapping[str, Any], source: str = "scenario") -> Scenario:
    """Validate a scenario document (the parsed TOML) into a `Scenario`.

    >>> parse_scenario({"step": [{"do": "request"}, {"do": "request", "expect": "replayed"}]}).steps[1].expect
    'replayed'
    """
    unknown = sorted(set(doc) - _TOP_FIELDS)
    if unknown:
        raise ScenarioError(f"{source}: unknown top-level field {unknown[0]!r} (allowed: {', '.join(sorted(_TOP_FIELDS))})")
    steps_raw = doc.get("step")
    if not isinstance(steps_raw, list) or not steps_raw:
        raise ScenarioError(f"{source}: no steps: add at least one [[step]] table with a `do` field")
    defaults = {
        "principal": _string(doc.get("principal", DEFAULT_PRINCIPAL), "principal", source),
        "key": _string(doc.get("key", "order-1"), "key", source),
    }
    ttl = _duration(doc["ttl"], "ttl", source) if "ttl" in doc else None
    retention = _duration(doc["retention"], "retention", source) if "retention" in doc else None
    start = None
    if "start" in doc:
        value = doc["start"]
        if isinstance(value, datetime):  # TOML offset date-time
            if value.tzinfo is None:
                raise ScenarioError(f"{source}: start needs a UTC offset, e.g. 2026-11-28T03:12:00Z")
            start = int(value.timestamp() * 1000)
        elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            start = value
        else:
            raise ScenarioError(f"{source}: start must be a date-time like 2026-11-28T03:12:00Z or ms since the epoch")
    steps = tuple(_step(raw, i, source, defaults) for i, raw in enumerate(steps_raw, start=1))
    _check_holders(steps, source)
    name = _string(doc.get("name", Path(source).stem), "name", source)
    description = _string(doc.get("description", ""), "description", source)
    return Scenario(name, description, steps, ttl, retention, start, source)


def _check_holders(steps: tuple[Step, ...], source: str) -> None:
    """A complete or release without `generation` needs an earlier claim or
    takeover by the same actor on the same key: refused before anything runs."""
    held: set[tuple[str, str, str]] = set()
    for step in steps:
        who = (step.actor, step.principal, step.key)
        if step.op in (Op.CLAIM, Op.TAKEOVER):
            held.add(who)
        elif step.op in (Op.COMPLETE, Op.RELEASE) and step.generation is None and who not in held:
            raise ScenarioError(
                f"{_where(source, step.index, step.op.value)}: actor {step.actor!r} holds no reservation on "
                f"{step.principal}/{step.key} (claim or take over first, or give generation = N)"
            )


def load_scenario_file(path: str | os.PathLike[str]) -> Scenario:
    """Read and validate a ``scenario.toml``.

    >>> load_scenario_file("incident.toml").name  # doctest: +SKIP
    'incident'
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ScenarioError(f"cannot read scenario file {p}: {exc.strerror or exc}") from None
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ScenarioError(f"{p}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{p}: invalid TOML: {exc}") from None
    return parse_scenario(doc, str(p))


# -- built-in scenarios --------------------------------------------------------------------
def _ms(ms: int) -> str:
    return f"{ms}ms"


def _builtin_docs(policy: Policy, workers: int) -> dict[str, dict[str, Any]]:
    past_ttl = _ms(policy.pending_ttl_ms + 1000)
    past_retention = _ms(policy.retention_ms + 1000)
    return {
        "happy": {
            "description": "claim, complete, replay: the retry gets the stored answer and nothing runs twice",
            "key": "order-1",
            "step": [
                {"do": "request", "actor": "A", "expect": "executed"},
                {"do": "advance", "by": "2s"},
                {"do": "request", "actor": "A", "expect": "replayed"},
                {"do": "inspect", "actor": "operator", "expect": "inspected"},
            ],
        },
        "reuse": {
            "description": "the same key with another body gets 409 reused and nothing is replayed",
            "key": "order-7",
            "step": [
                {"do": "request", "actor": "A", "expect": "executed"},
                {"do": "advance", "by": "1s"},
                {"do": "request", "actor": "A", "body": '{"sku":"book","qty":2}', "expect": "reused"},
                {"do": "inspect", "actor": "operator", "expect": "inspected"},
            ],
        },
        "in-progress": {
            "description": "a retry while the first attempt is still running gets 409 with Retry-After",
            "key": "order-9",
            "step": [
                {"do": "claim", "actor": "A", "expect": "claimed"},
                {"do": "advance", "by": "5s"},
                {"do": "request", "actor": "A-retry", "expect": "in_progress"},
                {"do": "advance", "by": "1s"},
                {"do": "complete", "actor": "A", "expect": "stored"},
                {"do": "request", "actor": "A-retry", "expect": "replayed"},
                {"do": "inspect", "actor": "operator", "expect": "inspected"},
            ],
        },
        "takeover": {
            "description": (
                "worker A claims and stalls past the TTL; B takes over as generation 2 and completes; "
                "A's late completion is fenced out and logged; the replay returns B's answer"
            ),
            "key": "order-42",
            "step": [
                {"do": "claim", "actor": "A", "expect": "claimed"},
                {"do": "advance", "by": past_ttl},
                {"do": "request", "actor": "B", "expect": "taken_over"},
                {"do": "advance", "by": "4s"},
                {"do": "complete", "actor": "A", "expect": "fenced_out"},
                {"do": "advance", "by": "1s"},
                {"do": "request", "actor": "C", "expect": "replayed"},
                {"do": "inspect", "actor": "operator", "expect": "inspected"},
            ],
        },
        "race": {
            "description": f"{workers} OS processes send the same request at the same instant: exactly one runs it",
            "key": "order-99",
            "step": [
                {"do": "race", "workers": workers, "hold": "300ms", "expect": "raced"},
                {"do": "advance", "by": "1s"},
                {"do": "request", "actor": "retry", "expect": "replayed"},
                {"do": "inspect", "actor": "operator", "expect": "inspected"},
            ],
        },
        "sweep": {
            "description": "a backlog past retention is drained in bounded batches; a fresh row survives",
            "principal": "acct_S",
            "key": "fresh-1",
            "step": [
                {"do": "fill", "count": 45, "expect": "filled"},
                {"do": "advance", "by": past_retention},
                {"do": "request", "actor": "A", "expect": "executed"},
                {"do": "sweep", "batch": 20, "until_empty": True, "expect": "drained"},
                {"do": "inspect", "actor": "operator", "expect": "inspected"},
            ],
        },
    }


BUILTIN_NAMES: tuple[str, ...] = ("happy", "reuse", "in-progress", "takeover", "race", "sweep")


def builtin(name: str, policy: Policy | None = None, *, workers: int = 4) -> Scenario:
    """A built-in scenario, its waits derived from `policy` (e.g. "past the TTL").

    >>> builtin("takeover").steps[2].expect
    'taken_over'
    """
    docs = _builtin_docs(policy or Policy(), workers)
    if name not in docs:
        raise ScenarioError(
            f"unknown scenario {name!r}: built-in ones are {', '.join(BUILTIN_NAMES)} (or use --file scenario.toml)"
        )
    return parse_scenario({"name": name, **docs[name]}, f"built-in {name}")


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


def _default_answer_body(step: Step) -> str:
    return json.dumps({"order": step.key, "by": step.actor}, separators=(",", ":"))


def _mutation_answer(step: Step) -> tuple[int, tuple[tuple[str, str], ...], bytes]:
    r = step.response
    body = _default_answer_body(step) if r.body is None else r.body
    return r.status, r.headers, body.encode("utf-8")


def _short(body: bytes, limit: int = 60) -> str:
    text = body.decode("utf-8", "replace")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _request_detail(outcome: Outcome, status: int, generation: int | None, body: bytes, retry_after: str | None) -> str:
    if outcome is Outcome.EXECUTED:
        return f"claimed generation {generation}, ran the mutation, stored {status} {_short(body)}"
    if outcome is Outcome.TAKEN_OVER:
        return f"took over the stale reservation as generation {generation}, ran the mutation, stored {status} {_short(body)}"
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


class _Runner:
    def __init__(self, ledger: Ledger, clock: VirtualClock, target: str, scenario: Scenario, tap: _LogTap) -> None:
        self.ledger = ledger
        self.clock = clock
        self.target = target
        self.scenario = scenario
        self.tap = tap
        self.reservations: dict[tuple[str, str, str], Reservation] = {}
        self.events: list[Event] = []

    def emit(self, step: Step, outcome: Outcome | StepOutcome, detail: str, **kw: Any) -> None:
        concerns_row = step.op not in (Op.ADVANCE, Op.SWEEP)
        if concerns_row and "row" not in kw:
            kw["row"] = self.ledger.lookup(step.principal, step.key)
        self.events.append(
            Event(
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
            fp = held.fingerprint if held else step.fingerprint(self.ledger.policy)
            return Reservation(step.principal, step.key, step.generation, fp)
        if held is None:
            # The parser rules out a missing claim; this is a claim or takeover that did not succeed.
            self.emit(
                step,
                StepOutcome.ERROR,
                f"actor {step.actor} holds no reservation: its claim or takeover did not succeed (give generation = N)",
            )
        return held

    def _request(self, step: Step) -> None:
        status, headers, body = _mutation_answer(step)
        answer = self.ledger.handle(
            step.principal, step.key, step.method, step.path, step.headers, step.body,
            lambda _body: (status, headers, body),
        )
        detail = _request_detail(answer.outcome, answer.status, answer.generation, answer.body, answer.header("Retry-After"))
        self.emit(step, answer.outcome, detail, http_status=answer.status, generation=answer.generation)

    def _claim(self, step: Step) -> None:
        got = self.ledger.claim(step.principal, step.key, step.fingerprint(self.ledger.policy))
        if got is None:
            self.emit(step, StepOutcome.NOT_CLAIMED, "the key already exists: no reservation")
            return
        self.reservations[(step.actor, step.principal, step.key)] = got
        self.emit(step, StepOutcome.CLAIMED, f"claimed generation {got.generation}; the mutation starts and stalls", generation=got.generation)

    def _takeover(self, step: Step) -> None:
        got = self.ledger.takeover(step.principal, step.key, step.fingerprint(self.ledger.policy))
        if got is None:
            self.emit(step, StepOutcome.NOT_TAKEN_OVER, "not taken over: the row is fresh, completed, gone or for another request")
            return
        self.reservations[(step.actor, step.principal, step.key)] = got
        self.emit(step, StepOutcome.TAKEN_OVER, f"took over as generation {got.generation}", generation=got.generation)

    def _complete(self, step: Step) -> None:
        reservation = self._reservation_for(step)
        if reservation is None:
            return
        status, headers, body = _mutation_answer(step)
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
        if self.ledger.release(reservation):
            self.emit(step, StepOutcome.RELEASED, f"released generation {reservation.generation}: the next retry runs again", generation=reservation.generation)
        else:
            self.emit(step, StepOutcome.NOT_RELEASED, f"nothing released: generation {reservation.generation} no longer holds a pending row", generation=reservation.generation)

    def _advance(self, step: Step) -> None:
        self.clock.advance(step.by_ms)
        self.emit(step, StepOutcome.ADVANCED, f"virtual clock +{human_duration(step.by_ms)}")

    def _sweep(self, step: Step) -> None:
        batch = step.batch or self.ledger.policy.sweep_batch
        for number in range(1, MAX_SWEEP_BATCHES + 1):
            result = self.ledger.sweep(batch=batch, retention_ms=step.retention_ms)
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
            if last:
                return

    def _inspect(self, step: Step) -> None:
        view = self.ledger.get(step.principal, step.key)
        if view is None:
            self.emit(step, StepOutcome.NOT_FOUND, "no row: the next request with this key runs the mutation", row=None)
            return
        fenced = list(self.ledger.fenced(principal=step.principal, key=step.key))
        extra = f"; {len(fenced)} fenced-out event(s) for this key" if fenced else ""
        self.emit(step, StepOutcome.INSPECTED, state_words(view) + extra, row=view.row, view=view, generation=view.row.generation)

    def _purge(self, step: Step) -> None:
        result = self.ledger.purge(step.principal, step.key, force=step.force)
        outcome = {"purged": StepOutcome.PURGED, "not_found": StepOutcome.NOT_FOUND}.get(result.outcome.value, StepOutcome.REFUSED)
        detail = {
            StepOutcome.PURGED: "deleted: the client's next retry runs the mutation again",
            StepOutcome.NOT_FOUND: "no row to purge",
            StepOutcome.REFUSED: "refused: the row is pending and fresh, its owner may still be running (force = true overrides)",
        }[outcome]
        self.emit(step, outcome, detail)

    def _fill(self, step: Step) -> None:
        policy = self.ledger.policy
        fp = step.fingerprint(policy)
        made = 0
        for key in step.fill_keys():
            got = self.ledger.claim(step.principal, key, fp)
            if got is not None:
                self.ledger.complete(got, 201, (("Content-Type", "application/json"),), json.dumps({"order": key}).encode())
                made += 1
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
                self.emit(step, StepOutcome.ERROR, f"pid {r.pid}: {r.error}", actor=f"w{r.worker}", pid=r.pid, expected=None)
                continue
            detail = _request_detail(r.outcome, r.status or 0, r.generation, r.body, r.retry_after)
            self.emit(
                step, r.outcome, f"pid {r.pid}: {detail}", actor=f"w{r.worker}", pid=r.pid,
                http_status=r.status, generation=r.generation, expected=None,
            )
        others: dict[str, int] = {}
        for r in results:
            if r.outcome is not None and not r.outcome.ran_mutation:
                others[r.outcome.value] = others.get(r.outcome.value, 0) + 1
        rest = ", ".join(f"{n} {name}" for name, n in sorted(others.items()))
        summary = f"{len(results)} processes, {len(ran)} ran the mutation" + (f"; {rest}" if rest else "")
        outcome = StepOutcome.RACED if len(ran) == 1 else StepOutcome.RACE_FAILED
        self.emit(step, outcome, summary, actor="race")


@dataclass(frozen=True)
class RaceResult:
    """What one racing process saw."""

    worker: int
    pid: int | None
    outcome: Outcome | None  # None: the process failed
    status: int | None = None
    generation: int | None = None
    body: bytes = b""
    retry_after: str | None = None
    error: str = ""


_RACE_CHILD = "from idemctl.simulate import race_child; race_child()"


def _policy_doc(policy: Policy) -> dict[str, Any]:
    return {
        "pending_ttl_ms": policy.pending_ttl_ms,
        "retention_ms": policy.retention_ms,
        "sweep_batch": policy.sweep_batch,
        "body_cap_bytes": policy.body_cap_bytes,
        "fingerprint_headers": list(policy.fingerprint_headers),
        "replayable_headers": list(policy.replayable_headers),
        "protected_methods": sorted(policy.protected_methods),
        "reuse_status": policy.reuse_status,
    }


def race_child() -> None:
    """One racing process (started by `race_processes` as ``python -c``): read
    the request on stdin, open its own ledger, say "ready", wait for "go",
    send the request, print the outcome as one JSON line."""
    logging.getLogger("idemctl").addHandler(logging.NullHandler())
    spec = json.loads(sys.stdin.readline())
    try:
        now = int(spec["now"])
        ledger = Ledger.open(spec["target"], policy=Policy(**spec["policy"]), clock=lambda: now, create=False)
        answer_headers = tuple((str(k), str(v)) for k, v in spec["response_headers"])
        answer_body = base64.b64decode(spec["response_body"])

        def mutation(_body: bytes) -> tuple[int, tuple[tuple[str, str], ...], bytes]:
            time.sleep(spec["hold_ms"] / 1000)  # the losers arrive while this one still holds the claim
            return int(spec["response_status"]), answer_headers, answer_body

        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return  # the parent gave up on the race
        answer = ledger.handle(
            spec["principal"], spec["key"], spec["method"], spec["path"],
            [(str(k), str(v)) for k, v in spec["headers"]], base64.b64decode(spec["body"]), mutation,
        )
        ledger.close()
        result: dict[str, Any] = {
            "outcome": answer.outcome.value,
            "status": answer.status,
            "generation": answer.generation,
            "body": base64.b64encode(answer.body).decode("ascii"),
            "retry_after": answer.header("Retry-After"),
        }
    except Exception as exc:  # reported as a failed worker
        result = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"}
    print(json.dumps(result), flush=True)


def _race_result(worker: int, pid: int, line: str, stderr: str, code: int | None) -> RaceResult:
    try:
        doc = json.loads(line)
    except ValueError:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else "no output"
        return RaceResult(worker, pid, None, error=f"exited with code {code}: {last}")
    if "error" in doc:
        return RaceResult(worker, pid, None, error=doc["error"])
    return RaceResult(
        worker, pid, Outcome(doc["outcome"]), doc["status"], doc["generation"],
        base64.b64decode(doc["body"]), doc["retry_after"],
    )


def race_processes(target: str, step: Step, policy: Policy, now: int) -> list[RaceResult]:
    """Start `step.workers` fresh Python processes that send the same request
    at once. Each opens its own Ledger and connection and reports "ready";
    only when all are ready does each get "go", so they hit the ledger
    together.

    >>> [r.outcome for r in race_processes("ledger.db", builtin("race").steps[0], Policy(), now)]  # doctest: +SKIP
    [<Outcome.EXECUTED: 'executed'>, <Outcome.IN_PROGRESS: 'in_progress'>, ...]
    """
    if target == ":memory:":
        raise ScenarioError("race needs a database file or URL that other processes can open, not :memory:")
    # Fresh interpreters rather than multiprocessing: fork copies the caller's
    # threads and locks, and spawn re-imports its __main__ (which breaks under
    # python -c, a REPL or a notebook).
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = package_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    procs: list[subprocess.Popen[str]] = []
    try:
        for worker in range(1, step.workers + 1):
            status, headers, body = _mutation_answer(replace(step, actor=f"w{worker}"))
            spec = {
                "target": target, "now": now, "policy": _policy_doc(policy), "principal": step.principal,
                "key": step.key, "method": step.method, "path": step.path, "headers": list(step.headers),
                "body": base64.b64encode(step.body).decode("ascii"), "hold_ms": step.hold_ms,
                "response_status": status, "response_headers": list(headers),
                "response_body": base64.b64encode(body).decode("ascii"),
            }
            proc = subprocess.Popen(
                [sys.executable, "-c", _RACE_CHILD],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            )
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(spec) + "\n")
            proc.stdin.flush()
            procs.append(proc)
        firsts = [(p.stdout.readline() if p.stdout else "").strip() for p in procs]
        # Released in random order: which worker wins is up to the race, not to its number.
        for index in random.sample(range(len(procs)), len(procs)):
            proc = procs[index]
            if firsts[index] == "ready" and proc.stdin is not None:
                proc.stdin.write("go\n")
                proc.stdin.flush()
        results = []
        for worker, (proc, first) in enumerate(zip(procs, firsts), start=1):
            try:
                out, err = proc.communicate(timeout=RACE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            line = (out.strip().splitlines() or [""])[-1] if first == "ready" else first
            results.append(_race_result(worker, proc.pid, line, err, proc.returncode))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def run_scenario(
    scenario: Scenario,
    target: str | os.PathLike[str] | None = None,
    *,
    policy: Policy | None = None,
    wall_clock: Callable[[], int] = wall_clock_ms,
) -> Timeline:
    """Run `scenario` against the ledger at `target` (created and initialised
    if needed), or a temporary one when `target` is None.

    The virtual clock starts early enough that the timeline ends at the wall
    clock's now (unless the scenario sets `start`), so rows written into a
    real ledger have sensible ages when inspected afterwards. The keys the
    scenario writes are purged first (forced), so running it again replays
    the same story instead of finding last run's rows.

    >>> run_scenario(builtin("happy")).ok  # doctest: +SKIP
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
        else:
            where = os.fspath(target)
        ledger = stack.enter_context(Ledger.open(where, policy=policy, clock=clock))
        shown = ledger.backend.describe()
        ledger.init()
        reset = tuple(pk for pk in scenario.keys() if ledger.purge(*pk, force=True).row is not None)
        tap = stack.enter_context(_tap_logs())
        runner = _Runner(ledger, clock, where, scenario, tap)
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
