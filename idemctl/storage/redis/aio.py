"""The Redis engine on an event loop (redis-py's asyncio client): the ASGI
middleware, the FastAPI route class and async idempotent functions await
their operations here, with no thread. The operations and their scripts are
the synchronous engine's (engine.py: `issue`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

from ...errors import StorageError
from ..deadlines import Deadlines
from ..engine import Params, Rows
from ..statements import TABLES
from .clients import CLUSTER, async_client, closed
from .errors import translate
from .keys import Layout
from .ops import PIPELINE_MAX, eval_instead, is_noscript, issue, probe_calls, queue, time_ms
from .url import RedisLocation

# What a connection to one cluster node carries over from the cluster's.
_NODE_SETTINGS = ("username", "password", "socket_timeout", "socket_connect_timeout")


class AsyncRedisEngine:
    """What an AsyncStore awaits (storage/aio.py's AsyncEngine), on Redis."""

    # redis-py's client is not known to be free of timeouts that cancel the
    # task: each write keeps a task and a shield of its own.
    lands_in_place = False

    def __init__(self, location: RedisLocation, timeout_s: float, kind: str | None) -> None:
        self.location = location
        self.timeout_s = timeout_s
        self.kind = kind
        self._client: Any = None
        self._deadlines = Deadlines()

    def describe(self) -> str:
        return self.location.shown

    def __repr__(self) -> str:
        return f"AsyncRedisEngine({self.location.shown!r})"

    def _fail(self, exc: Exception) -> NoReturn:
        raise translate(exc, self.location.shown, self.location.secrets) from None

    async def client(self) -> Any:
        if self._client is None:
            import redis

            try:
                self.kind, self._client = await async_client(self.location, self.timeout_s, self.kind)
            except (redis.RedisError, OSError) as exc:
                self._fail(exc)
        return self._client

    async def execute(self, sql: str, params: Params) -> Rows:
        # The client's sockets have no timeout of their own (clients.timeouts):
        # the whole operation, its connect and any retry included, is bounded here.
        bound = self.timeout_s + (self.location.wait_timeout_ms / 1000 if sql.startswith("wait_") else 0)
        try:
            return await self._deadlines.within(bound, self._execute(sql, params))
        except TimeoutError as exc:  # the bound (storage/deadlines.py): an unreachable Redis, as any lost socket
            self._fail(exc)

    async def _execute(self, sql: str, params: Params) -> Rows:
        import redis

        client = await self.client()
        if sql == "version":  # the schema guard's read (store_base.VERSION), which names no key
            params = {"keys": [Layout(self.location.prefix).marker]}
        try:
            if sql == "sweep_probe":
                return [(await self._pipeline(client, probe_calls(Layout(self.location.prefix))),)]
            if sql == "batch":
                return [(await self._pipeline(client, params["calls"]),)]
            if sql.startswith("wait_"):
                return [(await self._and_wait(client, sql.removeprefix("wait_"), params),)]
            try:
                reply = await issue(client, sql, params)
            except redis.RedisError as exc:
                if not is_noscript(exc):
                    raise
                reply = await eval_instead(client, sql, params)
            return [(time_ms(reply) if sql == "time" else reply,)]
        except (redis.RedisError, OSError) as exc:
            self._fail(exc)

    async def _and_wait(self, client: Any, script: str, params: Params) -> Any:
        loc = self.location
        target = client
        if self.kind == CLUSTER:
            # Not the cluster's pipeline: WAIT must run on the connection that wrote.
            import redis.asyncio as aredis

            node = client.get_node_from_key(params["keys"][0])
            same = {k: v for k, v in node.connection_kwargs.items() if k in _NODE_SETTINGS}
            ssl = "SSL" in node.connection_class.__name__
            target = aredis.Redis(host=node.host, port=node.port, ssl=ssl, **same)
        pipe = target.pipeline(transaction=False)
        eval_instead(pipe, script, params)
        pipe.execute_command("WAIT", loc.wait_replicas, loc.wait_timeout_ms)
        stored, replicas = await pipe.execute()
        if target is not client:
            await closed(target)
        if stored and int(replicas) < loc.wait_replicas:
            raise TimeoutError(
                f"the completion reached {replicas} of the {loc.wait_replicas} replicas wait_replicas asks for "
                f"within {loc.wait_timeout_ms} ms"
            )
        return stored

    async def _pipeline(self, client: Any, calls: Sequence[tuple[str, Params]]) -> list[Any]:
        replies: list[Any] = []
        for start in range(0, len(calls), PIPELINE_MAX):
            chunk = calls[start : start + PIPELINE_MAX]
            pipe = client.pipeline(transaction=False)
            cluster = self.kind == CLUSTER
            for op, params in chunk:
                queue(pipe, op, params, cluster)  # a pipeline's commands are not awaited one by one
            got = list(await pipe.execute(raise_on_error=False))
            for i, reply in enumerate(got):
                if is_noscript(reply):
                    got[i] = await eval_instead(client, *chunk[i])
                elif isinstance(reply, Exception):
                    raise reply
                elif chunk[i][0] == "time":
                    got[i] = time_ms(reply)
            replies.extend(got)
        return replies

    async def write_turn(self, statements: Sequence[tuple[str, Params]]) -> list[Rows]:
        import redis

        try:
            return await self._deadlines.within(self.timeout_s, self._write_turn(statements))
        except (redis.RedisError, OSError) as exc:
            self._fail(exc)

    async def _write_turn(self, statements: Sequence[tuple[str, Params]]) -> list[Rows]:
        client = await self.client()
        return [[(reply,)] for reply in await self._pipeline(client, statements)]

    async def table_names(self, names: Iterable[str]) -> set[str]:
        rows = await self.execute("hgetall", {"keys": [Layout(self.location.prefix).marker]})
        return set(names) & set(TABLES) if rows[0][0] else set()

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):  # a broken connection has nothing left to close
                await closed(client)

    def abandon(self) -> None:
        """Let go of a client whose event loop is gone (its sockets close with it)."""
        if self._client is not None and not isinstance(self._client, StorageError):
            self._client = None
