"""Words and JSON documents for what the ledger returns.

Plain-text functions (no rich) so the CLI, the simulator and tests share one
wording; `*_json` functions define the stable `--json` field names in one
place (README "JSON field reference" documents them)."""

from __future__ import annotations

import base64
import json
import re
import unicodedata
from typing import Any

from .durations import ago, human_duration, iso
from .outcomes import FencedEvent, RowView, State, Stats, Status, StoredRow
from .responses import NULL_BODY_STATUSES, OVERSIZE_STATUS

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

    >>> state_words(view)  # doctest: +SKIP
    'pending, 12 s old: retries get 409 for 18 s more, then the next retry takes over as generation 3'
    >>> state_words(completed_view)  # doctest: +SKIP
    'completed 3 h ago: replayed until 2026-11-30T18:00:00Z (in 21 h); the sweep may delete it after that'
    """
    row, now = view.row, view.now
    age = human_duration(max(0, view.age_ms))
    nxt = row.generation + 1
    if view.state is State.PENDING_FRESH:
        left = human_duration(view.takeover_in_ms or 0)
        return f"pending, {age} old: retries get 409 for {left} more, then the next retry takes over as generation {nxt}"
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

    >>> is_oversize_sentinel(ledger.lookup("acct_A", "big"))  # doctest: +SKIP
    True
    """
    return row.status is Status.COMPLETED and row.response_body is None and row.response_status == OVERSIZE_STATUS


def body_kind(row: StoredRow) -> str:
    """One of ``none`` (pending), ``oversize``, ``empty``, ``json``, ``text``, ``blob``.

    >>> body_kind(ledger.lookup("acct_A", "order-42"))  # doctest: +SKIP
    'json'
    """
    if row.status is not Status.COMPLETED or (row.response_body is None and not is_oversize_sentinel(row)):
        return "none"
    if is_oversize_sentinel(row):
        return "oversize"
    if isinstance(row.response_body, (bytes, bytearray, memoryview)):
        return "blob"
    if row.response_body == "" or row.response_status in NULL_BODY_STATUSES:
        return "empty"
    try:
        json.loads(row.response_body)  # type: ignore[arg-type]
    except ValueError:
        return "text"
    return "json"


def row_json(row: StoredRow) -> dict[str, Any]:
    """The stored columns as JSON-ready values, the body decoded per its kind.

    >>> row_json(ledger.lookup("acct_A", "order-42"))["response"]["body_kind"]  # doctest: +SKIP
    'json'
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
    """`row_json` plus the derived state (the `inspect --json` document).

    >>> view_json(ledger.get("acct_A", "order-42"))["state"]  # doctest: +SKIP
    'completed'
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

    >>> event_json(next(ledger.fenced()))["superseded_generation"]  # doctest: +SKIP
    1
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

    >>> stats_json(ledger.stats())["expired"]  # doctest: +SKIP
    0
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
