"""The ledger's core: the state every job of the ledger shares (its store,
policy, clock, listeners, live reservations and asynchronous stores), and
opening, closing and the schema. The ledger (its request flow),
housekeeping and the operator's side are built on one core (see
`idemctl.ledger`)."""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import Callable

from .. import decision, storage
from ..errors import PolicyError, SchemaMissingError
from ..leases import LeaseKeeper
from ..outcomes import Event, InitResult, Reservation
from ..policy import Policy
from ..storage import Store
from ..storage.aio import AsyncStore
from .events import EventHub

Clock = Callable[[], int]


def wall_clock_ms() -> int:
    """Milliseconds since the epoch, the unit of every timestamp in the ledger.

    >>> wall_clock_ms() > 1_700_000_000_000
    True
    """
    return time.time_ns() // 1_000_000


class LedgerCore:
    """The state one ledger's parts share: its store, policy, clock,
    listeners, live reservations and asynchronous stores. Every job object
    of :class:`~idemctl.Ledger` (request flow, housekeeping, operator) is
    built on one core; `store` and `policy` never change after opening.

    >>> core = LedgerCore(storage.open_store(":memory:"), clock=lambda: 7)
    >>> core.now(), core.init().describe(), core.describe()
    (7, 'created (schema version 3)', ':memory:')
    """

    def __init__(self, store: Store, *, policy: Policy | None = None, clock: Clock | str | None = None) -> None:
        self.store = store
        self.policy = policy if policy is not None else Policy()
        # An engine whose rows expire on their own sets their expiry from it.
        store.keep_rows_for(self.policy.retention_ms)
        if clock == "database":
            # Every host sharing the ledger asks the database what time it is,
            # so skewed host clocks still agree on TTL, takeover and sweep.
            self.clock: Clock = store.database_now
        elif isinstance(clock, str):
            raise PolicyError(f"clock must be a callable or 'database', got {clock!r}")
        else:
            self.clock = clock if clock is not None else wall_clock_ms
        #: This process's live reservations, renewed together (Policy.lease_renewal), or None.
        self.leases: LeaseKeeper | None = None
        if self.policy.lease_renewal:
            self.leases = LeaseKeeper(
                self.renew,
                interval_s=self.policy.pending_ttl_ms / 3000,
                max_s=self.policy.lease_max_ms / 1000,
                ttl_s=self.policy.pending_ttl_ms / 1000,
            )
        #: The listeners, and the `idemctl.events` log line of each event.
        self.events = EventHub()
        # The asynchronous request path, one store per event loop (see async_store),
        # opened by the engine's own asynchronous engine where its kind has one.
        self._open_async = storage.async_opener(store.engine)
        self._async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncStore] = weakref.WeakKeyDictionary()
        self._async_lock = threading.Lock()

    # -- events -------------------------------------------------------------------------
    def subscribe(self, listener: Callable[[Event], object]) -> Callable[[], None]:
        """Call `listener(event)` for every decision: see :meth:`idemctl.Ledger.subscribe`."""
        return self.events.subscribe(listener)

    def publish(self, event: Event) -> None:
        """Deliver an event to the listeners and the `idemctl.events` log: see :meth:`idemctl.Ledger.publish`."""
        self.events.emit(event)

    def close(self) -> None:
        if self.leases is not None:
            self.leases.close()
        with self._async_lock:
            stores = list(self._async.items())
            self._async.clear()
        for loop, store in stores:
            if loop.is_closed() or not loop.is_running():
                store.abandon()
            else:  # its loop runs in another thread: close it there, the asynchronous way
                asyncio.run_coroutine_threadsafe(store.aclose(), loop)
        self.store.close()

    def renew(self, held: list[Reservation]) -> int:
        return self.store.renew([(r.principal, r.key, r.generation, r.token) for r in held], self.now())

    def hold(self, made: decision.Decision) -> decision.Decision:
        if self.leases is not None and isinstance(made, decision.Claimed):
            self.leases.hold(made.reservation)
        return made

    def drop(self, reservation: Reservation | None) -> None:
        if self.leases is not None and reservation is not None:
            self.leases.drop(reservation)

    def async_store(self) -> AsyncStore | None:
        """The asynchronous request path for the running event loop: see :meth:`idemctl.Ledger.async_store`."""
        open_async = self._open_async
        if open_async is None:
            return None
        loop = asyncio.get_running_loop()
        store = self._async.get(loop)
        if store is not None:
            return store
        with self._async_lock:
            store = self._async.get(loop)
            if store is None:
                # Pools of loops that have ended cannot be closed by them any more.
                for gone in [other for other in self._async if other.is_closed()]:
                    self._async.pop(gone).abandon()
                store = self._async[loop] = AsyncStore(self.store, open_async())
            return store

    async def aclose(self) -> None:
        """Close the running event loop's asynchronous connections: see :meth:`idemctl.Ledger.aclose`."""
        await decision.settle_orphans()
        with self._async_lock:
            store = self._async.pop(asyncio.get_running_loop(), None)
        if store is not None:
            await store.aclose()

    def describe(self) -> str:
        """Where the ledger lives, safe to print: see :meth:`idemctl.Ledger.describe`."""
        return self.store.describe()

    def now(self) -> int:
        return int(self.clock())

    def now_steps(self) -> decision.Steps[int]:
        return (yield from decision.now_steps(self.store, self.clock))

    # -- schema ---------------------------------------------------------------------
    def init(self, *, dry_run: bool = False) -> InitResult:
        """Create or upgrade the schema: see :meth:`idemctl.Ledger.init`."""
        return self.store.init(self.now(), dry_run)

    def schema_version(self) -> int | None:
        """None: no ledger; 0: the recipe's table only; N: idemctl schema N:
        see :meth:`idemctl.Ledger.schema_version`."""
        return self.store.schema_version()

    def has_fenced_log(self) -> bool:
        """Whether the ledger records fenced-out events: see :meth:`idemctl.Ledger.has_fenced_log`."""
        return self.store.has_fenced_log()

    def require_schema(self) -> None:
        """Raise SchemaMissingError unless the ledger's tables exist: see :meth:`idemctl.Ledger.require_schema`."""
        if self.schema_version() is None:
            raise SchemaMissingError(self.describe())
