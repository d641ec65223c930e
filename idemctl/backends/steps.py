"""The single-statement steps that every SQL backend shares.

Each method runs exactly one statement that the backend's own module defines
(bound here as class attributes, so all of a backend's SQL still lives in its
module) and turns the rows it returns into the values of the Backend
protocol. Backends supply how a statement runs: `_all` for a read,
`_write_all` for a write (on SQLite, through the writer queue)."""

from __future__ import annotations

from ..outcomes import FencedEvent, PurgeOutcome, PurgeResult, Stats, StoredRow


def event_from(values: tuple) -> FencedEvent:
    return FencedEvent(*values)


def stats_from(
    now: int, counts: tuple, fenced_out_events: int, storage_bytes: int | None, schema_version: int | None
) -> Stats:
    """Stats from the row of a backend's SQL_STATS: total, pending fresh,
    pending stale, completed, expired, taken over, then the oldest pending,
    completed and any row's created_at."""
    (total, fresh, stale, completed, expired, taken, oldest_p, oldest_c, oldest) = counts
    return Stats(
        now=now,
        total=int(total),
        pending_fresh=int(fresh),
        pending_stale=int(stale),
        completed=int(completed),
        expired=int(expired),
        taken_over=int(taken),
        fenced_out_events=fenced_out_events,
        oldest_pending_at=oldest_p,
        oldest_completed_at=oldest_c,
        oldest_row_at=oldest,
        storage_bytes=storage_bytes,
        schema_version=schema_version or 0,
    )


class SqlSteps:
    """Mixin: claim, lookup, takeover, complete, record_fenced, release and
    count_expired on top of a backend's statements."""

    SQL_CLAIM: str
    SQL_LOOKUP: str
    SQL_TAKEOVER: str
    SQL_COMPLETE: str
    SQL_RECORD_FENCED: str
    SQL_RELEASE: str
    SQL_COUNT_EXPIRED: str
    has_fenced_log: bool

    # -- supplied by the backend -------------------------------------------------
    def _all(self, sql: str, params: tuple | dict = ()) -> list[tuple]:
        raise NotImplementedError

    def _write_all(self, sql: str, params: tuple | dict = ()) -> list[tuple]:
        raise NotImplementedError

    @staticmethod
    def _row(values: tuple) -> StoredRow:
        raise NotImplementedError

    @staticmethod
    def _body_param(body: str | bytes | None) -> object:
        """The response body as this backend binds it."""
        return body

    # -- one statement each ------------------------------------------------------
    def claim(self, principal: str, key: str, fingerprint: str, now: int) -> int | None:
        rows = self._write_all(self.SQL_CLAIM, (principal, key, fingerprint, now, now))
        return int(rows[0][0]) if rows else None

    def lookup(self, principal: str, key: str) -> StoredRow | None:
        rows = self._all(self.SQL_LOOKUP, (principal, key))
        return self._row(rows[0]) if rows else None

    def takeover(self, principal: str, key: str, fingerprint: str, now: int, stale_before: int) -> int | None:
        rows = self._write_all(self.SQL_TAKEOVER, (now, principal, key, fingerprint, stale_before))
        return int(rows[0][0]) if rows else None

    def complete(
        self,
        principal: str,
        key: str,
        generation: int,
        status: int,
        body: str | bytes | None,
        headers_json: str,
        now: int,
    ) -> bool:
        params = (status, self._body_param(body), headers_json, now, principal, key, generation)
        return bool(self._write_all(self.SQL_COMPLETE, params))

    def record_fenced(self, principal: str, key: str, generation: int, computed_status: int, now: int) -> FencedEvent | None:
        if not self.has_fenced_log:
            return None
        params = (principal, key, generation, principal, key, computed_status, now)
        rows = self._write_all(self.SQL_RECORD_FENCED, params)
        return event_from(rows[0]) if rows else None

    def release(self, principal: str, key: str, generation: int) -> bool:
        return bool(self._write_all(self.SQL_RELEASE, (principal, key, generation)))

    def count_expired(self, cutoff: int) -> int:
        return int(self._all(self.SQL_COUNT_EXPIRED, (cutoff,))[0][0])

    def _purge_result(self, principal: str, key: str, deleted: list[tuple]) -> PurgeResult:
        """What a purge's DELETE … RETURNING did, explained when it deleted nothing."""
        if deleted:
            return PurgeResult(PurgeOutcome.PURGED, self._row(deleted[0]))
        row = self.lookup(principal, key)
        if row is None:
            return PurgeResult(PurgeOutcome.NOT_FOUND, None)
        return PurgeResult(PurgeOutcome.REFUSED_FRESH_PENDING, row)
