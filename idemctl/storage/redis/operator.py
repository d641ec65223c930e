"""What operators read and change on a Redis ledger, and the copy's reads
and writes: every listing walks the buckets' indexes (keys.py), pipelined
(on a cluster, one pipeline per node, so every primary is visited), in
pages, and streams; nothing runs KEYS or holds the keyspace in memory. The
fenced-out log is read whole per bucket: it holds the rare fenced-out
completions of its retention."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ...fingerprint import stored_key_identity
from ...outcomes import FencedEvent, PurgeOutcome, PurgeResult, Stats, StoredRow
from ..rows import LedgerRow
from ..store import Store
from .keys import BUCKETS, Layout, bucket_of, member, split_member
from .rows import decode_event, encode_event, ledger_row, row_fields, stored_row

if TYPE_CHECKING:
    from .engine import RedisEngine

PAGE = 256
ROWS_AT_ONCE = 512


class RedisOperatorStatements(Store):
    """Listings, counts, purge and the copy, on Redis."""

    engine: RedisEngine
    layout: Layout
    retention_ms: int
    # A copy's walk: the buckets that held rows when it began, and the
    # sorted members of the bucket it is in (read once, not once a page).
    _copy_buckets: Sequence[int] = range(BUCKETS)
    _copy_names: tuple[int, list[bytes]] | None = None

    def decode_row(self, values: tuple[Any, ...]) -> StoredRow:
        row = stored_row(values)
        assert row is not None  # listings yield rows that exist
        return row

    # -- walking the buckets ---------------------------------------------------------------
    def _sum(self, op: str, key_of: Any, *args: Any) -> int:
        calls = [(op, {"keys": [key_of(b)], "args": list(args)}) for b in range(BUCKETS)]
        return sum(int(n) for n in self.engine.many(calls))

    def _by_score(self, key_of: Any, below: int | None) -> Iterator[tuple[float, str, str, int, bytes]]:
        """Every bucket's index entries, merged oldest first: (score,
        principal, key, bucket, member); with `below`, only scores under it."""
        heap: list[tuple[float, str, str, int, bytes, int]] = []

        def page(b: int, start: int) -> tuple[str, dict[str, Any]]:
            return "range", {"keys": [key_of(b)], "args": [start, start + PAGE - 1]}

        def push(b: int, start: int, entries: Sequence[tuple[bytes, float]]) -> None:
            for i, (name, score) in enumerate(entries):
                if below is not None and score >= below:
                    return
                p, k = split_member(bytes(name))
                last = start + PAGE if i == len(entries) - 1 and len(entries) == PAGE else -1
                heapq.heappush(heap, (score, p, k, b, bytes(name), last))

        for b, entries in enumerate(self.engine.many([page(b, 0) for b in range(BUCKETS)])):
            push(b, 0, entries)
        while heap:
            score, p, k, b, name, more = heapq.heappop(heap)
            if more >= 0:  # the last entry of a full page: the bucket's next page joins
                op, params = page(b, more)
                push(b, more, self.engine.run_one(op, params))
            yield score, p, k, b, name

    def _rows(self, op: str, wanted: Sequence[tuple[int, bytes]]) -> list[Any]:
        return self.engine.many([(op, {"keys": [self.layout.row(b, m)]}) for b, m in wanted])

    # -- counts ----------------------------------------------------------------------------
    def count_rows(self) -> int:
        return self._sum("card", self.layout.rows_by_time)

    def count_expired(self, cutoff: int) -> int:
        return self._sum("count_below", self.layout.rows_by_time, cutoff)

    def count_fenced_expired(self, cutoff: int) -> int:
        return self._sum("count_below", self.layout.events_by_time, cutoff) if self.has_fenced_log() else 0

    def stats(self, now: int, stale_before: int, expired_before: int) -> Stats:
        total = fresh = stale = completed = expired = expired_pending = taken = 0
        oldest: dict[str, int] = {}
        for states in self._states():
            s, g, c, u = states
            status, generation, created, updated = bytes(s).decode(), int(g), int(c), int(u)
            total += 1
            taken += generation > 1
            gone = updated < expired_before
            expired += gone
            if status == "pending":
                stale += updated < stale_before
                fresh += not gone and updated >= stale_before
                expired_pending += gone
            else:
                completed += not gone
            for name in (status, "any"):
                oldest[name] = min(oldest.get(name, created), created)
        fenced = self._sum("hlen", self.layout.events) if self.has_fenced_log() else 0
        oldest_at = (oldest.get("pending"), oldest.get("completed"), oldest.get("any"))
        counts = (total, fresh, stale, completed, expired, expired_pending, taken, *oldest_at)
        return self._stats(now, counts, fenced, None)  # Redis reports no storage size

    def _states(self) -> Iterator[list[Any]]:
        """(status, generation, created_at, updated_at) of every row, bucket by bucket."""
        lay = self.layout
        for start in range(0, BUCKETS, 64):
            buckets = range(start, min(start + 64, BUCKETS))
            names = self.engine.many([("range", {"keys": [lay.rows_by_time(b)], "args": [0, -1]}) for b in buckets])
            wanted = [(b, bytes(m)) for b, entries in zip(buckets, names, strict=True) for m, _ in entries]
            for at in range(0, len(wanted), ROWS_AT_ONCE):
                for fields in self._rows("state", wanted[at : at + ROWS_AT_ONCE]):
                    if fields[0] is not None:
                        yield fields

    # -- listings --------------------------------------------------------------------------
    def iter_pending(
        self, stale_only: bool, stale_before: int, principal: str | None, limit: int | None
    ) -> Iterator[tuple[Any, ...]]:
        """Pending rows oldest first, streamed: the buckets' pending indexes
        merged, the rows read a page at a time."""
        if limit is not None and limit <= 0:
            return
        sent = 0
        wanted: list[tuple[int, bytes]] = []
        entries = self._by_score(self.layout.pending, stale_before if stale_only else None)
        while True:
            entry = next(entries, None)
            if entry is not None and (principal is None or entry[1] == principal):
                wanted.append((entry[3], entry[4]))
            if wanted and (entry is None or len(wanted) >= PAGE):
                for fields in self._rows("row", wanted):
                    if fields[0] is None or fields[3] != b"pending":
                        continue  # expired or completed since the index was read
                    if stale_only and int(fields[9]) >= stale_before:
                        continue
                    yield tuple(fields)
                    sent += 1
                    if limit is not None and sent >= limit:
                        return
                wanted = []
            if entry is None:
                return

    def _events(self, buckets: Iterable[int]) -> Iterator[FencedEvent]:
        chosen = list(buckets)
        logs = self.engine.many([("hgetall", {"keys": [self.layout.events(b)]}) for b in chosen])
        for b, log in zip(chosen, logs, strict=True):
            for seq, stored in log.items():
                yield decode_event(seq, b, bytes(stored))

    def _event_bucket(self, principal: str, key: str) -> int:
        return bucket_of(member(principal, stored_key_identity(key)))

    def iter_fenced(
        self, principal: str | None, key: str | None, since: int | None, limit: int | None
    ) -> Iterator[FencedEvent]:
        if not self.has_fenced_log():
            return
        buckets = [self._event_bucket(principal, key)] if principal is not None and key is not None else range(BUCKETS)
        events = [
            e
            for e in self._events(buckets)
            if (principal is None or e.principal == principal)
            and (key is None or e.key == key)
            and (since is None or e.fenced_at >= since)
        ]
        events.sort(key=lambda e: (e.fenced_at, e.id), reverse=True)
        yield from events if limit is None else events[:limit]

    # -- purge -----------------------------------------------------------------------------
    def purge(self, principal: str, key: str, stale_before: int | None) -> PurgeResult:
        self._guard()
        _, name, keys = self.layout.where(principal, key)
        args = [name, "" if stale_before is None else stale_before]
        got = self.engine.run_one("purge", {"keys": keys, "args": args})
        if got[0] == 0:
            return PurgeResult(PurgeOutcome.NOT_FOUND, None)
        outcome = PurgeOutcome.PURGED if got[0] == 1 else PurgeOutcome.REFUSED_FRESH_PENDING
        return PurgeResult(outcome, stored_row(got[1]))

    # -- the copy --------------------------------------------------------------------------
    def _place(self, principal: str, key: str) -> tuple[int, bytes, list[bytes]]:
        # A row is placed by its key's identity ("k" and k are one key), as key_id on SQL.
        return self.layout.where(principal, stored_key_identity(key))

    def copy_page(self, after: tuple[str, str] | None, limit: int, *, with_token: bool = True) -> list[LedgerRow]:
        """At most `limit` rows, bucket by bucket and by member within a
        bucket, after the row `after` (None: from the start)."""
        lay = self.layout
        if after is None:
            start, last = 0, b""
            cards = self.engine.many([("card", {"keys": [lay.rows_by_time(b)]}) for b in range(BUCKETS)])
            self._copy_buckets = [b for b, n in enumerate(cards) if int(n)]
            self._copy_names = None
        else:
            start, last, _ = self._place(*after)
        page: list[LedgerRow] = []
        for b in (b for b in self._copy_buckets if b >= start):
            cached = self._copy_names
            if cached is None or cached[0] != b:
                names = self.engine.run_one("range", {"keys": [lay.rows_by_time(b)], "args": [0, -1]})
                cached = self._copy_names = (b, sorted(bytes(m) for m, _ in names))
            later = [m for m in cached[1] if b > start or m > last]
            for at in range(0, len(later), ROWS_AT_ONCE):
                for fields in self._rows("full_row", [(b, m) for m in later[at : at + ROWS_AT_ONCE]]):
                    row = ledger_row(fields)
                    if row is not None:
                        page.append(row if with_token else row._replace(token=None))
                        if len(page) >= limit:
                            return page
        return page

    def rows_at(self, keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], LedgerRow]:
        calls = [("full_row", {"keys": self._place(p, k)[2][:1]}) for p, k in keys]
        found = (ledger_row(fields) for fields in self.engine.many(calls))
        return {row.where: row for row in found if row is not None}

    def copy_insert(self, rows: Sequence[LedgerRow]) -> set[tuple[str, str]]:
        return self._copy("copy_insert", rows, lambda row: [])

    def copy_update(self, rows: Sequence[LedgerRow]) -> set[tuple[str, str]]:
        return self._copy(
            "copy_update", rows, lambda row: [row.fingerprint, row.generation, row.status, row.updated_at, row.key]
        )

    def _copy(self, op: str, rows: Sequence[LedgerRow], head: Callable[[LedgerRow], list[Any]]) -> set[tuple[str, str]]:
        """The places of `rows` that script `op` wrote, one call a row in one
        round trip; `head` gives what the script reads before the row's fields."""
        if not rows:
            return set()
        self._guard()
        calls = []
        for row in rows:
            _, name, keys = self._place(row.principal, row.key)
            args = [name, self.retention_ms, *head(row), *row_fields(row)]
            calls.append((op, {"keys": keys, "args": args}))
        return {row.where for row, done in zip(rows, self.engine.many(calls), strict=True) if int(done)}

    def fenced_page(self, after: int, limit: int) -> list[FencedEvent]:
        if not self.has_fenced_log():
            return []
        events = sorted((e for e in self._events(range(BUCKETS)) if e.id > after), key=lambda e: e.id)
        return events[:limit]

    def _stored_event(self, event: FencedEvent) -> bytes:
        return encode_event(
            event.principal,
            event.key,
            event.superseded_generation,
            event.current_generation,
            event.computed_status,
            event.fenced_at,
        )

    def copy_fenced(self, event: FencedEvent) -> bool:
        self._guard()
        b = self._event_bucket(event.principal, event.key)
        lay = self.layout
        keys = [lay.events(b), lay.events_by_time(b), lay.event_sequence(b)]
        params = {"keys": keys, "args": [self._stored_event(event), event.fenced_at]}
        return bool(self.engine.run_one("copy_fenced", params))

    def has_event(self, event: FencedEvent) -> bool:
        b = self._event_bucket(event.principal, event.key)
        stored = self.engine.run_one("hvals", {"keys": [self.layout.events(b)]})
        return self._stored_event(event) in {bytes(v) for v in stored}
