"""redis-py's errors as idemctl's: a Redis that cannot be reached, a
replica that refuses writes, a full server with noeviction, each one line
with the URL as it may be printed (never the password)."""

from __future__ import annotations

from collections.abc import Iterable

from ...errors import ConnectionFailedError, LedgerUnavailableError, ReadOnlyDatabaseError, StorageError
from ..server import scrub


class RedisOutOfMemoryError(LedgerUnavailableError):
    """The server is at maxmemory and refuses writes (noeviction): nothing
    was written; requests get 503 until memory is freed."""


def translate(exc: Exception, where: str, secrets: Iterable[str]) -> StorageError:
    """The idemctl error for a redis-py error.

    >>> import redis
    >>> str(translate(redis.ConnectionError("Connection refused"), "redis://h:1/0", []))
    'cannot reach Redis at redis://h:1/0: Connection refused'
    """
    import redis.exceptions as rx

    text = scrub(str(exc) or type(exc).__name__, secrets)
    if isinstance(exc, rx.ReadOnlyError) or text.startswith("READONLY"):
        return ReadOnlyDatabaseError(
            f"{where} is a read-only replica ({text}): point the URL at the primary, a Sentinel "
            "(redis+sentinel://) or any node of a Redis Cluster"
        )
    if type(exc).__name__ == "OutOfMemoryError" or text.startswith("OOM") or "used memory > 'maxmemory'" in text:
        return RedisOutOfMemoryError(
            f"{where} is out of memory and refuses writes ({text}): raise maxmemory or free memory; nothing was written"
        )
    if isinstance(exc, rx.AuthenticationError | rx.AuthorizationError) or "NOAUTH" in text or "WRONGPASS" in text:
        return StorageError(f"Redis at {where} refused the credentials: {text}")
    if isinstance(exc, rx.ConnectionError | rx.TimeoutError | rx.ClusterDownError | rx.TryAgainError) or (
        type(exc).__name__ in ("MasterNotFoundError", "SlaveNotFoundError", "ClusterError", "MaxConnectionsError")
    ):
        return ConnectionFailedError(f"cannot reach Redis at {where}: {text}")
    if isinstance(exc, OSError):
        return ConnectionFailedError(f"cannot reach Redis at {where}: {text}")
    return StorageError(f"Redis error on {where}: {text}")
