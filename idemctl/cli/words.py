"""What the ledger returns, in words: a row's state, its generation, its
body, a fingerprint's verdict, a copy's summary. Plain text (no rich), so the
commands, the simulator and the tests share one wording."""

from __future__ import annotations

import json

from ..durations import ago, human_duration, iso
from ..operations.copying import CopyResult
from ..outcomes import Prediction, RowView, State, Status, StoredRow, Verdict
from ..responses import NULL_BODY_STATUSES, OVERSIZE_STATUS
from .escaping import visible


def state_words(view: RowView) -> str:
    """What a row means right now, in one sentence an operator can act on.

    >>> from idemctl import Ledger
    >>> t = [0]; ledger = Ledger.open(":memory:", clock=lambda: t[0]); _ = ledger.init()
    >>> reservation = ledger.claim("acct_A", "k1", "fp"); t[0] = 12_000
    >>> state_words(ledger.operator.get("acct_A", "k1"))
    'pending, 12 s old: retries get 409 for 18 s more, then the next retry takes over as generation 2'
    >>> _ = ledger.store.renew([(reservation.principal, "k1", 1, reservation.token)], 14_000); t[0] = 15_000
    >>> state_words(ledger.operator.get("acct_A", "k1")).split(":")[0]
    'pending, claimed 15 s ago, lease last renewed 1 s ago'
    >>> _ = ledger.complete(reservation, 201, {}, b"{}"); t[0] += 3 * 3_600_000
    >>> state_words(ledger.operator.get("acct_A", "k1"))
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


def verdict_words(prediction: Prediction, reuse_status: int = 409) -> str:
    """What `Ledger.predict` means for the request, in one sentence.

    >>> from idemctl import Ledger
    >>> ledger = Ledger.open(":memory:", clock=lambda: 0); _ = ledger.init()
    >>> verdict_words(ledger.operator.predict("acct_A", "k1", "fp"))
    'no row for this key: this request would be claimed and run'
    >>> _ = ledger.claim("acct_A", "k1", "fp")
    >>> verdict_words(ledger.operator.predict("acct_A", "k1", "fp"))
    'matches the stored fingerprint: this request gets 409 in progress for 30 s more, then takes over as generation 2'
    """
    view = prediction.view
    if prediction.verdict is Verdict.NEW or view is None:
        return "no row for this key: this request would be claimed and run"
    if prediction.verdict is Verdict.REUSED:
        return f"does NOT match the stored fingerprint: this request gets {reuse_status} idempotency_key_reused"
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


# Human output names this many kept rows and conflicts; --json lists them all.
COPY_LISTED = 20


def copy_words(result: CopyResult) -> str:
    """`copy`'s summary: counts first, then the rows kept and refused, by key.

    >>> from idemctl import Ledger
    >>> source, destination = Ledger.open(":memory:"), Ledger.open(":memory:")
    >>> _ = source.init(), destination.init()
    >>> print(copy_words(source.operator.copy_to(destination)))
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
