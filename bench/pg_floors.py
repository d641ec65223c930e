"""The raw floors of PostgreSQL's asynchronous request path: idemctl's own
statements on psycopg's AsyncConnection and on asyncpg, with nothing
around them (bench/inflight.py's rounds, bench/pg_instructions.py's counts)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any, Protocol

from .common import FINGERPRINT, RESPONSE_HEADERS_JSON, STORED_1K
from .peers_systems import PRINCIPAL

DRIVERS = ("psycopg", "asyncpg")


class FloorPath(Protocol):
    """One request of a floor: `tag` (the round's, positional or by name)
    keeps its first calls' keys apart."""

    def __call__(self, i: int, tag: str) -> Awaitable[None]: ...


class Floors:
    """idemctl's own statements, raw, on each driver: a first call is the
    claim and the fenced completion, a replay the claim that finds the key
    taken and reads its row. psycopg's AsyncConnection comes from an
    AsyncConnectionPool; asyncpg's connections from a LIFO queue (the
    cheapest checkout there is), each statement prepared once per
    connection by asyncpg's own cache."""

    def __init__(self, url: str, asyncpg_url: str, size: int, seeds: int) -> None:
        from idemctl.storage.dialect import POSTGRES
        from idemctl.storage.postgres.asyncpg_engine import positional
        from idemctl.storage.statements import CLAIM, CLAIM_OR_READ, COMPLETE

        self.url, self.asyncpg_url, self.size, self.seeds = url, asyncpg_url, size, seeds
        self.claim, self.complete, self.claim_or_read = (POSTGRES.params(s) for s in (CLAIM, COMPLETE, CLAIM_OR_READ))
        self.dollar = {sql: positional(sql) for sql in (self.claim, self.complete, self.claim_or_read)}
        self.pool: Any = None
        self.conns: asyncio.LifoQueue[Any] = asyncio.LifoQueue()
        self.opened: list[Any] = []

    async def open(self) -> None:
        import asyncpg
        from psycopg_pool import AsyncConnectionPool

        self.pool = AsyncConnectionPool(
            self.url, kwargs={"autocommit": True}, min_size=0, max_size=self.size, open=False
        )
        await self.pool.open()
        for _ in range(self.size):
            conn = await asyncpg.connect(self.asyncpg_url)
            self.opened.append(conn)
            self.conns.put_nowait(conn)

    async def close(self) -> None:
        await self.pool.close()
        for conn in self.opened:
            await conn.close()

    async def _psycopg(self, sql: str, params: dict[str, Any]) -> list[Any]:
        async with self.pool.connection() as conn:
            return await (await conn.execute(sql, params)).fetchall()  # type: ignore[no-any-return]

    async def _asyncpg(self, sql: str, params: dict[str, Any]) -> list[Any]:
        text, names = self.dollar[sql]
        conn = await self.conns.get()
        try:
            return await conn.fetch(text, *[params[n] for n in names])  # type: ignore[no-any-return]
        finally:
            self.conns.put_nowait(conn)

    def path(self, driver: str, kind: str) -> FloorPath:
        run = self._psycopg if driver == "psycopg" else self._asyncpg

        async def first(i: int, tag: str) -> None:
            row = {"principal": PRINCIPAL, "key": f"raw-{driver}-{tag}-{i}", "token": i + 1}
            now = int(time.time() * 1000)
            gen = (await run(self.claim, {**row, "fingerprint": FINGERPRINT, "now": now}))[0][0]
            done = {"generation": gen, "status": 201, "body": STORED_1K, "headers": RESPONSE_HEADERS_JSON, "now": now}
            await run(self.complete, {**row, **done})

        async def replay(i: int, tag: str) -> None:
            row = {"principal": PRINCIPAL, "key": f"raw-{driver}-seed-{i % self.seeds}"}
            claim = {**row, "token": 1, "fingerprint": FINGERPRINT, "now": int(time.time() * 1000)}
            found = await run(self.claim_or_read, claim)
            assert found and found[0][0] is None, "the floor's replay claimed a new key"

        return first if kind == "first" else replay
