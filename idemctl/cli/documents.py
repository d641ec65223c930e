"""The documents the CLI writes for programs: every `--json` document but
`simulate`'s (which is its timeline's, in `timeline`), so their stable field
names are defined in this one place (docs/cli.md documents them), and the
Prometheus text of `stats --format prometheus`."""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..operations.copying import CopyResult
from ..operations.replication import FailoverCheck
from ..outcomes import Drained, FencedEvent, Prediction, RowView, Stats, Status, StoredRow, Verdict
from ..policy import Policy
from .words import body_kind, state_words

# Documents that show a value's attributes under their own names, in this
# order: listed here rather than taken from the class, as they are the interface.
_EVENT_FIELDS = [
    "id",
    "principal",
    "key",
    "superseded_generation",
    "current_generation",
    "computed_status",
    "fenced_at",
]
_STATS_FIELDS = [
    "now",
    "total",
    "pending_fresh",
    "pending_stale",
    "completed",
    "expired",
    "expired_pending",
    "taken_over",
    "fenced_out_events",
    "oldest_pending_at",
    "oldest_completed_at",
    "oldest_row_at",
    "storage_bytes",
    "schema_version",
]


def _fields(value: object, names: Sequence[str]) -> dict[str, Any]:
    return {name: getattr(value, name) for name in names}


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
            "takes_over_now": view.takes_over_now,
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
    return _fields(event, _EVENT_FIELDS)


def stats_json(stats: Stats) -> dict[str, Any]:
    """The `Stats` counts under their `stats --json` names.

    >>> from idemctl import Ledger
    >>> ledger = Ledger.open(":memory:", clock=lambda: 0); _ = ledger.init()
    >>> doc = stats_json(ledger.stats())
    >>> doc["total"], doc["expired"], doc["fenced_out_events"]
    (0, 0, 0)
    """
    return _fields(stats, _STATS_FIELDS)


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
    """`doctor --json`: the engine, the replication settings read and what they mean."""
    replication = None if check.settings is None else check.settings.document()
    return {
        "ledger": check.where,
        "engine": check.engine,
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
            "Rows in the ledger by state, as idemctl stats counts them: a pending row past retention counts as"
            " pending_stale and as expired.",
            [
                (f'{{{label},state="pending_fresh"}}', stats.pending_fresh),
                (f'{{{label},state="pending_stale"}}', stats.pending_stale),
                (f'{{{label},state="completed"}}', stats.completed),
                (f'{{{label},state="expired"}}', stats.expired),
            ],
        ),
        (
            "idemctl_ledger_expired_pending_rows",
            "Pending rows past retention, counted in both pending_stale and expired.",
            [(one, stats.expired_pending)],
        ),
        ("idemctl_ledger_taken_over_rows", "Rows whose reservation was taken over at least once.", [(one, taken)]),
        ("idemctl_ledger_fenced_out_events", "Fenced-out events: a mutation may have run twice.", [(one, fenced)]),
        ("idemctl_ledger_oldest_pending_age_seconds", "Age of the oldest pending row.", [(one, oldest_pending)]),
        ("idemctl_ledger_storage_bytes", "Size of the ledger on disk.", [(one, stats.storage_bytes)]),
        ("idemctl_ledger_pending_ttl_seconds", "The TTL the counts use.", [(one, policy.pending_ttl_ms / 1000)]),
        ("idemctl_ledger_retention_seconds", "The retention the counts use.", [(one, policy.retention_ms / 1000)]),
        # node_exporter serves the last file written for ever: an alert on
        # time() minus this tells a stopped cron from a quiet ledger.
        ("idemctl_ledger_stats_timestamp_seconds", "When these counts were taken.", [(one, stats.now / 1000)]),
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


def _sample(value: float) -> str:
    """A sample value in the exposition format, every digit kept (`:g` would
    write 48054272 as 4.80543e+07).

    >>> _sample(48_054_272), _sample(30.0), _sample(12.345)
    ('48054272', '30', '12.345')
    """
    if isinstance(value, int):
        return str(value)
    return str(int(value)) if value.is_integer() else repr(value)
