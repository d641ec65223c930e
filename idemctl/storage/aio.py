"""The store's request path on an asynchronous engine, for one event loop.

No SQL and no operation lives here: every statement is built, and its rows
decoded, by the Store (``Store.claim_or_read_statement``,
``Store.sweep_steps``, ...), and the decision loop and the multi-statement
operations yield them (idemctl/storage/store_base.py: Statement, Turn,
Tables). An AsyncStore only awaits them on an asynchronous engine
(storage/postgres/aio.py's AsyncPostgresEngine): :meth:`AsyncStore.run` is
the awaited twin of :meth:`Store.run`, and nothing else has to match the
Store method for method."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, TypeVar, overload

from .engine import Params, Rows
from .statements import FENCED_TABLE, TABLES, VERSION
from .store import Store
from .store_base import Done, Statement, StoreOp, StoreSteps, Tables, Turn, next_op, reads_version, version_in

R = TypeVar("R")


class AsyncEngine(Protocol):
    """What an AsyncStore needs from an engine: statements, awaited.
    `lands_in_place`: each statement is marked deadlines.ON_THE_WIRE while
    sent, and nothing else in it cancels the task, so a write can be
    awaited in the request's own task (landing.py)."""

    lands_in_place: bool

    def describe(self) -> str: ...

    async def execute(self, sql: str, params: Params) -> Rows:
        """One auto-committed statement; its rows."""

    async def write_turn(self, statements: Sequence[tuple[str, Params]]) -> list[Rows]: ...

    async def table_names(self, names: Iterable[str]) -> set[str]: ...

    async def aclose(self) -> None: ...

    def abandon(self) -> None:
        """Let go of connections whose event loop is gone."""


class AsyncStore:
    """What a Store builds (the claim, lookup, takeover, completion,
    release, fenced-out event, database clock, sweep), awaited on an
    asynchronous engine. It shares the Store's schema knowledge: the guard
    that runs before the first write, and the tables found."""

    def __init__(self, store: Store, engine: AsyncEngine) -> None:
        self.store = store
        self.engine = engine
        self.lands_in_place = engine.lands_in_place
        # Set by aclose and abandon: work still holding this store (a
        # post-response sweep) must not open its connections again.
        self.closed = False

    def describe(self) -> str:
        return self.engine.describe()

    @overload
    async def run(self, op: Statement[R]) -> R: ...
    @overload
    async def run(self, op: Turn) -> list[Rows]: ...
    @overload
    async def run(self, op: Tables) -> frozenset[str]: ...
    async def run(self, op: StoreOp) -> Any:
        """One operation built by the Store, awaited: a Statement's rows
        decoded by the Store, a Turn's rows per statement, the tables found."""
        if type(op) is Statement:
            if op.write and not self.store.schema_checked:  # _guard, without a coroutine per statement
                await self.check_not_newer()
            return op.decode(await self.engine.execute(op.sql, op.params))
        if type(op) is Turn:
            await self._guard()
            return await self.engine.write_turn(op.statements)
        return await self.tables()

    async def run_steps(self, steps: StoreSteps[R]) -> R:
        """A multi-statement operation's steps (`Store.record_fenced_steps`,
        `Store.sweep_steps`, ...), each awaited here: the asynchronous twin
        of `Store.run_steps`."""
        op = next_op(steps)
        while not isinstance(op, Done):
            op = next_op(steps, *(await self._ran(op)))
        return op.value  # type: ignore[no-any-return]

    async def _ran(self, op: StoreOp) -> tuple[Any, Exception | None]:
        try:
            return await self.run(op), None
        except Exception as exc:
            return None, exc

    # -- schema: Store.tables / check_not_newer, awaited -----------------------------
    async def _guard(self) -> None:
        # Once per store (shared with the synchronous path), before the first write.
        if not self.store.schema_checked:
            await self.check_not_newer()

    async def tables(self) -> frozenset[str]:
        known = self.store.known_tables
        if known is not None:
            return known
        return self.store.found_tables(await self.engine.table_names(TABLES))

    async def check_not_newer(self) -> None:
        store = self.store
        store.forget_schema()
        tables = await self.tables()
        rows = await self.engine.execute(store.sql(VERSION), {}) if reads_version(tables) else []
        store.version_checked(version_in(tables, rows))

    async def has_fenced_log(self) -> bool:
        return FENCED_TABLE in await self.tables()

    async def aclose(self) -> None:
        self.closed = True
        await self.engine.aclose()

    def abandon(self) -> None:
        self.closed = True
        self.engine.abandon()


__all__ = ["AsyncEngine", "AsyncStore"]
