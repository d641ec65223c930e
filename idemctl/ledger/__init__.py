"""The ledger: the Idempotency-Key contract on top of the SQL store.

`Ledger` is the front door apps use; ``ledger.operator`` is the one
operators use. Both are made of parts, one module each, all built on one
`core` (store, policy, clock, events, leases, opening and the schema):
`steps` (one statement each) and `requests` (begin, finish, abandon,
handle), which `Ledger` is built on, so their methods are its own;
`housekeeping` (the post-response sweep, sweep, drain), `operator` (what
operators read and change), `events` (listeners and the event log),
`inputs` (what a principal and a request line may hold); `deprecated`
holds the operator's old names on the ledger."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Self

from .. import decision, functions
from ..call_values import SerializerLike
from ..outcomes import Answer, Event, InitResult, Outcome, SweepResult
from ..policy import DEFAULT_BUSY_TIMEOUT_MS, Policy
from ..storage import DEFAULT_FILE_MODE, SqliteOptions, Store, open_store
from ..storage.aio import AsyncStore
from .core import Clock, LedgerCore, wall_clock_ms
from .deprecated import operator_alias, warn_once
from .housekeeping import Housekeeping
from .inputs import MAX_PATH_BYTES, MAX_PRINCIPAL_BYTES, check_principal, check_request_line
from .operator import Operator
from .requests import Mutation, RequestFlow, RunResult

# What apps call that is the core's or the housekeeping's own method:
# `Ledger.__init__` binds each on the instance under its name (the request
# flow's and the single steps' are the ledger's own, by inheritance).
CORE_NAMES = (
    "subscribe",
    "publish",
    "now",
    "async_store",
    "aclose",
    "close",
    "init",
    "describe",
    "schema_version",
    "has_fenced_log",
    "require_schema",
)
CHORE_NAMES = ("sweep_due", "after_response_steps", "after_response")


class Ledger(RequestFlow):
    """An idempotency ledger. Safe to share between threads; each thread (and
    each forked process) gets its own database connection.

    What apps call is here: :meth:`open`, :meth:`init`, :meth:`close` (or
    ``with``), :meth:`handle`; :meth:`begin`/:meth:`finish`/:meth:`abandon`
    and their ``*_steps`` for adapters; :meth:`after_response` and
    :meth:`sweep_due`; :meth:`idempotent` and :meth:`idempotent_call`;
    :meth:`subscribe`; the single steps :meth:`claim`, :meth:`lookup`,
    :meth:`takeover`, :meth:`complete`, :meth:`release`. What operators
    call (reads, purge, sweep, drain, copy) is on :attr:`operator`; the
    old names on the ledger itself (``ledger.stats()``, ...) are
    deprecated: they warn once per name per process and answer the same.

    >>> ledger = Ledger.open(":memory:")  # a file path, a postgresql:// or a mysql:// URL
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
        core = LedgerCore(store, policy=policy, clock=clock)
        super().__init__(core)
        chores = Housekeeping(core)
        #: What operators call: reads, purge, sweep, drain, copy.
        self.operator = Operator(core, chores)
        self.leases = core.leases
        # The core's and the housekeeping's methods, bound once here on the
        # instance, where each shadows the class's method of the same name
        # (a function, so the instance's attribute wins): a call goes
        # through no layer of the ledger's own, and the class's methods
        # below are what help(), documentation generators and type checkers read.
        own = vars(self)
        for part, names in ((core, CORE_NAMES), (chores, CHORE_NAMES)):
            for name in names:
                own[name] = getattr(part, name)
        own["heard"] = core.events.heard

    @classmethod
    def open(
        cls,
        target: str | os.PathLike[str],
        *,
        policy: Policy | None = None,
        clock: Clock | str | None = None,
        create: bool = True,
        readonly: bool = False,
        busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
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

    # -- what apps call of the core and the housekeeping ------------------------
    # Shadowed on every instance by the part's own method that __init__
    # binds under the same name: a body here calls that, and runs only when
    # reached through the class (``Ledger.init(ledger)``).

    def init(self, *, dry_run: bool = False) -> InitResult:
        """Create or upgrade the schema; safe to run any number of times.

        >>> ledger = Ledger.open(":memory:")
        >>> ledger.init().describe(), ledger.init().describe()
        ('created (schema version 3)', 'already up to date (schema version 3)')
        """
        return self.init(dry_run=dry_run)

    def close(self) -> None:
        """Close the ledger's connections (and stop renewing its leases); ``with`` calls it.

        >>> with Ledger.open(":memory:") as ledger:
        ...     _ = ledger.init()
        >>> ledger.close()  # closing twice is harmless
        """
        return self.close()

    def describe(self) -> str:
        """Where the ledger lives, safe to print (a URL without its password).

        >>> Ledger.open(":memory:").describe()
        ':memory:'
        """
        return self.describe()

    def schema_version(self) -> int | None:
        """None: no ledger; 0: the recipe's table only; N: idemctl schema N.

        >>> ledger = Ledger.open(":memory:")
        >>> ledger.schema_version(), ledger.init().to_version, ledger.schema_version()
        (None, 3, 3)
        """
        return self.schema_version()

    def has_fenced_log(self) -> bool:
        """Whether the ledger records fenced-out events (a ledger with only
        the recipe's table does not, until :meth:`init` upgrades it).

        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> ledger.has_fenced_log()
        True
        """
        return self.has_fenced_log()

    def require_schema(self) -> None:
        """Raise SchemaMissingError unless the ledger's tables exist (they
        may be the recipe's alone): for tools that must never create one.

        >>> Ledger.open(":memory:").require_schema()
        Traceback (most recent call last):
        ...
        idemctl.errors.SchemaMissingError: :memory: has no idempotency ledger (ledger.init() creates it)
        """
        return self.require_schema()

    def now(self) -> int:
        """Milliseconds now, by the ledger's :attr:`clock`.

        >>> Ledger.open(":memory:", clock=lambda: 7).now()
        7
        """
        return self.now()

    def subscribe(self, listener: Callable[[Event], object]) -> Callable[[], None]:
        """Call `listener(event)` for every decision; returns the function that
        unsubscribes it. A listener that raises is logged and never fails a
        request. Listeners run in the request's thread: keep them quick.

        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> seen = []
        >>> stop = ledger.subscribe(seen.append)
        >>> _ = ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b""))
        >>> _ = ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b""))
        >>> [e.outcome.value for e in seen]
        ['executed', 'replayed']
        >>> stop()
        """
        return self.subscribe(listener)

    def publish(self, event: Event) -> None:
        """Deliver an event to the listeners and the `idemctl.events` log: for
        integrations that decide outside `begin`/`finish` (idempotent
        functions use it). Never raises because of a listener.

        >>> ledger = Ledger.open(":memory:"); seen = []; _ = ledger.subscribe(seen.append)
        >>> ledger.publish(Event(Outcome.EXECUTED, "acct_1", "k1", 1, "CALL", "charge", 200, 0.5, None, 7))
        >>> [(e.outcome.value, e.key) for e in seen]
        [('executed', 'k1')]
        """
        return self.publish(event)

    def heard(self, outcome: Outcome) -> bool:
        """Whether an event of this outcome reaches anyone: a listener, or
        the `idemctl.events` log. When not, no Event is built at all.

        >>> ledger = Ledger.open(":memory:")
        >>> stop = ledger.subscribe(print); ledger.heard(Outcome.EXECUTED)
        True
        """
        return self.heard(outcome)

    def async_store(self) -> AsyncStore | None:
        """The asynchronous request path for the running event loop, opened
        on first use: on PostgreSQL, psycopg's asynchronous connections in
        a pool of this loop's own, running the same statements as the
        synchronous path (the ASGI middleware, the FastAPI route class and
        async idempotent functions use it). None on SQLite, whose driver
        has no asynchronous I/O: there they run in worker threads. Close it
        with :meth:`aclose` (say in the app's lifespan shutdown).

        >>> import asyncio
        >>> async def on_a_loop(ledger):
        ...     return ledger.async_store()
        >>> asyncio.run(on_a_loop(Ledger.open(":memory:"))) is None
        True
        """
        return self.async_store()

    async def aclose(self) -> None:
        """Close the running event loop's asynchronous connections (see
        :meth:`async_store`), once the releases that cancelled requests left
        running on this loop have finished (up to 5 s); the next request on
        this loop opens them again.

        >>> import asyncio
        >>> asyncio.run(Ledger.open(":memory:").aclose()) is None
        True
        """
        return await self.aclose()

    def sweep_due(self, answer: Answer) -> bool:
        """Whether `after_response(answer)` would run a statement: only for
        answers that ran the mutation, and not while the last probe showed
        nothing can expire yet. No I/O, so an async adapter can skip the
        hand-off to a thread.

        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> first = ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b""))
        >>> ledger.sweep_due(first), ledger.after_response(first).quiet_for_ms > 0, ledger.sweep_due(first)
        (True, True, False)
        """
        return self.sweep_due(answer)

    def after_response_steps(self, answer: Answer) -> decision.Steps[SweepResult | None]:
        """:meth:`after_response` as steps, for a driver that does its I/O
        its own way (see :meth:`begin_steps`).

        >>> ledger = Ledger.open(":memory:", clock=lambda: 1_700_000_000_000); _ = ledger.init()
        >>> answer = ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b""))
        >>> decision.run(ledger.after_response_steps(answer)).deleted
        0
        """
        return self.after_response_steps(answer)

    def after_response(self, answer: Answer) -> SweepResult | None:
        """The post-response housekeeping of SPEC §4.9: one bounded sweep batch
        at the request's own `now`. Call it after the answer has been sent.
        It never raises: a failed sweep is logged and retried by the next request.

        >>> ledger = Ledger.open(":memory:", clock=lambda: 1_700_000_000_000); _ = ledger.init()
        >>> answer = ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b""))
        >>> ledger.after_response(answer).deleted
        0
        """
        return self.after_response(answer)

    def idempotent(
        self,
        *,
        key: functions.KeySource,
        principal: functions.PrincipalSource,
        args: functions.ArgsSelector | None = None,
        name: str | None = None,
        serializer: SerializerLike | None = None,
        release_on_error: functions.ReleasePolicy = False,
    ) -> functions.IdempotentDecorator:
        """Decorator: run a function (plain or ``async def``) once per
        (principal, key) and store its return value (JSON by default). A
        repeat with the same arguments gets the stored value without running;
        other arguments raise KeyReusedError; a duplicate while the first
        runs raises CallInProgressError (``retry_after``). `key` and
        `principal` are strings or callables of the function's arguments;
        `args` chooses the arguments the fingerprint covers (all by default).
        `serializer` stores a value JSON cannot hold: a ``(dump, load)``
        pair of functions to and from JSON values (or a Powertools output
        serializer), or an object with ``dumps``/``loads`` of bytes; the
        first caller and every repeat get ``load``'s value. See
        docs/workers.md.

        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> runs = []
        >>> @ledger.idempotent(key=lambda payment: payment["id"], principal="billing")
        ... def charge(payment):
        ...     runs.append(payment["id"])
        ...     return {"charged": payment["amount"]}
        >>> charge({"id": "pay_1", "amount": 500}), charge({"id": "pay_1", "amount": 500}), runs
        ({'charged': 500}, {'charged': 500}, ['pay_1'])
        >>> charge({"id": "pay_1", "amount": 900})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        idemctl.errors.KeyReusedError: key 'pay_1' of principal 'billing' was used for a call with other arguments; ...

        A dataclass comes back as the dataclass through the pair it already has:

        >>> from dataclasses import asdict, dataclass
        >>> from decimal import Decimal
        >>> @dataclass
        ... class Receipt:
        ...     payment_id: str
        ...     amount: str
        >>> @ledger.idempotent(key=lambda payment_id, amount: payment_id, principal="billing",
        ...                    serializer=(asdict, lambda d: Receipt(**d)))
        ... def settle(payment_id, amount):
        ...     return Receipt(payment_id, str(Decimal(amount)))
        >>> settle("pay_2", "12.50"), settle("pay_2", "12.50")
        (Receipt(payment_id='pay_2', amount='12.50'), Receipt(payment_id='pay_2', amount='12.50'))
        """
        settings = functions.CallSettings(name, serializer, release_on_error)
        return functions.IdempotentDecorator(self, key=key, principal=principal, args=args, settings=settings)

    def idempotent_call(
        self,
        *,
        principal: str,
        key: str,
        args: object,
        name: str | None = None,
        serializer: SerializerLike | None = None,
        release_on_error: functions.ReleasePolicy = False,
    ) -> functions.IdempotentCall:
        """One idempotent call as a context manager (``with`` or ``async
        with``), for code that is not one function: `args` is the JSON value
        the fingerprint covers. Skip the work when ``call.replayed``; hand the
        result to ``call.store()``; after the block ``call.value`` is what
        every repeat returns.

        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> for attempt in (1, 2):
        ...     with ledger.idempotent_call(principal="billing", key="pay_1", args={"amount": 500}) as call:
        ...         if not call.replayed:
        ...             call.store({"charged": 500})
        ...     print(attempt, call.outcome.value, call.value)
        1 executed {'charged': 500}
        2 replayed {'charged': 500}
        """
        settings = functions.CallSettings(name, serializer, release_on_error)
        return functions.IdempotentCall(self, principal=principal, key=key, args=args, settings=settings)

    # -- the operator's methods under their old names: deprecated ------------------
    get = operator_alias(Operator.get)
    view = operator_alias(Operator.view)
    pending = operator_alias(Operator.pending)
    fenced = operator_alias(Operator.fenced)
    predict = operator_alias(Operator.predict)
    stats = operator_alias(Operator.stats)
    purge = operator_alias(Operator.purge)
    copy_to = operator_alias(Operator.copy_to)
    count_rows = operator_alias(Operator.count_rows)
    # The operator's own are its housekeeping's methods.
    sweep = operator_alias(Housekeeping.sweep)
    drain = operator_alias(Housekeeping.drain)
    count_expired = operator_alias(Housekeeping.count_expired)
    count_fenced_expired = operator_alias(Housekeeping.count_fenced_expired)

    @property
    def drain_batch(self) -> int:
        """Deprecated: read ``ledger.operator.drain_batch``, which this reads.
        The first read in a process emits a DeprecationWarning (once per
        process), and every read answers the same.

        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore", DeprecationWarning)
        ...     Ledger.open(":memory:").drain_batch
        250
        """
        warn_once("drain_batch")
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
