"""The ledger: the Idempotency-Key contract on top of the SQL store.

`Ledger` is the front door apps use; ``ledger.operator`` is the one
operators use. Both are made of parts, one module each, all built on one
`core` (store, policy, clock, events, leases, opening and the schema):
`steps` (one statement each), `requests` (begin, finish, abandon, handle),
`housekeeping` (the post-response sweep, sweep, drain), `operator` (what
operators read and change), `shortcuts` (idempotent functions), `events`
(listeners and the event log), `inputs` (what a principal and a request
line may hold)."""

from __future__ import annotations

import os
from typing import Self

from ..policy import Policy
from ..storage import DEFAULT_FILE_MODE, SqliteOptions, Store
from .core import Clock, LedgerCore, open_store, wall_clock_ms
from .housekeeping import Housekeeping
from .inputs import MAX_PATH_BYTES, MAX_PRINCIPAL_BYTES, check_principal, check_request_line
from .operator import Operator
from .requests import Mutation, RequestFlow, RunResult
from .shortcuts import FunctionShortcuts
from .steps import SingleSteps


class Ledger:
    """An idempotency ledger. Safe to share between threads; each thread (and
    each forked process) gets its own database connection.

    What apps call is here: :meth:`open`, ``init``, ``close`` (or ``with``),
    ``handle``; ``begin``/``finish``/``abandon`` and their ``*_steps`` for
    adapters; ``after_response`` and ``sweep_due``; ``idempotent`` and
    ``idempotent_call``; ``subscribe``; the single steps ``claim``,
    ``lookup``, ``takeover``, ``complete``, ``release``. What operators call
    (reads, purge, sweep, drain, copy) is on :attr:`operator`; the old
    names on the ledger itself (``ledger.stats()``, ...) still work and
    answer the same.

    >>> ledger = Ledger.open(":memory:")  # a file path or a postgresql:// URL
    >>> ledger.init().describe()
    'created (schema version 3)'
    >>> ledger.handle("acct_1", "key-1", "POST", "/orders", {}, b"{}",
    ...               lambda body: (201, {"content-type": "application/json"}, b'{"id":1}')).status
    201
    >>> ledger.operator.stats().completed
    1
    """

    def __init__(self, store: Store, *, policy: Policy | None = None, clock: Clock | str | None = None) -> None:
        #: The state every part shares: store, policy, clock, listeners, leases.
        self.core = core = LedgerCore(store, policy=policy, clock=clock)
        steps = SingleSteps(core)
        flow = RequestFlow(core, steps)
        chores = Housekeeping(core)
        calls = FunctionShortcuts(core, steps, flow, chores)
        #: What operators call: reads, purge, sweep, drain, copy.
        self.operator = operator = Operator(core, chores)
        # The operator's calls under their old names on the ledger: the
        # operator's own methods, so they answer the same.
        self.get, self.view, self.pending, self.fenced = operator.get, operator.view, operator.pending, operator.fenced
        self.predict, self.stats, self.purge = operator.predict, operator.stats, operator.purge
        self.sweep, self.drain, self.copy_to = operator.sweep, operator.drain, operator.copy_to
        self.count_expired, self.count_fenced_expired = operator.count_expired, operator.count_fenced_expired
        self.count_rows = operator.count_rows
        # Fixed at opening: plain attributes, read on every request.
        self.store, self.policy, self.leases = core.store, core.policy, core.leases
        # What apps call is each part's own method, bound once here: a
        # request goes through no layer of the ledger's own.
        self.subscribe, self.publish, self.now = core.subscribe, core.publish, core.now
        self.heard = core.events.heard
        self.async_store, self.aclose, self.close = core.async_store, core.aclose, core.close
        self.init, self.describe = core.init, core.describe
        self.schema_version, self.has_fenced_log, self.require_schema = (
            core.schema_version,
            core.has_fenced_log,
            core.require_schema,
        )
        self.begin_steps, self.begin = flow.begin_steps, flow.begin
        self.finish_steps, self.finish = flow.finish_steps, flow.finish
        self.abandon_steps, self.abandon = flow.abandon_steps, flow.abandon
        self.handle, self.decide, self.refuse, self.shape = flow.handle, flow.decide, flow.refuse, flow.shape
        self.claim, self.lookup, self.takeover = steps.claim, steps.lookup, steps.takeover
        self.complete_steps, self.complete = steps.complete_steps, steps.complete
        self.release_steps, self.release = steps.release_steps, steps.release
        self.sweep_due = chores.sweep_due
        self.after_response_steps, self.after_response = chores.after_response_steps, chores.after_response
        self.idempotent, self.idempotent_call = calls.idempotent, calls.idempotent_call
        self._flow, self._steps, self._chores = flow, steps, chores

    @classmethod
    def open(
        cls,
        target: str | os.PathLike[str],
        *,
        policy: Policy | None = None,
        clock: Clock | str | None = None,
        create: bool = True,
        readonly: bool = False,
        busy_timeout_ms: int = 5000,
        synchronous: str = "FULL",
        write_queue: bool = True,
        file_mode: int = DEFAULT_FILE_MODE,
        group_commit: bool = False,
    ) -> Self:
        """Open a ledger: a SQLite file path, a ``postgresql://`` or a ``mysql://`` URL.

        Opening never creates anything: :meth:`init` creates the schema (and
        a SQLite file, with permission bits ``file_mode``: owner-only 0o600
        by default, 0o660 to share it with the group; SQLite gives its -wal
        and -shm files the same bits). ``create=False`` refuses a missing
        SQLite file at once (LedgerNotFoundError); ``readonly=True`` never
        writes. On SQLite, ``synchronous`` is the PRAGMA of that name and
        ``write_queue=False`` turns off the fair writer queue
        (docs/performance.md); ``group_commit=True`` lets concurrent
        threads of this process share one commit, and so one fsync, each
        returning once the commit holding its own write is durable
        (docs/library.md).

        >>> Ledger.open(":memory:", policy=Policy(pending_ttl_ms=60_000)).policy.retry_after_seconds
        60
        """
        sqlite = SqliteOptions(
            create=create,
            synchronous=synchronous,
            write_queue=write_queue,
            file_mode=file_mode,
            group_commit=group_commit,
        )
        store = open_store(target, readonly=readonly, busy_timeout_ms=busy_timeout_ms, sqlite=sqlite)
        return cls(store, policy=policy, clock=clock)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def clock(self) -> Clock:
        """Milliseconds now, as the ledger reads them (``clock="database"``:
        the database's). Setting it moves every part onto the new clock.

        >>> Ledger.open(":memory:", clock=lambda: 42).clock()
        42
        """
        return self.core.clock

    @clock.setter
    def clock(self, clock: Clock) -> None:
        self.core.clock = clock

    # The operator's methods under their old names are bound in __init__;
    # a property cannot be, so this one reads the operator's.
    @property
    def drain_batch(self) -> int:
        """:attr:`Operator.drain_batch <idemctl.ledger.Operator.drain_batch>`, kept on the ledger.

        >>> Ledger.open(":memory:").drain_batch
        250
        """
        return self.operator.drain_batch


__all__ = [
    "MAX_PATH_BYTES",
    "MAX_PRINCIPAL_BYTES",
    "Clock",
    "Ledger",
    "LedgerCore",
    "Mutation",
    "Operator",
    "RunResult",
    "check_principal",
    "check_request_line",
    "wall_clock_ms",
]
