"""The Redis engine: runs the operations a RedisStore builds.

An operation is named (a Statement's text is its name) and carries its keys
and arguments: a Lua script of scripts.py, run by EVALSHA (EVAL when the
server does not hold it yet: after a restart, a failover, a SCRIPT FLUSH),
or one of the few plain reads (a row's fields, an index's first entry, the
server's clock). A Turn, and an operator's walk over the buckets, run as one
pipeline (on a cluster, one per node). Nothing connects before the first
operation; the first one asks the server whether it is part of a Redis
Cluster."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NoReturn, TypeVar

import redis  # the driver: a missing one is named when the engine is chosen

from ...errors import ReadOnlyDatabaseError, StorageError
from ..dialect import UTF8_OR_BYTES, Dialect, SweepForm
from ..engine import Params, Rows, SchemaTx
from ..statements import TABLES
from .clients import CLUSTER, sync_client
from .errors import translate
from .keys import Layout
from .ops import PIPELINE_MAX, eval_instead, is_noscript, issue, probe_calls, queue, time_ms
from .url import RedisLocation, parse

T = TypeVar("T")


def _unused_tally(rows: list[tuple[Any, ...]]) -> tuple[int, int | None]:
    return len(rows), None


REDIS = Dialect(
    name="redis",
    # Rows per bucket a sweep batch removes at most.
    sweep=SweepForm("sweep_rows", _unused_tally, drain_batch=1000),
    body=UTF8_OR_BYTES,
    now_sql="time",
    claim_reads_row=True,
)


class RedisEngine:
    """A Redis ledger's connection: a standalone server, a Redis Cluster or
    a Sentinel's primary, as its URL says (see url.py)."""

    dialect = REDIS

    def __init__(self, target: str, *, readonly: bool = False, busy_timeout_ms: int = 5000) -> None:
        self.location: RedisLocation = parse(target)
        self.readonly = readonly
        self.timeout_s = max(busy_timeout_ms, 100) / 1000
        self.kind: str | None = None
        self._client: Any = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RedisEngine({self.location.shown!r})"

    def describe(self) -> str:
        return self.location.shown

    @property
    def prefix(self) -> str:
        return self.location.prefix

    # -- connections --------------------------------------------------------------------
    def client(self) -> Any:
        """The redis-py client, made on first use (the server says what kind)."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self.kind, self._client = self._guarded(lambda: sync_client(self.location, self.timeout_s))
        return self._client

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):  # a broken connection has nothing left to close
                client.close()

    def open_async(self) -> Any:
        """The asyncio twin of this engine, for one event loop (storage/aio.py)."""
        from .aio import AsyncRedisEngine

        return AsyncRedisEngine(self.location, self.timeout_s, self.kind)

    def fail(self, exc: Exception) -> NoReturn:
        raise translate(exc, self.location.shown, self.location.secrets) from None

    def _guarded(self, call: Callable[[], T]) -> T:

        try:
            return call()
        except (redis.RedisError, OSError) as exc:
            self.fail(exc)

    # -- operations ---------------------------------------------------------------------
    def run_one(self, op: str, params: Params) -> Any:
        client = self.client()
        if op == "version":  # the schema guard's read (store_base.VERSION), which names no key
            params = {"keys": [Layout(self.prefix).marker]}

        def call() -> Any:
            if op.startswith("wait_"):
                return self._and_wait(client, op.removeprefix("wait_"), params)
            try:
                reply = issue(client, op, params)
            except Exception as exc:
                if not is_noscript(exc):
                    raise
                reply = eval_instead(client, op, params)
            return time_ms(reply) if op == "time" else reply

        return self._guarded(call)

    def _and_wait(self, client: Any, script: str, params: Params) -> Any:
        """A completion (or the check that one is stored), then WAIT for the
        URL's replicas on the same connection: a completion that reached
        fewer is not acknowledged (the ledger tries again, then refuses)."""
        loc = self.location
        target = client
        if self.kind == CLUSTER:
            target = client.get_node_from_key(params["keys"][0]).redis_connection
        pipe = target.pipeline(transaction=False)
        eval_instead(pipe, script, params)
        pipe.execute_command("WAIT", loc.wait_replicas, loc.wait_timeout_ms)
        stored, replicas = pipe.execute()
        if stored and int(replicas) < loc.wait_replicas:
            raise TimeoutError(
                f"the completion reached {replicas} of the {loc.wait_replicas} replicas wait_replicas asks for "
                f"within {loc.wait_timeout_ms} ms"
            )
        return stored

    def many(self, calls: Sequence[tuple[str, Params]]) -> list[Any]:
        """The operations' replies, pipelined (on a cluster, one pipeline per
        node), PIPELINE_MAX at a time."""
        replies: list[Any] = []
        client = self.client()
        for start in range(0, len(calls), PIPELINE_MAX):
            chunk = calls[start : start + PIPELINE_MAX]
            replies.extend(self._guarded(functools.partial(self._pipeline, client, chunk)))
        return replies

    def _pipeline(self, client: Any, calls: Sequence[tuple[str, Params]]) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        cluster = self.kind == CLUSTER
        for op, params in calls:
            queue(pipe, op, params, cluster)
        replies = list(pipe.execute(raise_on_error=False))
        for i, reply in enumerate(replies):
            if is_noscript(reply):
                op, params = calls[i]
                replies[i] = eval_instead(client, op, params)
            elif isinstance(reply, Exception):
                raise reply
            elif calls[i][0] == "time":
                replies[i] = time_ms(reply)
        return replies

    # -- the Engine protocol: what a Store's operations run through -------------------------
    def read(self, sql: str, params: Params) -> Rows:
        if sql == "sweep_probe":
            return [(self.many(probe_calls(Layout(self.prefix))),)]
        if sql == "batch":
            return [(self.many(params["calls"]),)]
        return [(self.run_one(sql, params),)]

    def write(self, sql: str, params: Params) -> Rows:
        if self.readonly:
            raise ReadOnlyDatabaseError(f"{self.describe()} was opened read-only")
        return self.read(sql, params)

    def write_turn(self, statements: Sequence[tuple[str, Params]]) -> list[Rows]:
        if self.readonly:
            raise ReadOnlyDatabaseError(f"{self.describe()} was opened read-only")
        return [[(reply,)] for reply in self.many(statements)]

    def stream(self, sql: str, params: Params) -> Iterator[tuple[Any, ...]]:
        yield from self.read(sql, params)

    def failover_facts(self) -> Any:
        """What `idemctl doctor` judges (health.py): every primary the ledger
        writes to, and on a cluster its state and slot coverage."""
        from .health import read_facts

        client = self.client()
        return self._guarded(lambda: read_facts(client, self.kind or "", self.location.wait_replicas))

    def table_names(self, names: Iterable[str]) -> set[str]:
        """All of idemctl's "tables" once `init` wrote the version marker, else none."""
        marker = self.run_one("hgetall", {"keys": [Layout(self.prefix).marker]})
        return set(names) & set(TABLES) if marker else set()

    def migrate(self, body: Callable[[SchemaTx], T], *, write: bool) -> T:
        raise StorageError("a Redis ledger has no SQL schema: RedisStore.init writes its version marker")

    def storage_bytes(self, tables: Iterable[str]) -> int | None:
        return None
