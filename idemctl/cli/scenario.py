"""The scenario language of `idemctl simulate`: steps, their validation, and
the built-in scenarios, written in the same language an operator uses in a
``scenario.toml`` file, so the built-ins and an incident reproduction go
through one parser.

>>> builtin("takeover").steps[2].expect
'taken_over'
"""

from __future__ import annotations

import enum
import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from ..durations import parse_duration
from ..errors import ScenarioError
from ..fingerprint import fingerprint
from ..outcomes import Outcome
from ..policy import Policy

DEFAULT_PRINCIPAL = "acct_A"
DEFAULT_METHOD = "POST"
DEFAULT_PATH = "/orders"
DEFAULT_BODY = '{"sku":"book","qty":1}'
DEFAULT_HEADERS: tuple[tuple[str, str], ...] = (("Content-Type", "application/json"),)


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
        raise ScenarioError(
            f'{where}: headers must be a table of strings, e.g. headers = {{"Content-Type" = "application/json"}}'
        )
    return tuple((str(k), v) for k, v in value.items())


def _response(value: object, where: str) -> Response:
    if not isinstance(value, Mapping):
        raise ScenarioError(
            f"{where}: response must be a table, e.g. response = {{status = 201, body = '{{\"id\":1}}'}}"
        )
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
        allowed = ", ".join(sorted(_TOP_FIELDS))
        raise ScenarioError(f"{source}: unknown top-level field {unknown[0]!r} (allowed: {allowed})")
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

    >>> import pathlib, tempfile
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     path = pathlib.Path(tmp, "incident.toml")
    ...     _ = path.write_text('[[step]]\\ndo = "request"\\n')
    ...     scenario = load_scenario_file(path)
    >>> scenario.name, scenario.steps[0].op
    ('incident', <Op.REQUEST: 'request'>)
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


# Every built-in ends with the operator's view of the row it left.
_INSPECT = {"do": "inspect", "actor": "operator", "expect": "inspected"}


def _again(description: str, key: str, wait: str, retry: dict[str, Any]) -> dict[str, Any]:
    """A request that runs, a wait, then a request with the same key: `retry`
    says how it differs from the first and what it gets."""
    return {
        "description": description,
        "key": key,
        "step": [
            {"do": "request", "actor": "A", "expect": "executed"},
            {"do": "advance", "by": wait},
            {"do": "request", "actor": "A", **retry},
            _INSPECT,
        ],
    }


def _builtin_docs(policy: Policy, workers: int) -> dict[str, dict[str, Any]]:
    past_ttl = _ms(policy.pending_ttl_ms + 1000)
    past_retention = _ms(policy.retention_ms + 1000)
    return {
        "happy": _again(
            "claim, complete, replay: the retry gets the stored answer and nothing runs twice",
            "order-1",
            "2s",
            {"expect": "replayed"},
        ),
        "reuse": _again(
            "the same key with another body gets 409 reused and nothing is replayed",
            "order-7",
            "1s",
            {"body": '{"sku":"book","qty":2}', "expect": "reused"},
        ),
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
                _INSPECT,
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
                _INSPECT,
            ],
        },
        "race": {
            "description": f"{workers} OS processes send the same request at the same instant: exactly one runs it",
            "key": "order-99",
            "step": [
                {"do": "race", "workers": workers, "hold": "300ms", "expect": "raced"},
                {"do": "advance", "by": "1s"},
                {"do": "request", "actor": "retry", "expect": "replayed"},
                _INSPECT,
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
                _INSPECT,
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


# -- what a step's mutation answers -------------------------------------------------------
def default_answer_body(step: Step) -> str:
    return json.dumps({"order": step.key, "by": step.actor}, separators=(",", ":"))


def mutation_answer(step: Step) -> tuple[int, tuple[tuple[str, str], ...], bytes]:
    r = step.response
    body = default_answer_body(step) if r.body is None else r.body
    return r.status, r.headers, body.encode("utf-8")
