"""The store's request path on an asynchronous engine, for one event loop.

No SQL lives here: every statement is built, and its rows decoded, by the
same Store methods the synchronous path uses (``Store.claim_statement``,
``Store.sweep_steps``, ...); an AsyncStore only awaits them on an
asynchronous engine (storage/postgres/aio.py's AsyncPostgresEngine). Its methods
carry the names of the Store's, so that the decision loop's operations
(:class:`idemctl.decision.Call`) run on either."""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from ..outcomes import FencedEvent, StoredRow, SweepResult
from .engine import Params, Rows
from .statements import FENCED_TABLE, TABLES, VERSION
from .store import Store
from .store_base import Statement, Turn, reads_version, resume, version_in

R = TypeVar("R")
P = ParamSpec("P")


def awaits(
    build: Callable[Concatenate[Store, P], Statement[R]],
) -> Callable[Concatenate[AsyncStore, P], Coroutine[Any, Any, R]]:
    """The awaited request-path step that runs the Statement the Store's
    `build` makes (the asynchronous twin of store.runs)."""

    async def step(self: AsyncStore, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await self.run(build(self.store, *args, **kwargs))

    step.__doc__ = build.__doc__
    return step


class AsyncEngine(Protocol):
    """What an AsyncStore needs from an engine: statements, awaited."""

    def describe(self) -> str: ...

    async def execute(self, sql: str, params: Params) -> Rows:
        """One auto-committed statement; its rows."""

    async def write_turn(self, statements: Sequence[tuple[str, Params]]) -> list[Rows]: ...

    async def table_names(self, names: Iterable[str]) -> set[str]: ...

    async def aclose(self) -> None: ...

    def abandon(self) -> None:
        """Let go of connections whose event loop is gone."""


class AsyncStore:
    """A Store's request path (claim, lookup, takeover, complete, release,
    the fenced-out event, the database clock, the sweep) awaited on an
    asynchronous engine. It shares the Store's schema knowledge: the guard
    that runs before the first write, and the tables found."""

    def __init__(self, store: Store, engine: AsyncEngine) -> None:
        self.store = store
        self.engine = engine

    def describe(self) -> str:
        return self.engine.describe()

    async def run(self, statement: Statement[R]) -> R:
        """A Statement built by the Store, awaited, its rows decoded by the Store."""
        if statement.write:
            await self._guard()
        return statement.decode(await self.engine.execute(statement.sql, statement.params))

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

    # -- the request path: the Store's statements ----------------------------------
    claim = awaits(Store.claim_statement)

    async def claim_or_read(
        self, principal: str, key: str, fingerprint: str, token: int, now: int
    ) -> int | StoredRow | None:
        """Store.claim_or_read, awaited."""
        store = self.store
        if store.dialect.claim_reads_row:
            return await self.run(store.claim_or_read_statement(principal, key, fingerprint, token, now))
        return await self.claim(principal, key, fingerprint, token, now)

    lookup = awaits(Store.lookup_statement)
    takeover = awaits(Store.takeover_statement)
    complete = awaits(Store.complete_statement)
    completed_as = awaits(Store.completed_as_statement)
    release = awaits(Store.release_statement)
    database_now = awaits(Store.database_now_statement)

    async def record_fenced(
        self, principal: str, key: str, generation: int, computed_status: int, now: int
    ) -> FencedEvent | None:
        if not await self.has_fenced_log():
            return None
        return await self.run(self.store.record_fenced_statement(principal, key, generation, computed_status, now))

    async def sweep(self, now: int, cutoff: int, fenced_cutoff: int, limit: int) -> SweepResult:
        """Store.sweep's steps, each awaited (see Store.sweep_steps)."""
        await self._guard()
        steps = self.store.sweep_steps(now, cutoff, fenced_cutoff, limit, await self.has_fenced_log())
        step = resume(steps, None)
        engine = self.engine
        while not isinstance(step, SweepResult):
            if isinstance(step, Turn):
                step = resume(steps, await engine.write_turn(step.statements))
            else:
                step = resume(steps, await engine.execute(step.sql, step.params))
        return step

    async def aclose(self) -> None:
        await self.engine.aclose()

    def abandon(self) -> None:
        self.engine.abandon()


__all__ = ["AsyncEngine", "AsyncStore"]
