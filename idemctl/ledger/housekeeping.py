"""Keeping the ledger small: the post-response sweep and its throttle, the
bounded sweep, the drain and retention checks. Apps run the post-response
sweep (`Ledger.after_response`); operators the sweep and the drain
(`Ledger.operator`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from .. import decision
from ..errors import IdemctlError, PolicyError
from ..outcomes import Answer, Drained, DrainStop, Outcome, SweepResult
from .core import LedgerCore

log = logging.getLogger("idemctl")

# Requests that ran the mutation sweep one batch after their answer.
_SWEEPS_AFTER = frozenset({Outcome.EXECUTED, Outcome.TAKEN_OVER, Outcome.FENCED_OUT})


class Housekeeping:
    """The sweeps of one ledger's core, and the post-response sweep's
    throttle: until when this process has nothing to sweep.

    >>> from idemctl import Ledger
    >>> ledger = Ledger.open(":memory:", clock=lambda: 0); _ = ledger.init()
    >>> Housekeeping(ledger.core).sweep().deleted
    0
    """

    def __init__(self, core: LedgerCore) -> None:
        self.core = core
        self.store, self.policy = core.store, core.policy
        # Until when this process's post-response sweep has nothing to do.
        self._sweep_rests_until = 0

    def sweep_due(self, answer: Answer) -> bool:
        """Whether `after_response(answer)` would run a statement: see :meth:`idemctl.Ledger.sweep_due`."""
        now = answer.started_at
        return now is not None and answer.outcome in _SWEEPS_AFTER and now >= self._sweep_rests_until

    def after_response_steps(self, answer: Answer) -> decision.Steps[SweepResult | None]:
        """The post-response sweep, as steps: see :meth:`idemctl.Ledger.after_response_steps`."""
        now = answer.started_at
        if now is None or answer.outcome not in _SWEEPS_AFTER:
            return None
        if now < self._sweep_rests_until:
            # The last probe showed nothing can expire before then: no statement at all.
            return SweepResult(0, 0, now - self.policy.retention_ms, now - self.policy.fenced_retention_ms, 0)
        try:
            result = yield from self.store.sweep_steps(*self._sweep_args(now, None, None, None))
        except IdemctlError as exc:
            log.warning("post-response sweep failed: %s", exc)
            return None
        if result.quiet_for_ms:
            self._sweep_rests_until = now + result.quiet_for_ms
        return result

    after_response = decision.blocking(after_response_steps)

    def sweep(
        self,
        *,
        now: int | None = None,
        batch: int | None = None,
        retention_ms: int | None = None,
        fenced_retention_ms: int | None = None,
    ) -> SweepResult:
        """Delete at most `batch` rows older than the retention and `batch`
        fenced-out events older than the fenced-out log's own retention: one
        bounded statement per table.

        >>> from idemctl import Ledger
        >>> t = [0]; ledger = Ledger.open(":memory:", clock=lambda: t[0]); _ = ledger.init()
        >>> for i in range(3): _ = ledger.claim("acct_1", f"k{i}", "fp")
        >>> t[0] += ledger.policy.retention_ms + 1
        >>> ledger.operator.sweep(batch=2).keys_deleted, ledger.operator.sweep(batch=2).keys_deleted
        (2, 1)
        """
        now = self.core.now() if now is None else now
        return self.store.sweep(*self._sweep_args(now, batch, retention_ms, fenced_retention_ms))

    def _sweep_args(
        self, now: int, batch: int | None, retention_ms: int | None, fenced_retention_ms: int | None
    ) -> tuple[int, int, int, int]:
        batch = self.policy.sweep_batch if batch is None else batch
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise PolicyError(f"sweep batch must be >= 1, got {batch}")
        cutoff = now - self._retention(retention_ms)
        return now, cutoff, now - self._fenced_retention(fenced_retention_ms), batch

    def drain(
        self,
        *,
        batch: int | None = None,
        max_batches: int | None = None,
        retention_ms: int | None = None,
        fenced_retention_ms: int | None = None,
        pause_ms: int = 0,
        should_stop: Callable[[], bool] = lambda: False,
        on_batch: Callable[[SweepResult], None] | None = None,
    ) -> Drained:
        """Sweep batch after batch until one deletes nothing, `max_batches`
        have run, or `should_stop()` is true between two batches. Each batch
        is one bounded statement per table (:meth:`sweep`); ``pause_ms``
        leaves the write lock to the request path between them. The default
        batch is the engine's :attr:`drain_batch`.

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:", clock=lambda: 0); _ = ledger.init()
        >>> ledger.operator.drain(retention_ms=60_000)
        Drained(keys_deleted=0, fenced_deleted=0, batches=1, stopped=<DrainStop.DRAINED: 'drained'>)
        """
        size = self.drain_batch if batch is None else batch
        keys = fenced = batches = 0
        while True:
            if should_stop():
                return Drained(keys, fenced, batches, DrainStop.INTERRUPTED)
            if max_batches is not None and batches >= max_batches:
                return Drained(keys, fenced, batches, DrainStop.MAX_BATCHES)
            result = self.sweep(batch=size, retention_ms=retention_ms, fenced_retention_ms=fenced_retention_ms)
            batches += 1
            keys += result.keys_deleted
            fenced += result.fenced_deleted
            if on_batch is not None:
                on_batch(result)
            if result.deleted == 0:
                return Drained(keys, fenced, batches, DrainStop.DRAINED)
            deadline = time.monotonic() + pause_ms / 1000
            while pause_ms and not should_stop() and time.monotonic() < deadline:
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    @property
    def drain_batch(self) -> int:
        """The batch size this storage engine drains a backlog with (the
        CLI's `sweep` default): 250 on SQLite, where each batch holds the
        database-wide write lock that claims wait for; 5000 on PostgreSQL,
        where it locks only the expired rows it deletes.

        >>> from idemctl import Ledger
        >>> Ledger.open(":memory:").operator.drain_batch
        250
        """
        return self.store.drain_batch

    def _retention(self, retention_ms: int | None) -> int:
        if retention_ms is None:
            return self.policy.retention_ms
        if retention_ms <= self.policy.pending_ttl_ms:
            # Sweeping a live reservation would let a retry run the mutation again.
            raise PolicyError(
                f"retention ({retention_ms} ms) must be longer than the pending TTL ({self.policy.pending_ttl_ms} ms)"
            )
        return retention_ms

    def _fenced_retention(self, fenced_retention_ms: int | None) -> int:
        if fenced_retention_ms is None:
            return self.policy.fenced_retention_ms
        if fenced_retention_ms <= 0:
            raise PolicyError(f"fenced-out log retention must be > 0 ms, got {fenced_retention_ms}")
        return fenced_retention_ms

    def count_expired(self, *, now: int | None = None, retention_ms: int | None = None) -> int:
        """How many rows a full sweep would delete now."""
        now = self.core.now() if now is None else now
        return self.store.count_expired(now - self._retention(retention_ms))

    def count_fenced_expired(self, *, now: int | None = None, fenced_retention_ms: int | None = None) -> int:
        """How many fenced-out events a full sweep would delete now."""
        now = self.core.now() if now is None else now
        return self.store.count_fenced_expired(now - self._fenced_retention(fenced_retention_ms))
