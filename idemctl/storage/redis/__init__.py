"""Redis as a ledger's engine (``pip install 'idemctl[redis]'``): a
standalone server, a Redis Cluster (any node's URL) or a Sentinel's primary;
Valkey alike (docs/redis.md). Each request-path step is one Lua script over
the keys of one hash slot (scripts.py, keys.py); the RedisStore builds them
where the SQL store builds statements, so the ledger and its drivers run
them unchanged."""

from __future__ import annotations

from .engine import REDIS, RedisEngine
from .store import RedisStore
from .url import is_redis_url

__all__ = ["REDIS", "RedisEngine", "RedisStore", "is_redis_url"]
