"""What operators read and do to rows one at a time: pending rows and
fenced-out events listed, the counts of `stats`, purging one row."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from ..outcomes import FencedEvent, PurgeOutcome, PurgeResult, Stats
from .rows import STALE_PENDING_SQL
from .statements import (
    COUNT_EXPIRED,
    COUNT_FENCED,
    COUNT_FENCED_EXPIRED,
    EVENT_COLUMNS,
    PURGE,
    PURGE_READ,
    PURGE_TRIES,
    PURGE_VERSION,
    ROW_COLUMNS,
    STATS,
    TABLES,
)
from .store_base import StoreBase

# The pending listing's order, and where a page of it resumes (row values:
# every engine idemctl runs on compares them as ORDER BY sorts).
_PENDING_ORDER = " ORDER BY updated_at, principal, key"
_AFTER = " AND (updated_at, principal, key) > (:after_updated_at, :after_principal, :after_key)"
_SORT_KEY = tuple(ROW_COLUMNS.replace(" ", "").split(",").index(c) for c in ("updated_at", "principal", "key"))


class OperatorStatements(StoreBase):
    """Reads for the CLI and dashboards, and purge; nothing here claims a row."""

    def count_expired(self, cutoff: int) -> int:
        return int(self._read(COUNT_EXPIRED, {"cutoff": cutoff})[0][0])

    def count_fenced_expired(self, cutoff: int) -> int:
        if not self.has_fenced_log():
            return 0
        return int(self._read(COUNT_FENCED_EXPIRED, {"cutoff": cutoff})[0][0])

    # -- operator side ----------------------------------------------------------------------------
    def iter_pending(
        self,
        stale_only: bool,
        stale_before: int,
        principal: str | None,
        limit: int | None,
    ) -> Iterator[tuple[Any, ...]]:
        """Raw pending rows, oldest first, streamed (decoding is the caller's,
        so that one malformed row does not end the listing); with
        `stale_only`, the stale reservations whatever their age
        (STALE_PENDING_SQL)."""
        sql = f"SELECT {ROW_COLUMNS} FROM idempotency_keys WHERE status = 'pending'"
        params: dict[str, Any] = {}
        if stale_only:
            sql += f" AND {STALE_PENDING_SQL}"
            params["stale_before"] = stale_before
        if principal is not None:
            sql += " AND principal = :principal"
            params["principal"] = principal
        page = self.engine.dialect.list_page
        if page is not None:
            return self._pages(sql, params, limit, page)
        sql += _PENDING_ORDER
        if limit is not None:
            sql += " LIMIT :limit"
            params["limit"] = limit
        return self.engine.stream(self.sql(sql), params)

    def _pages(self, sql: str, params: dict[str, Any], limit: int | None, page: int) -> Iterator[tuple[Any, ...]]:
        """The listing `sql` selects, in pages of `page` rows, each read after
        the last row of the one before in the listing's order (its sort key
        is unique: the primary key ends it). A row that changes between two
        pages shows where it is when its page is read, as in any listing
        that is not one snapshot."""
        after: dict[str, Any] = {}
        left = limit
        while left is None or left > 0:
            n = page if left is None else min(page, left)
            rows = self._read(
                sql + (_AFTER if after else "") + _PENDING_ORDER + " LIMIT :limit", {**params, **after, "limit": n}
            )
            yield from rows
            if len(rows) < n:
                return
            updated_at, principal, key = (rows[-1][i] for i in _SORT_KEY)
            after = {"after_updated_at": updated_at, "after_principal": principal, "after_key": key}
            left = None if left is None else left - n

    def iter_fenced(
        self, principal: str | None, key: str | None, since: int | None, limit: int | None
    ) -> Iterator[FencedEvent]:
        if not self.has_fenced_log():
            return
        sql = f"SELECT {EVENT_COLUMNS} FROM idemctl_fenced_out WHERE 1 = 1"
        params: dict[str, Any] = {}
        for clause, name, value in (
            ("principal = :principal", "principal", principal),
            ("key = :key", "key", key),
            ("fenced_at >= :since", "since", since),
        ):
            if value is not None:
                sql += f" AND {clause}"
                params[name] = value
        sql += " ORDER BY fenced_at DESC, id DESC"
        if limit is not None:
            sql += " LIMIT :limit"
            params["limit"] = limit
        for values in self._read(sql, params):
            yield self._event(values)

    def stats(self, now: int, stale_before: int, expired_before: int) -> Stats:
        counts = self._read(STATS, {"stale_before": stale_before, "expired_before": expired_before})[0]
        fenced = int(self._read(COUNT_FENCED)[0][0]) if self.has_fenced_log() else 0
        return self._stats(now, counts, fenced, self.engine.storage_bytes(TABLES))

    def _stats(self, now: int, counts: Sequence[Any], fenced: int, storage_bytes: int | None) -> Stats:
        """The Stats of `counts` as STATS reads them (total, fresh, stale,
        completed, expired, expired pending, taken over, then the oldest
        pending, completed and any row's created_at), whatever store counted them."""
        total, fresh, stale, completed, expired, expired_pending, taken, oldest_p, oldest_c, oldest = counts
        return Stats(
            now=now,
            total=int(total),
            pending_fresh=int(fresh),
            pending_stale=int(stale),
            completed=int(completed),
            expired=int(expired),
            expired_pending=int(expired_pending),
            taken_over=int(taken),
            fenced_out_events=fenced,
            oldest_pending_at=None if oldest_p is None else int(oldest_p),
            oldest_completed_at=None if oldest_c is None else int(oldest_c),
            oldest_row_at=None if oldest is None else int(oldest),
            storage_bytes=storage_bytes,
            schema_version=self.schema_version() or 0,
        )

    def purge(self, principal: str, key: str, stale_before: int | None) -> PurgeResult:
        self._guard()
        if not self.dialect.returning:
            return self._purge_by_version(principal, key, stale_before)
        rows = self._write(PURGE, {"principal": principal, "key": key, "stale_before": stale_before})
        if rows:
            return PurgeResult(PurgeOutcome.PURGED, self.decode_row(rows[0]))
        row = self.lookup(principal, key)
        if row is None:
            return PurgeResult(PurgeOutcome.NOT_FOUND, None)
        return PurgeResult(PurgeOutcome.REFUSED_FRESH_PENDING, row)

    def _purge_by_version(self, principal: str, key: str, stale_before: int | None) -> PurgeResult:
        where = {"principal": principal, "key": key}
        seen = self._read(PURGE_READ, where)
        for _ in range(PURGE_TRIES):
            if not seen:
                return PurgeResult(PurgeOutcome.NOT_FOUND, None)
            *values, token = seen[0]
            row = self.decode_row(tuple(values))
            _, _, _, status, generation, _, _, _, _, updated = values
            version = {"token": token, "generation": generation, "status": status, "updated_at": updated}
            if self._write(PURGE_VERSION, {**where, **version, "stale_before": stale_before}):
                return PurgeResult(PurgeOutcome.PURGED, row)
            again = self._read(PURGE_READ, where)
            if again == seen:
                # The same version is still there: the WHERE refused it.
                return PurgeResult(PurgeOutcome.REFUSED_FRESH_PENDING, row)
            seen = again
        # Rewritten under us every time: as busy as a fresh reservation.
        if not seen:
            return PurgeResult(PurgeOutcome.NOT_FOUND, None)
        return PurgeResult(PurgeOutcome.REFUSED_FRESH_PENDING, self.decode_row(tuple(seen[0][:-1])))
