"""The ledger's steps on Redis: a Store whose builders (`claim_or_read_statement`,
`takeover_statement`, `answer_statement`, `record_fenced_steps`,
`sweep_steps`, ...) make operations of scripts.py instead of SQL, so the
decision loop, the ledger and both drivers run them unchanged: a Statement's
text is the name of the operation, its parameters its keys and arguments
(keys.py: one hash slot per step). Operators' reads, purge and the copy are
in operator.py."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any, cast

from ...errors import SchemaMissingError, SchemaTooNewError
from ...outcomes import FencedEvent, InitAction, InitResult, StoredRow, SweepResult
from ...policy import Policy
from ...schema import SCHEMA_VERSION
from .. import statements
from ..engine import Rows
from ..statements import FENCED_TABLE
from ..store import Answer, Held
from ..store_base import Statement, StoreSteps, SweepSteps, Tables, Turn
from .engine import RedisEngine
from .keys import BUCKETS, Layout
from .operator import RedisOperatorStatements
from .rows import stored_row


def reply(rows: Rows) -> Any:
    """The one reply of an operation (the engine hands it back as one row)."""
    return rows[0][0]


def _generation(rows: Rows) -> int | None:
    value = rows[0][0]
    return None if value is None else int(value)


def _flag(rows: Rows) -> bool:
    return bool(rows[0][0])


def _row(rows: Rows) -> StoredRow | None:
    return stored_row(rows[0][0])


def _claimed(rows: Rows) -> int | None:
    return 1 if rows[0][0][0] == 1 else None


def _claimed_or_row(rows: Rows) -> int | StoredRow | None:
    got = rows[0][0]
    return 1 if got[0] == 1 else stored_row(got[1])


def _now_ms(rows: Rows) -> int:
    return int(rows[0][0])


class RedisStore(RedisOperatorStatements):
    """A ledger on Redis (standalone, Redis Cluster or Sentinel).

    Rows expire on their own at the end of their retention
    (`keep_rows_for`: the ledger's Policy.retention_ms, counted from each
    write); the sweep removes what expiry does not, the indexes' entries of
    expired rows and fenced-out events past their retention."""

    engine: RedisEngine

    def __init__(self, engine: RedisEngine) -> None:
        super().__init__(engine)
        self.layout = Layout(engine.prefix)
        self.retention_ms = Policy().retention_ms
        # With wait_replicas, a completion (and the check after a lost one)
        # is acknowledged once that many replicas hold it (engine.py, WAIT).
        waits = "wait_" if engine.location.wait_replicas else ""
        self._complete_op, self._completed_as_op = f"{waits}complete", f"{waits}completed_as"
        self._ops = {
            statements.CLAIM: "claim",
            statements.CLAIM_OR_READ: "claim",
            statements.LOOKUP: "row",
            statements.TAKEOVER: "takeover",
            statements.COMPLETE: self._complete_op,
            statements.COMPLETED_AS: self._completed_as_op,
            statements.RELEASE: "release",
            statements.RECORD_FENCED: "record_fenced",
            statements.VERSION: "version",
            statements.OLDEST: "sweep_probe",
            statements.OLDEST_WITH_FENCED: "sweep_probe",
        }

    def keep_rows_for(self, retention_ms: int) -> None:
        self.retention_ms = int(retention_ms)

    def sql(self, text: str) -> str:
        """The operation that does here what a SQL statement does there (the
        schema guard's version read; a test telling steps by their statement)."""
        return self._ops.get(text, text)

    # -- schema -----------------------------------------------------------------------
    def version_checked(self, version: int | None) -> None:
        # No marker, no ledger: refused before the first write, as a SQL
        # engine refuses a statement on a missing table.
        if version is None:
            raise SchemaMissingError(self.describe())
        super().version_checked(version)

    def init(self, now: int, dry_run: bool) -> InitResult:
        """Write the version marker (one script: two inits cannot both create)."""
        before = self.schema_version()
        if before is not None and before > SCHEMA_VERSION:
            raise SchemaTooNewError(self.describe(), before, SCHEMA_VERSION)
        if before == SCHEMA_VERSION:
            return InitResult(InitAction.UP_TO_DATE, before, SCHEMA_VERSION, dry_run)
        action = InitAction.CREATED if before is None else InitAction.UPGRADED
        if dry_run:
            return InitResult(action, before, SCHEMA_VERSION, dry_run)
        found = self.engine.run_one("init", {"keys": [self.layout.marker], "args": [SCHEMA_VERSION, now, BUCKETS]})
        self.forget_schema()
        if found is not None and int(found) >= SCHEMA_VERSION:
            return InitResult(InitAction.UP_TO_DATE, SCHEMA_VERSION, SCHEMA_VERSION, dry_run)
        return InitResult(action, before, SCHEMA_VERSION, dry_run)

    # -- request path -----------------------------------------------------------------
    def _claim_op(self, principal: str, key: str, fingerprint: str, token: int, now: int) -> dict[str, Any]:
        _, name, keys = self.layout.where(principal, key)
        return {"keys": keys, "args": [name, principal, key, fingerprint, token, now, self.retention_ms]}

    def claim_statement(
        self, principal: str, key: str, fingerprint: str, token: int, now: int
    ) -> Statement[int | None]:
        return Statement(self, "claim", self._claim_op(principal, key, fingerprint, token, now), _claimed, True)

    def claim_or_read_statement(
        self, principal: str, key: str, fingerprint: str, token: int, now: int
    ) -> Statement[int | StoredRow | None]:
        """The claim, and the row in its way when the key is taken: one script."""
        params = self._claim_op(principal, key, fingerprint, token, now)
        return Statement(self, "claim", params, _claimed_or_row, True)

    def lookup_statement(self, principal: str, key: str) -> Statement[StoredRow | None]:
        _, _, keys = self.layout.where(principal, key)
        return Statement(self, "row", {"keys": keys[:1]}, _row, False)

    def lookup(self, principal: str, key: str) -> StoredRow | None:
        return self.run(self.lookup_statement(principal, key))

    def takeover_statement(
        self, principal: str, key: str, fingerprint: str, token: int, now: int, stale_before: int, expired_before: int
    ) -> Statement[int | None]:
        _, name, keys = self.layout.where(principal, key)
        args = [name, fingerprint, token, now, stale_before, expired_before, self.retention_ms]
        return Statement(self, "takeover", {"keys": keys, "args": args}, _generation, True)

    def answer_statement(self, text: str, held: Held, answer: Answer, now: int = 0) -> Statement[bool]:
        """The completion's script (or, for COMPLETED_AS, the check after a
        lost one, which reads the row alone)."""
        principal, key, generation, token = held
        status, body, headers_json = answer
        _, name, keys = self.layout.where(principal, key)
        raw = self.dialect.body.bind(body)
        fence = "" if token is None else token
        stored: list[Any] = ["0", b""] if raw is None else ["1", cast(bytes, raw)]
        if text == statements.COMPLETED_AS:
            args = [generation, fence, status, headers_json, *stored]
            return Statement(self, self._completed_as_op, {"keys": keys[:1], "args": args}, _flag, False)
        args = [name, generation, fence, status, headers_json, now, self.retention_ms, *stored]
        return Statement(self, self._complete_op, {"keys": keys, "args": args}, _flag, True)

    def release_statement(self, principal: str, key: str, generation: int, token: int | None) -> Statement[bool]:
        _, name, keys = self.layout.where(principal, key)
        args = [name, generation, "" if token is None else token]
        return Statement(self, "release", {"keys": keys, "args": args}, _flag, True)

    def record_fenced_statement(
        self, principal: str, key: str, generation: int, computed_status: int, now: int
    ) -> Statement[FencedEvent | None]:
        bucket, keys = self.layout.fenced_keys(principal, key)
        args = [principal, key, generation, computed_status, now]

        def event(rows: Rows) -> FencedEvent:
            seq, current = rows[0][0]
            at = bucket + int(seq) * BUCKETS
            return FencedEvent(
                at, principal, key, generation, None if current is None else int(current), computed_status, now
            )

        return Statement(self, "record_fenced", {"keys": keys, "args": args}, event, True)

    def record_fenced_steps(
        self, principal: str, key: str, generation: int, computed_status: int, now: int
    ) -> StoreSteps[FencedEvent | None]:
        if FENCED_TABLE not in (yield Tables(self)):
            return None
        event = yield self.record_fenced_statement(principal, key, generation, computed_status, now)
        return cast("FencedEvent | None", event)

    def database_now_statement(self) -> Statement[int]:
        return Statement(self, "time", {}, _now_ms, False)

    def renew_statements(self, held: Sequence[Held], now: int) -> list[tuple[str, dict[str, Any]]]:
        """One script per reservation (each its own slot), pipelined by `renew`."""
        out: list[tuple[str, dict[str, Any]]] = []
        for principal, key, generation, token in held:
            _, name, keys = self.layout.where(principal, key)
            args = [name, generation, "" if token is None else token, now, self.retention_ms]
            out.append(("renew", {"keys": keys, "args": args}))
        return out

    def renew(self, held: Sequence[Held], now: int) -> int:
        self._guard()
        if not held:
            return 0
        return sum(int(r) for r in self.engine.many(self.renew_statements(held, now)))

    # -- sweep --------------------------------------------------------------------------
    def sweep_steps(self, now: int, cutoff: int, fenced_cutoff: int, limit: int) -> SweepSteps:
        """At most `limit` rows past retention (and their index entries, or
        the entries of rows Redis already expired) and `limit` fenced-out
        events past theirs: first the oldest entry of every bucket's indexes
        (one pipeline), then the due buckets' entries, then one script per
        bucket that decides row by row. `keys_deleted` counts the index
        entries removed: each stood for a row past retention."""
        fenced_log = FENCED_TABLE in (yield Tables(self))
        lay = self.layout
        firsts = yield Statement(self, "sweep_probe", {}, reply, False)
        rows_due, events_due = [], []
        oldest_row: float | None = None
        oldest_event: float | None = None
        for b in range(BUCKETS):
            first_row, first_event = firsts[2 * b], firsts[2 * b + 1]
            if first_row:
                score = first_row[0][1]
                oldest_row = score if oldest_row is None else min(oldest_row, score)
                if score < cutoff:
                    rows_due.append(b)
            if first_event and fenced_log:
                score = first_event[0][1]
                oldest_event = score if oldest_event is None else min(oldest_event, score)
                if score < fenced_cutoff:
                    events_due.append(b)
        if not rows_due and not events_due:
            row_headroom = int(now if oldest_row is None else oldest_row) - cutoff
            event_headroom = int(now if oldest_event is None else oldest_event) - fenced_cutoff
            if not fenced_log:
                event_headroom = row_headroom
            quiet = min(row_headroom, event_headroom)
            return SweepResult(0, 0, cutoff, fenced_cutoff, quiet if quiet > 0 else None)
        rows = yield from self._oldest_steps(lay.rows_by_time, rows_due, cutoff, limit)
        events = yield from self._oldest_steps(lay.events_by_time, events_due, fenced_cutoff, limit)
        turn: list[tuple[str, dict[str, Any]]] = []
        for b, names in rows.items():
            keys = [lay.rows_by_time(b), lay.pending(b), *(lay.row(b, m) for m in names)]
            turn.append(("sweep_rows", {"keys": keys, "args": [cutoff, *names]}))
        for b, ids in events.items():
            turn.append(
                ("sweep_fenced", {"keys": [lay.events(b), lay.events_by_time(b)], "args": [fenced_cutoff, len(ids)]})
            )
        results = yield Turn(self, turn)
        keys_deleted = sum(int(r[0][0]) for r in results[: len(rows)])
        fenced = sum(int(r[0][0]) for r in results[len(rows) :])
        return SweepResult(keys_deleted, fenced, cutoff, fenced_cutoff)

    def _oldest_steps(
        self, index: Callable[[int], bytes], buckets: Sequence[int], below: int, limit: int
    ) -> StoreSteps[dict[int, list[bytes]]]:
        """The `limit` oldest entries under `below` across these buckets'
        indexes, by bucket: each bucket's first page in one pipeline, merged,
        a bucket's next page read only when the merge reaches its end."""
        if not buckets:
            return {}
        size = max(8, min(limit, 128))

        def page(b: int, offset: int) -> tuple[str, dict[str, Any]]:
            return "below_scored", {"keys": [index(b)], "args": [below, offset, size]}

        heap: list[tuple[float, int, bytes, int]] = []

        def push(b: int, offset: int, entries: Sequence[tuple[bytes, float]]) -> None:
            for i, (name, score) in enumerate(entries):
                more = offset + size if i == size - 1 else -1
                heapq.heappush(heap, (score, b, bytes(name), more))

        pages = yield Statement(self, "batch", {"calls": [page(b, 0) for b in buckets]}, reply, False)
        for b, entries in zip(buckets, pages, strict=True):
            push(b, 0, entries)
        chosen: dict[int, list[bytes]] = {}
        taken = 0
        while heap and taken < limit:
            _, b, name, more = heapq.heappop(heap)
            chosen.setdefault(b, []).append(name)
            taken += 1
            if more >= 0:
                push(b, more, (yield Statement(self, *page(b, more), reply, False)))
        return chosen
