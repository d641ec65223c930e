"""The store's request path on an asynchronous engine, for one event loop.

No SQL lives here: every statement is built, and its rows decoded, by the
same Store methods the synchronous path uses (``Store.claim_statement``,
``Store.sweep_steps``, ...); an AsyncStore only awaits them on an
asynchronous engine (storage/postgres.py's AsyncPostgresEngine). Its methods
carry the names of the Store's, so that the decision loop's operations
(:class:`idemctl.decision.Call`) run on either."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, TypeVar

from ..errors import SchemaTooNewError
from ..outcomes import FencedEvent, StoredRow, SweepResult
from ..schema import SCHEMA_VERSION
from .engine import Params, Rows
from .store import FENCED_TABLE, LEDGER_TABLE, TABLES, VERSION, VERSION_TABLE, Statement, Store, Turn, _version

R = TypeVar("R")


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
        if not self.store._checked:
            await self.check_not_newer()

    async def tables(self) -> frozenset[str]:
        store = self.store
        if store._tables is not None:
            return store._tables
        found = frozenset(await self.engine.table_names(TABLES))
        if len(found) == len(TABLES):
            store._tables = found
        return found

    async def check_not_newer(self) -> None:
        self.store.forget_schema()
        tables = await self.tables()
        version: int | None
        if LEDGER_TABLE not in tables:
            version = None
        elif VERSION_TABLE not in tables:
            version = 0
        else:
            version = _version(await self.engine.execute(self.store.sql(VERSION), {}))
        if version is not None and version > SCHEMA_VERSION:
            raise SchemaTooNewError(self.describe(), version, SCHEMA_VERSION)
        self.store._checked = version is not None

    async def has_fenced_log(self) -> bool:
        return FENCED_TABLE in await self.tables()

    # -- the request path: the Store's statements ----------------------------------
    async def claim(self, principal: str, key: str, fingerprint: str, token: int, now: int) -> int | None:
        return await self.run(self.store.claim_statement(principal, key, fingerprint, token, now))

    async def lookup(self, principal: str, key: str) -> StoredRow | None:
        return await self.run(self.store.lookup_statement(principal, key))

    async def takeover(
        self, principal: str, key: str, fingerprint: str, token: int, now: int, stale_before: int, expired_before: int
    ) -> int | None:
        statement = self.store.takeover_statement(principal, key, fingerprint, token, now, stale_before, expired_before)
        return await self.run(statement)

    async def complete(
        self,
        principal: str,
        key: str,
        generation: int,
        token: int | None,
        status: int,
        body: str | bytes | None,
        headers_json: str,
        now: int,
    ) -> bool:
        statement = self.store.complete_statement(principal, key, generation, token, status, body, headers_json, now)
        return await self.run(statement)

    async def release(self, principal: str, key: str, generation: int, token: int | None) -> bool:
        return await self.run(self.store.release_statement(principal, key, generation, token))

    async def record_fenced(
        self, principal: str, key: str, generation: int, computed_status: int, now: int
    ) -> FencedEvent | None:
        if not await self.has_fenced_log():
            return None
        return await self.run(self.store.record_fenced_statement(principal, key, generation, computed_status, now))

    async def database_now(self) -> int:
        return await self.run(self.store.database_now_statement())

    async def sweep(self, now: int, cutoff: int, fenced_cutoff: int, limit: int) -> SweepResult:
        """Store.sweep's steps, each awaited (see Store.sweep_steps)."""
        await self._guard()
        steps = self.store.sweep_steps(now, cutoff, fenced_cutoff, limit, await self.has_fenced_log())
        sent: Any = None
        while True:
            try:
                step = steps.send(sent)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            if isinstance(step, Turn):
                sent = await self.engine.write_turn(step.statements)
            else:
                sent = await self.engine.execute(step.sql, step.params)

    async def aclose(self) -> None:
        await self.engine.aclose()

    def abandon(self) -> None:
        self.engine.abandon()


__all__ = ["AsyncEngine", "AsyncStore"]
