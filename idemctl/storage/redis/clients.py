"""redis-py's clients for a Redis ledger's URL: a standalone server, a Redis
Cluster (recognised from any one node: its INFO says ``cluster_enabled:1``),
or the primary a Sentinel names; synchronous or asyncio, with the same
settings. Every socket wait is bounded by the ledger's busy timeout, so a
Redis that does not answer is a 503 in bounded time."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from .url import RedisLocation

STANDALONE, CLUSTER, SENTINEL = "standalone", "cluster", "sentinel"


def sha1(source: str) -> str:
    return hashlib.sha1(source.encode("utf-8"), usedforsecurity=False).hexdigest()


def timeouts(timeout_s: float, *, awaited: bool = False) -> dict[str, Any]:
    """A client's socket timeouts. An asyncio client (`awaited`) bounds its
    connects only: the asyncio engine bounds each whole operation itself,
    with one timer, where redis-py would spend a task on every command it
    writes (``asyncio.wait_for``), about a sixth of an ASGI request's work."""
    return {"socket_timeout": None if awaited else timeout_s, "socket_connect_timeout": timeout_s}


def is_cluster(info: Mapping[str, Any]) -> bool:
    """Whether a node's ``INFO cluster`` says it is part of a Redis Cluster.

    >>> is_cluster({"cluster_enabled": 1}), is_cluster({"cluster_enabled": 0})
    (True, False)
    """
    return str(info.get("cluster_enabled", 0)) == "1"


def _sentinel_kwargs(
    loc: RedisLocation, timeout_s: float, awaited: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    sentinel: dict[str, Any] = dict(timeouts(timeout_s, awaited=awaited))
    if loc.sentinel_password:
        sentinel["password"] = loc.sentinel_password
    primary: dict[str, Any] = {**timeouts(timeout_s, awaited=awaited), "db": loc.db}
    if loc.password:
        primary["password"] = loc.password
    if loc.username:
        primary["username"] = loc.username
    if loc.tls:
        primary["ssl"] = True
    return sentinel, primary


def sync_client(loc: RedisLocation, timeout_s: float) -> tuple[str, Any]:
    """(kind, client) for the location: the kind is found by asking the server."""
    import redis
    from redis.cluster import RedisCluster
    from redis.sentinel import Sentinel

    if loc.sentinels:
        sentinel_kw, primary_kw = _sentinel_kwargs(loc, timeout_s)
        sentinel = Sentinel(list(loc.sentinels), sentinel_kwargs=sentinel_kw, **timeouts(timeout_s))
        return SENTINEL, sentinel.master_for(loc.service or "", **primary_kw)
    probe = redis.Redis.from_url(loc.url, **timeouts(timeout_s))
    try:
        info = probe.info("cluster")
    finally:
        probe.close()
    if is_cluster(info):
        return CLUSTER, RedisCluster.from_url(_cluster_url(loc), **timeouts(timeout_s))
    return STANDALONE, redis.Redis.from_url(loc.url, **timeouts(timeout_s))


async def async_client(loc: RedisLocation, timeout_s: float, kind: str | None) -> tuple[str, Any]:
    """The asyncio twin of :func:`sync_client` (`kind` when already known)."""
    import redis.asyncio as aredis
    from redis.asyncio.cluster import RedisCluster
    from redis.asyncio.sentinel import Sentinel

    if loc.sentinels:
        sentinel_kw, primary_kw = _sentinel_kwargs(loc, timeout_s, awaited=True)
        sentinel = Sentinel(list(loc.sentinels), sentinel_kwargs=sentinel_kw, **timeouts(timeout_s, awaited=True))
        return SENTINEL, sentinel.master_for(loc.service or "", **primary_kw)
    if kind is None:
        probe = aredis.Redis.from_url(loc.url, **timeouts(timeout_s, awaited=True))
        try:
            info = await probe.info("cluster")
        finally:
            await closed(probe)
        kind = CLUSTER if is_cluster(info) else STANDALONE
    if kind == CLUSTER:
        return CLUSTER, RedisCluster.from_url(_cluster_url(loc), **timeouts(timeout_s, awaited=True))
    return STANDALONE, aredis.Redis.from_url(loc.url, **timeouts(timeout_s, awaited=True))


async def closed(client: Any) -> None:
    """Close an asyncio client (`aclose` from redis-py 5.0.1, `close` before it)."""
    await (getattr(client, "aclose", None) or client.close)()


def _cluster_url(loc: RedisLocation) -> str:
    # A cluster has database 0 only: redis-py's cluster client refuses a path.
    head, sep, rest = loc.url.partition("://")
    netloc, _, tail = rest.partition("/")
    query = tail.partition("?")[2]
    return f"{head}{sep}{netloc}" + (f"?{query}" if query else "")
