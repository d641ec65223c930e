"""The operator's side of a ledger (`Ledger.operator`): what the CLI and
dashboards read (one row with its derived state, pending rows, fenced-out
events, a prediction, stats), and what operators change (purging one row,
the sweep and the drain, copying to another ledger)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from ..errors import MalformedRowError
from ..fingerprint import parse_key
from ..operations import copying
from ..outcomes import FencedEvent, Prediction, PurgeResult, RowView, State, Stats, Status, StoredRow, Verdict
from ..storage import Store
from ..storage.store import derive_state
from .core import LedgerCore
from .housekeeping import Housekeeping


class HasStore(Protocol):
    """A ledger or its operator: anything holding a ledger's store."""

    @property
    def store(self) -> Store: ...


class Operator:
    """What operators call on a ledger: reads (nothing here claims a row),
    purge, sweep, drain and copy. It shares its ledger's store, policy and
    clock: ``ledger.operator`` of an open :class:`~idemctl.Ledger`.

    >>> from idemctl import Ledger
    >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
    >>> _ = ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b""))
    >>> ledger.operator.stats().completed, ledger.operator.get("acct_1", "k1").row.response_status
    (1, 201)
    """

    def __init__(self, core: LedgerCore, chores: Housekeeping) -> None:
        self.core = core
        self.store, self.policy = core.store, core.policy
        self.now, self.describe = core.now, core.describe
        self.has_fenced_log, self.schema_version, self.require_schema = (
            core.has_fenced_log,
            core.schema_version,
            core.require_schema,
        )
        self.sweep, self.drain = chores.sweep, chores.drain
        self.count_expired, self.count_fenced_expired = chores.count_expired, chores.count_fenced_expired
        self._chores = chores

    @property
    def drain_batch(self) -> int:
        """The batch size this storage engine drains a backlog with (see
        :meth:`drain`): 250 on SQLite, 5000 on PostgreSQL.

        >>> from idemctl import Ledger
        >>> Ledger.open(":memory:").operator.drain_batch
        250
        """
        return self._chores.drain_batch

    def view(self, row: StoredRow, *, now: int | None = None) -> RowView:
        """A row with its derived state at `now`."""
        now = self.core.now() if now is None else now
        p = self.policy
        state = derive_state(row, now - p.pending_ttl_ms, now - p.retention_ms)
        return RowView(row, state, now, p.pending_ttl_ms, p.retention_ms)

    def get(self, principal: str, key: str, *, now: int | None = None) -> RowView | None:
        """One row with its derived state, or None.

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> _ = ledger.claim("acct_1", "k1", "fp")
        >>> ledger.operator.get("acct_1", "k1").state
        <State.PENDING_FRESH: 'pending_fresh'>
        """
        row = self.store.lookup(principal, parse_key(key) or key)
        return None if row is None else self.view(row, now=now)

    def pending(
        self,
        *,
        stale_only: bool = False,
        principal: str | None = None,
        limit: int | None = None,
        now: int | None = None,
        on_malformed: Callable[[MalformedRowError], None] | None = None,
    ) -> Iterator[RowView]:
        """Rows whose status is pending, oldest first, streamed. With
        ``stale_only``, just the stale reservations, the ones a retry would
        take over now, whatever their age: PENDING_STALE rows and pending
        rows past retention (their state is EXPIRED: the sweep may delete
        them), the same rows `stats().pending_stale` counts.
        A row written by another program that cannot be read raises
        MalformedRowError, or goes to ``on_malformed`` and the listing goes on.

        >>> from idemctl import Ledger
        >>> t = [0]; ledger = Ledger.open(":memory:", clock=lambda: t[0]); _ = ledger.init()
        >>> _ = ledger.claim("acct_1", "k1", "fp"); t[0] += 60_000; _ = ledger.claim("acct_1", "k2", "fp")
        >>> [(v.row.key, v.state.value) for v in ledger.operator.pending()]
        [('k1', 'pending_stale'), ('k2', 'pending_fresh')]
        >>> [v.row.key for v in ledger.operator.pending(stale_only=True)]
        ['k1']
        >>> t[0] += 2 * 86_400_000  # both past the one-day retention: still stale reservations
        >>> [(v.row.key, v.state.value, v.takes_over_now) for v in ledger.operator.pending(stale_only=True)]
        [('k1', 'expired', True), ('k2', 'expired', True)]
        """
        now = self.core.now() if now is None else now
        for values in self.store.iter_pending(stale_only, now - self.policy.pending_ttl_ms, principal, limit):
            try:
                row = self.store.decode_row(values)
            except MalformedRowError as exc:
                if on_malformed is None:
                    raise
                on_malformed(exc)
                continue
            yield self.view(row, now=now)

    def fenced(
        self,
        *,
        principal: str | None = None,
        key: str | None = None,
        since: int | None = None,
        limit: int | None = None,
    ) -> Iterator[FencedEvent]:
        """Fenced-out events, newest first.

        >>> from idemctl import Ledger
        >>> t = [0]; ledger = Ledger.open(":memory:", clock=lambda: t[0]); _ = ledger.init()
        >>> late = ledger.claim("acct_1", "k1", "fp"); t[0] += 60_000
        >>> _ = ledger.complete(ledger.takeover("acct_1", "k1", "fp"), 201, {}, b"B")
        >>> ledger.complete(late, 201, {}, b"A").stored
        False
        >>> event = next(ledger.operator.fenced(principal="acct_1"))
        >>> event.superseded_generation, event.current_generation
        (1, 2)
        """
        return self.store.iter_fenced(principal, key, since, limit)

    def predict(self, principal: str, key: str, fingerprint: str, *, now: int | None = None) -> Prediction:
        """What a request with this fingerprint would get now, from the
        stored row alone (a read: nothing is claimed). For operators asking
        why a retry keeps getting 409.

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> ledger.operator.predict("acct_1", "k1", "fp").verdict
        <Verdict.NEW: 'new'>
        """
        view = self.get(principal, key, now=now)
        if view is None:
            return Prediction(Verdict.NEW, None)
        if view.state is State.EXPIRED:
            return Prediction(Verdict.NEW, view)  # past retention a row counts as absent
        if view.row.fingerprint != fingerprint:
            return Prediction(Verdict.REUSED, view)
        if view.row.status is Status.COMPLETED:
            return Prediction(Verdict.REPLAY, view)
        if view.state is State.PENDING_FRESH:
            return Prediction(Verdict.IN_PROGRESS, view)
        return Prediction(Verdict.TAKEOVER, view)

    def stats(self, *, now: int | None = None) -> Stats:
        """Rows by derived state, takeovers, fenced-out events, sweep backlog.
        `pending_stale` counts every stale reservation whatever its age;
        `expired` every row past retention (what the sweep deletes), so a
        pending row past retention counts in both, and in `expired_pending`.

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> _ = ledger.claim("acct_1", "k1", "fp")
        >>> stats = ledger.operator.stats()
        >>> stats.total, stats.pending_fresh, stats.expired
        (1, 1, 0)
        """
        now = self.core.now() if now is None else now
        p = self.policy
        return self.store.stats(now, now - p.pending_ttl_ms, now - p.retention_ms)

    def purge(self, principal: str, key: str, *, force: bool = False, now: int | None = None) -> PurgeResult:
        """Delete one reservation so the client's next retry runs the mutation
        again. A fresh pending row is refused unless `force`: its owner may
        still be running.

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> _ = ledger.complete(ledger.claim("acct_1", "k1", "fp"), 201, {}, b"")
        >>> ledger.operator.purge("acct_1", "k1").outcome
        <PurgeOutcome.PURGED: 'purged'>
        """
        now = self.core.now() if now is None else now
        key = parse_key(key) or key
        return self.store.purge(principal, key, None if force else now - self.policy.pending_ttl_ms)

    def count_rows(self) -> int:
        """How many rows the ledger holds (one count: a progress bar's total).

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> _ = ledger.claim("acct_1", "k1", "fp")
        >>> ledger.operator.count_rows()
        1
        """
        return self.store.count_rows()

    def copy_to(
        self,
        destination: HasStore,
        *,
        batch: int = copying.DEFAULT_COPY_BATCH,
        dry_run: bool = False,
        on_progress: Callable[[copying.CopyProgress], object] | None = None,
    ) -> copying.CopyResult:
        """Copy every row (pending and completed, with its generation, token,
        timestamps and stored answer) and the fenced-out log into
        `destination` (a ledger or its operator), on any engine, `batch`
        rows at a time; this ledger is only read. A destination row that is
        newer is kept, one that holds another request under the same key is
        a conflict; neither is overwritten. Running it again writes only
        what changed since. The destination must be initialised
        (`Ledger.init`). See docs/runbook.md for moving a live ledger
        without losing a key.

        >>> from idemctl import Ledger
        >>> old, new = Ledger.open(":memory:"), Ledger.open(":memory:")
        >>> _ = old.init(), new.init()
        >>> _ = old.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b"made"))
        >>> result = old.operator.copy_to(new)
        >>> result.copied, old.operator.copy_to(new.operator).unchanged
        (1, 1)
        >>> new.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (500, {}, b"")).body
        b'made'
        """
        return copying.copy_ledger(self.store, destination.store, batch=batch, dry_run=dry_run, on_progress=on_progress)
