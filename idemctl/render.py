"""Words and JSON documents for what the ledger returns.

Plain-text functions (no rich) so the CLI, the simulator and tests share one
wording; `*_json` functions build every `--json` document of the CLI, so its
stable field names are defined in this one place (docs/cli.md documents
them)."""

from __future__ import annotations

import base64
import json
import re
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .copying import CopyResult
from .durations import ago, human_duration, iso
from .outcomes import Drained, FencedEvent, Prediction, RowView, State, Stats, Status, StoredRow, Verdict
from .policy import Policy
from .responses import NULL_BODY_STATUSES, OVERSIZE_STATUS

if TYPE_CHECKING:  # the simulator renders its timelines with this module
    from .replication import FailoverCheck
    from .simulate import Event, Timeline

# Candidates for escaping: everything but printable ASCII. Which of them are
# escaped is then decided per character by its Unicode category, so that
# ordinary non-ASCII text ("café", "注文") stays readable.
_NOT_PLAIN = re.compile(r"[^\x20-\x7e]")
_NOT_PLAIN_BLOCK = re.compile(r"[^\x20-\x7e\n\t]")
# Cc: C0 controls, DEL, C1 controls (ESC, CSI U+009B, OSC U+009D ...).
# Cf: invisible format characters, among them the bidi embeddings, overrides
# and isolates (U+202A-U+202E, U+2066-U+2069) and marks (U+200E, U+200F).
# Zl, Zp: U+2028 and U+2029, which some programs treat as line breaks.
# Cs: lone surrogates, which cannot even be encoded for the terminal.
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})
_SHORT = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape_char(match: re.Match[str]) -> str:
    ch = match.group()
    if unicodedata.category(ch) not in _ESCAPED_CATEGORIES:
        return ch
    if ch in _SHORT:
        return _SHORT[ch]
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def visible(value: object, *, multiline: bool = False) -> str:
    """Text from a client or a database, made safe to print on a terminal.

    The one escaping scheme of the CLI's human output: every control
    character (C0, DEL, C1), invisible format character (bidi overrides and
    isolates, zero-width characters), line or paragraph separator and lone
    surrogate is shown as the escape a Python string literal would use:
    ``\\t`` ``\\n`` ``\\r``, else ``\\xNN``, ``\\uNNNN`` or
    ``\\UNNNNNNNN``. Everything else is shown as is: printable ASCII (so
    an Idempotency-Key's visible text never changes, backslashes included)
    and ordinary Unicode text. `multiline` keeps newlines and tabs, for a
    stored body shown as a block. `--json` output is exact instead.

    >>> visible("acct\\x1b[2J\\r\\n\\x9b\\u202eA")
    'acct\\\\x1b[2J\\\\r\\\\n\\\\x9b\\\\u202eA'
    >>> print(visible("line 1\\r\\nline 2\\x07", multiline=True))
    line 1\\r
    line 2\\x07
    """
    text = value if isinstance(value, str) else str(value)
    return (_NOT_PLAIN_BLOCK if multiline else _NOT_PLAIN).sub(_escape_char, text)


def _json_escape_char(match: re.Match[str]) -> str:
    ch = match.group()
    if unicodedata.category(ch) not in _ESCAPED_CATEGORIES:
        return ch
    code = ord(ch)
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000  # a UTF-16 surrogate pair, as JSON spells characters beyond the BMP
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def terminal_safe_json(text: str) -> str:
    """JSON text from `json.dumps(..., ensure_ascii=False)` with the characters
    `visible` escapes written as JSON escapes too: json.dumps escapes only
    U+0000-U+001F, so DEL, C1 controls and bidi overrides would reach the
    terminal raw. The document parses to exactly the same values.

    >>> terminal_safe_json('{"p": "a\u202eb\u009b", "q": "caf\u00e9"}')
    '{"p": "a\\\\u202eb\\\\u009b", "q": "café"}'
    """
    # Outside strings json.dumps writes only spaces and newlines, and inside
    # them it never writes a raw newline, so only string contents change.
    return _NOT_PLAIN_BLOCK.sub(_json_escape_char, text)


def state_words(view: RowView) -> str:
    """What a row means right now, in one sentence an operator can act on.

    >>> from idemctl import Ledger
    >>> t = [0]; ledger = Ledger.open(":memory:", clock=lambda: t[0]); _ = ledger.init()
    >>> reservation = ledger.claim("acct_A", "k1", "fp"); t[0] = 12_000
    >>> state_words(ledger.get("acct_A", "k1"))
    'pending, 12 s old: retries get 409 for 18 s more, then the next retry takes over as generation 2'
    >>> _ = ledger.store.renew([(reservation.principal, "k1", 1, reservation.token)], 14_000); t[0] = 15_000
    >>> state_words(ledger.get("acct_A", "k1")).split(":")[0]
    'pending, claimed 15 s ago, lease last renewed 1 s ago'
    >>> _ = ledger.complete(reservation, 201, {}, b"{}"); t[0] += 3 * 3_600_000
    >>> state_words(ledger.get("acct_A", "k1"))
    'completed 3 h ago: replayed until 1970-01-02T00:00:15Z (in 21 h); the sweep may delete it after that'
    """
    row, now = view.row, view.now
    age = human_duration(max(0, view.age_ms))
    nxt = row.generation + 1
    if view.state is State.PENDING_FRESH:
        left = human_duration(view.takeover_in_ms or 0)
        if row.generation == 1 and row.updated_at > row.created_at:
            # Only a lease renewal writes a pending first generation after its claim.
            claimed = human_duration(max(0, now - row.created_at))
            age = f"claimed {claimed} ago, lease last renewed {age} ago"
        else:
            age = f"{age} old"
        return f"pending, {age}: retries get 409 for {left} more, then the next retry takes over as generation {nxt}"
    if view.state is State.PENDING_STALE:
        return (
            f"pending, {age} old, past the {human_duration(view.pending_ttl_ms)} TTL: "
            f"the next retry takes over as generation {nxt}"
        )
    if view.state is State.COMPLETED:
        until = view.replay_until or view.sweep_after
        return (
            f"completed {age} ago: replayed until {iso(until, millis=False)} ({ago(until, now)}); "
            f"the sweep may delete it after that"
        )
    # EXPIRED: past retention. The row still exists, so the request path still
    # treats it by status until a sweep deletes it.
    retention = human_duration(view.retention_ms)
    if row.status is Status.COMPLETED:
        return (
            f"completed {age} ago, past the {retention} retention: still replayed until a sweep deletes it "
            f"(any sweep since {iso(view.sweep_after, millis=False)}); after that a retry runs the mutation again"
        )
    return (
        f"pending, {age} old, past the {retention} retention: the next retry takes over as generation {nxt}, "
        f"or a sweep deletes it"
    )


def takeovers_words(generation: int) -> str:
    """The generation and what it means.

    >>> takeovers_words(1), takeovers_words(2), takeovers_words(4)
    ('1 (never taken over)', '2 (taken over once)', '4 (taken over 3 times)')
    """
    n = generation - 1
    if n == 0:
        return f"{generation} (never taken over)"
    if n == 1:
        return f"{generation} (taken over once)"
    return f"{generation} (taken over {n} times)"


def is_oversize_sentinel(row: StoredRow) -> bool:
    """A completed 500 with a NULL body is what the ledger stores when the real
    body exceeded the cap (a handler's own empty 500 is stored as "").

    >>> from idemctl import Ledger, Policy
    >>> ledger = Ledger.open(":memory:", policy=Policy(body_cap_bytes=4)); _ = ledger.init()
    >>> _ = ledger.complete(ledger.claim("acct_A", "big", "fp"), 200, {}, b"more than four bytes")
    >>> is_oversize_sentinel(ledger.lookup("acct_A", "big"))
    True
    """
    return row.status is Status.COMPLETED and row.response_body is None and row.response_status == OVERSIZE_STATUS


def body_kind(row: StoredRow) -> str:
    """One of ``none`` (pending), ``oversize``, ``empty``, ``json``, ``text``, ``blob``.

    >>> from idemctl import Ledger
    >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
    >>> _ = ledger.complete(ledger.claim("acct_A", "order-42", "fp"), 201, {}, b'{"id": 42}')
    >>> _ = ledger.complete(ledger.claim("acct_A", "raw", "fp"), 200, {}, b"\\xff\\xfe")
    >>> body_kind(ledger.lookup("acct_A", "order-42")), body_kind(ledger.lookup("acct_A", "raw"))
    ('json', 'blob')
    """
    body = row.response_body
    if row.status is not Status.COMPLETED:
        return "none"
    if body is None:
        return "oversize" if is_oversize_sentinel(row) else "none"
    if isinstance(body, (bytes, bytearray, memoryview)):
        return "blob"
    if body == "" or row.response_status in NULL_BODY_STATUSES:
        return "empty"
    try:
        json.loads(body)
    except ValueError:
        return "text"
    return "json"


def row_json(row: StoredRow) -> dict[str, Any]:
    """The stored columns as JSON-ready values, the body decoded per its kind.

    >>> from idemctl import Ledger
    >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
    >>> _ = ledger.complete(ledger.claim("acct_A", "order-42", "fp"), 201, {}, b'{"id": 42}')
    >>> response = row_json(ledger.lookup("acct_A", "order-42"))["response"]
    >>> response["body_kind"], response["body"], response["body_bytes"]
    ('json', '{"id": 42}', 10)
    """
    kind = body_kind(row)
    raw = row.body_bytes
    response: dict[str, Any] | None = None
    if row.status is Status.COMPLETED:
        response = {
            "status": row.response_status,
            "headers": row.headers,
            "body_kind": kind,
            "body_bytes": None if raw is None else len(raw),
            "body": row.response_body if isinstance(row.response_body, str) else None,
            "body_base64": base64.b64encode(raw).decode("ascii") if kind == "blob" and raw is not None else None,
            "oversize_sentinel": kind == "oversize",
        }
    return {
        "principal": row.principal,
        "key": row.key,
        "status": row.status.value,
        "generation": row.generation,
        "takeovers": row.generation - 1,
        "fingerprint": row.fingerprint,
        "created_at": row.created_at,
        "updated_at": row.updated_at,
        "response": response,
    }


def view_json(view: RowView) -> dict[str, Any]:
    """`row_json` plus the derived state.

    >>> from idemctl import Ledger
    >>> ledger = Ledger.open(":memory:", clock=lambda: 0); _ = ledger.init()
    >>> _ = ledger.complete(ledger.claim("acct_A", "order-42", "fp"), 201, {}, b"{}")
    >>> doc = view_json(ledger.get("acct_A", "order-42"))
    >>> doc["state"], doc["generation"], doc["replay_until"]
    ('completed', 1, 86400000)
    """
    doc = row_json(view.row)
    doc.update(
        {
            "state": view.state.value,
            "state_text": state_words(view),
            "now": view.now,
            "age_ms": view.age_ms,
            "pending_ttl_ms": view.pending_ttl_ms,
            "retention_ms": view.retention_ms,
            "takeover_at": view.takeover_at,
            "takeover_in_ms": view.takeover_in_ms,
            "takes_over_now": view.state in (State.PENDING_STALE, State.EXPIRED) and view.row.status is Status.PENDING,
            "replay_until": view.replay_until,
            "sweep_after": view.sweep_after,
        }
    )
    return doc


def event_json(event: FencedEvent) -> dict[str, Any]:
    """One fenced-out event.

    >>> from idemctl import Ledger
    >>> t = [0]; ledger = Ledger.open(":memory:", clock=lambda: t[0]); _ = ledger.init()
    >>> late = ledger.claim("acct_A", "k1", "fp"); t[0] = 31_000
    >>> _ = ledger.takeover("acct_A", "k1", "fp")
    >>> _ = ledger.complete(late, 201, {}, b"{}")
    >>> doc = event_json(next(ledger.fenced()))
    >>> doc["superseded_generation"], doc["current_generation"], doc["fenced_at"]
    (1, 2, 31000)
    """
    return {
        "id": event.id,
        "principal": event.principal,
        "key": event.key,
        "superseded_generation": event.superseded_generation,
        "current_generation": event.current_generation,
        "computed_status": event.computed_status,
        "fenced_at": event.fenced_at,
    }


def stats_json(stats: Stats) -> dict[str, Any]:
    """The `Stats` counts under their `stats --json` names.

    >>> from idemctl import Ledger
    >>> ledger = Ledger.open(":memory:", clock=lambda: 0); _ = ledger.init()
    >>> doc = stats_json(ledger.stats())
    >>> doc["total"], doc["expired"], doc["fenced_out_events"]
    (0, 0, 0)
    """
    return {
        "now": stats.now,
        "total": stats.total,
        "pending_fresh": stats.pending_fresh,
        "pending_stale": stats.pending_stale,
        "completed": stats.completed,
        "expired": stats.expired,
        "taken_over": stats.taken_over,
        "fenced_out_events": stats.fenced_out_events,
        "oldest_pending_at": stats.oldest_pending_at,
        "oldest_completed_at": stats.oldest_completed_at,
        "oldest_row_at": stats.oldest_row_at,
        "storage_bytes": stats.storage_bytes,
        "schema_version": stats.schema_version,
    }


def verdict_words(prediction: Prediction) -> str:
    """What `Ledger.predict` means for the request, in one sentence.

    >>> from idemctl import Ledger
    >>> ledger = Ledger.open(":memory:", clock=lambda: 0); _ = ledger.init()
    >>> verdict_words(ledger.predict("acct_A", "k1", "fp"))
    'no row for this key: this request would be claimed and run'
    >>> _ = ledger.claim("acct_A", "k1", "fp")
    >>> verdict_words(ledger.predict("acct_A", "k1", "fp"))
    'matches the stored fingerprint: this request gets 409 in progress for 30 s more, then takes over as generation 2'
    """
    view = prediction.view
    if prediction.verdict is Verdict.NEW or view is None:
        return "no row for this key: this request would be claimed and run"
    if prediction.verdict is Verdict.REUSED:
        return "does NOT match the stored fingerprint: this request gets 409 idempotency_key_reused"
    row = view.row
    if prediction.verdict is Verdict.REPLAY:
        return (
            f"matches the stored fingerprint: this request is replayed "
            f"({visible(row.response_status)}, generation {row.generation})"
        )
    if prediction.verdict is Verdict.IN_PROGRESS:
        return (
            f"matches the stored fingerprint: this request gets 409 in progress for "
            f"{human_duration(view.takeover_in_ms or 0)} more, then takes over as generation {row.generation + 1}"
        )
    return f"matches the stored fingerprint: this request takes over as generation {row.generation + 1}"


# -- the CLI's --json documents ---------------------------------------------------------------
def inspect_json(view: RowView, events: Iterable[FencedEvent]) -> dict[str, Any]:
    """`inspect --json` of a row: `found`, `view_json`, and the key's fenced-out events.

    >>> from idemctl import Ledger
    >>> ledger = Ledger.open(":memory:", clock=lambda: 0); _ = ledger.init()
    >>> _ = ledger.claim("acct_A", "k1", "fp")
    >>> doc = inspect_json(ledger.get("acct_A", "k1"), [])
    >>> doc["found"], doc["state"], doc["fenced_out"]
    (True, 'pending_fresh', [])
    """
    return {"found": True, **view_json(view), "fenced_out": [event_json(e) for e in events]}


def inspect_not_found_json(principal: str, key: str) -> dict[str, Any]:
    """`inspect --json` when the ledger has no row for the key: a document
    still, so that a script reads an answer rather than an empty stdout.

    >>> inspect_not_found_json("acct_A", "order-42")
    {'found': False, 'principal': 'acct_A', 'key': 'order-42'}
    """
    return {"found": False, "principal": principal, "key": key}


@dataclass(frozen=True)
class JsonListing:
    """A JSON object holding one array that may be too long to build in
    memory: `head`'s fields, then `name`: [`items`...], then `tail()`'s
    fields. `tail` is called after the items, when it can say whether the
    listing was cut."""

    head: Mapping[str, Any]
    name: str
    items: Iterable[Any]
    tail: Callable[[], Mapping[str, Any]]

    def document(self) -> dict[str, Any]:
        """The whole document at once, as a writer that streams it produces.

        >>> pending_json(0, 30_000, False, [], lambda: False).document()
        {'now': 0, 'pending_ttl_ms': 30000, 'stale_only': False, 'rows': [], 'truncated': False}
        """
        return {**self.head, self.name: list(self.items), **self.tail()}


def pending_json(
    now: int, pending_ttl_ms: int, stale_only: bool, views: Iterable[RowView], truncated: Callable[[], bool]
) -> JsonListing:
    """`pending --json`, streamed: each row as `view_json`; `truncated()` says
    after the rows whether more existed than the limit let through."""
    return JsonListing(
        {"now": now, "pending_ttl_ms": pending_ttl_ms, "stale_only": stale_only},
        "rows",
        (view_json(v) for v in views),
        lambda: {"truncated": truncated()},
    )


def failover_check_json(check: FailoverCheck) -> dict[str, Any]:
    """`doctor --json`: the replication settings read and what they mean."""
    s = check.settings
    replication = None
    if s is not None:
        replication = {
            "synchronous_commit": s.synchronous_commit,
            "synchronous_standby_names": s.synchronous_standby_names,
            "in_recovery": s.in_recovery,
            "standbys": list(s.standbys),
        }
    return {
        "ledger": check.where,
        "ok": check.ok,
        "replication": replication,
        "findings": [{"severity": f.severity.value, "message": f.message} for f in check.findings],
    }


def fenced_json(now: int, truncated: bool, fenced_log: bool, events: Iterable[FencedEvent]) -> dict[str, Any]:
    """`fenced --json`. `fenced_log` is False for a ledger that does not
    record fenced-out events (the recipe's table alone).

    >>> fenced_json(0, False, True, [])
    {'now': 0, 'truncated': False, 'fenced_log': True, 'events': []}
    """
    return {"now": now, "truncated": truncated, "fenced_log": fenced_log, "events": [event_json(e) for e in events]}


def stats_report_json(database: str, policy: Policy, stats: Stats, check_failed: Sequence[str]) -> dict[str, Any]:
    """`stats --json`: where, under which policy, the counts, and which
    `--max-*` thresholds were exceeded.

    >>> from idemctl import Ledger
    >>> ledger = Ledger.open(":memory:", clock=lambda: 0); _ = ledger.init()
    >>> doc = stats_report_json(ledger.describe(), ledger.policy, ledger.stats(), [])
    >>> doc["database"], doc["total"], doc["check_failed"]
    (':memory:', 0, [])
    """
    doc: dict[str, Any] = {
        "database": database,
        "pending_ttl_ms": policy.pending_ttl_ms,
        "retention_ms": policy.retention_ms,
    }
    doc.update(stats_json(stats))
    doc["check_failed"] = list(check_failed)
    return doc


def sweep_dry_run_json(now: int, policy: Policy, would_delete: int, would_delete_fenced: int) -> dict[str, Any]:
    """`sweep --dry-run --json`: what a sweep at `now` would delete.

    >>> sweep_dry_run_json(100_000_000, Policy(), 3, 0)["cutoff"]
    13600000
    """
    return {
        "dry_run": True,
        "would_delete": would_delete,
        "would_delete_fenced": would_delete_fenced,
        "cutoff": now - policy.retention_ms,
        "fenced_cutoff": now - policy.fenced_retention_ms,
        "retention_ms": policy.retention_ms,
        "fenced_retention_ms": policy.fenced_retention_ms,
    }


def sweep_json(drained: Drained, policy: Policy, *, batch_size: int, elapsed_ms: int, remaining: int) -> dict[str, Any]:
    """`sweep --json`: what `Ledger.drain` deleted, and why it stopped.

    >>> from idemctl import Ledger
    >>> ledger = Ledger.open(":memory:", clock=lambda: 0); _ = ledger.init()
    >>> doc = sweep_json(ledger.drain(batch=250), ledger.policy, batch_size=250, elapsed_ms=3, remaining=0)
    >>> doc["deleted"], doc["batches"], doc["stopped"]
    (0, 1, 'drained')
    """
    return {
        "dry_run": False,
        "deleted": drained.keys_deleted,
        "fenced_deleted": drained.fenced_deleted,
        "batches": drained.batches,
        "batch_size": batch_size,
        "elapsed_ms": elapsed_ms,
        "stopped": drained.stopped.value,
        "remaining": remaining,
        "retention_ms": policy.retention_ms,
        "fenced_retention_ms": policy.fenced_retention_ms,
    }


def fingerprint_json(
    fingerprint: str,
    method: str,
    path_and_query: str,
    headers: Mapping[str, str | None],
    body_bytes: int,
    prediction: Prediction | None,
    body_form: str = "raw",
) -> dict[str, Any]:
    """`fingerprint --json`: the fingerprint and the values it was computed
    from (`body_form`: which form of the body counted); with a `prediction`
    (`--key`), the stored row and the verdict.

    >>> doc = fingerprint_json("fc4d", "post", "/orders", {"content-type": None}, 0, None)
    >>> doc["method"], doc["row"], doc["matches"], doc["verdict"]
    ('POST', None, None, None)
    """
    view = None if prediction is None else prediction.view
    matches = None if prediction is None or view is None else prediction.verdict is not Verdict.REUSED
    return {
        "fingerprint": fingerprint,
        "method": method.upper(),
        "path_and_query": path_and_query,
        "headers": dict(headers),
        "body_bytes": body_bytes,
        "body_form": body_form,
        "row": None if view is None else view_json(view),
        "matches": matches,
        "verdict": None if prediction is None else prediction.verdict.value,
    }


def timeline_event_json(event: Event, start: int) -> dict[str, Any]:
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

    >>> from idemctl.scenario import builtin
    >>> from idemctl.simulate import run_scenario
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


def stats_prometheus(database: str, stats: Stats, policy: Policy) -> str:
    """`stats --format prometheus`: the ledger's state as Prometheus gauges, for
    node_exporter's textfile collector (write to a temporary file, then rename).

    >>> from idemctl import Ledger
    >>> ledger = Ledger.open(":memory:", clock=lambda: 60_000); _ = ledger.init()
    >>> _ = ledger.claim("acct", "k", "fp", now=0)
    >>> print(stats_prometheus(":memory:", ledger.stats(), ledger.policy).splitlines()[2])
    idemctl_ledger_rows{ledger=":memory:",state="pending_fresh"} 0
    """
    label = 'ledger="' + database.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    # 0 when nothing is pending: an alert on a series that vanished would go silent.
    oldest_pending = 0 if stats.oldest_pending_at is None else max(0, stats.now - stats.oldest_pending_at) / 1000
    one, taken, fenced = f"{{{label}}}", stats.taken_over, stats.fenced_out_events
    gauges: list[tuple[str, str, list[tuple[str, int | float | None]]]] = [
        (
            "idemctl_ledger_rows",
            "Rows in the ledger by state, as idemctl stats counts them.",
            [
                (f'{{{label},state="pending_fresh"}}', stats.pending_fresh),
                (f'{{{label},state="pending_stale"}}', stats.pending_stale),
                (f'{{{label},state="completed"}}', stats.completed),
                (f'{{{label},state="expired"}}', stats.expired),
            ],
        ),
        ("idemctl_ledger_taken_over_rows", "Rows whose reservation was taken over at least once.", [(one, taken)]),
        ("idemctl_ledger_fenced_out_events", "Fenced-out events: a mutation may have run twice.", [(one, fenced)]),
        ("idemctl_ledger_oldest_pending_age_seconds", "Age of the oldest pending row.", [(one, oldest_pending)]),
        ("idemctl_ledger_storage_bytes", "Size of the ledger on disk.", [(one, stats.storage_bytes)]),
        ("idemctl_ledger_pending_ttl_seconds", "The TTL the counts use.", [(one, policy.pending_ttl_ms / 1000)]),
        ("idemctl_ledger_retention_seconds", "The retention the counts use.", [(one, policy.retention_ms / 1000)]),
    ]
    lines: list[str] = []
    for name, help_text, samples in gauges:
        present = [(labels, value) for labels, value in samples if value is not None]
        if not present:
            continue
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        lines += [f"{name}{labels} {_sample(value)}" for labels, value in present]
    return "\n".join(lines) + "\n"


def copy_json(result: CopyResult) -> dict[str, Any]:
    """`copy --json`: what `Ledger.copy_to` copied, kept and refused.

    >>> from idemctl import Ledger
    >>> source, destination = Ledger.open(":memory:"), Ledger.open(":memory:")
    >>> _ = source.init(), destination.init()
    >>> doc = copy_json(source.copy_to(destination))
    >>> doc["copied"], doc["conflicts"]
    (0, [])
    """
    return {
        "source": result.source,
        "destination": result.destination,
        "dry_run": result.dry_run,
        "rows_read": result.rows_read,
        "copied": result.copied,
        "inserted": result.inserted,
        "updated": result.updated,
        "unchanged": result.unchanged,
        "kept_newer": [
            {
                "principal": k.principal,
                "key": k.key,
                "reason": k.reason.name.lower(),
                "why": k.reason.value,
                "source_generation": k.source_generation,
                "destination_generation": k.destination_generation,
            }
            for k in result.kept
        ],
        "conflicts": [
            {
                "principal": c.principal,
                "key": c.key,
                "source_fingerprint": c.source_fingerprint,
                "destination_fingerprint": c.destination_fingerprint,
            }
            for c in result.conflicts
        ],
        "fenced_read": result.fenced_read,
        "fenced_copied": result.fenced_copied,
        "fenced_unchanged": result.fenced_unchanged,
    }


# Human output names this many kept rows and conflicts; --json lists them all.
COPY_LISTED = 20


def copy_words(result: CopyResult) -> str:
    """`copy`'s summary: counts first, then the rows kept and refused, by key.

    >>> from idemctl import Ledger
    >>> source, destination = Ledger.open(":memory:"), Ledger.open(":memory:")
    >>> _ = source.init(), destination.init()
    >>> print(copy_words(source.copy_to(destination)))
    copied 0 of 0 row(s) from :memory: to :memory: (0 new, 0 updated), 0 already there, 0 kept newer in the destination, 0 conflict(s); fenced-out log: 0 of 0 event(s) copied
    """  # noqa: E501
    verb = "would copy" if result.dry_run else "copied"
    lines = [
        f"{verb} {result.copied} of {result.rows_read} row(s) from {visible(result.source)} to "
        f"{visible(result.destination)} ({result.inserted} new, {result.updated} updated), "
        f"{result.unchanged} already there, {result.kept_newer} kept newer in the destination, "
        f"{len(result.conflicts)} conflict(s); fenced-out log: {result.fenced_copied} of {result.fenced_read} "
        f"event(s) {'would be copied' if result.dry_run else 'copied'}"
    ]
    for kept in result.kept[:COPY_LISTED]:
        lines.append(
            f"kept {visible(kept.principal)}/{visible(kept.key)} (generation {kept.destination_generation} in the "
            f"destination, {kept.source_generation} in the source): {kept.reason.value}"
        )
    for conflict in result.conflicts[:COPY_LISTED]:
        lines.append(
            f"conflict {visible(conflict.principal)}/{visible(conflict.key)}: the destination holds another request "
            f"under this key (fingerprint {conflict.destination_fingerprint[:16]}…, source "
            f"{conflict.source_fingerprint[:16]}…); not copied"
        )
    hidden = max(0, len(result.kept) - COPY_LISTED) + max(0, len(result.conflicts) - COPY_LISTED)
    if hidden:
        lines.append(f"… and {hidden} more (--json lists them all)")
    if result.dry_run:
        lines.append("dry run: nothing written")
    return "\n".join(lines)


def _sample(value: float) -> str:
    """A sample value in the exposition format, every digit kept (`:g` would
    write 48054272 as 4.80543e+07).

    >>> _sample(48_054_272), _sample(30.0), _sample(12.345)
    ('48054272', '30', '12.345')
    """
    if isinstance(value, int):
        return str(value)
    return str(int(value)) if value.is_integer() else repr(value)
