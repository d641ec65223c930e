"""A Redis ledger's operations as redis-py calls, shared by the synchronous
engine (engine.py) and the asyncio one (aio.py): each operation a
RedisStore names, sent on a client or a pipeline, the same calls for both."""

from __future__ import annotations

from typing import Any

from ...errors import StorageError
from ..engine import Params
from .clients import sha1
from .keys import BUCKETS, COPY_FIELDS, ROW_FIELDS, Layout
from .scripts import SCRIPTS

SHAS = {name: sha1(source) for name, source in SCRIPTS.items()}
# Commands a pipeline carries at most (a listing over 1024 buckets, a
# renewal of many reservations): bounded memory for the replies of each.
PIPELINE_MAX = 1024


def issue(target: Any, op: str, params: Params) -> Any:
    """Send one operation on a client or a pipeline (sync or asyncio: the
    same calls); its reply, or its awaitable, or the pipeline."""
    keys = params.get("keys", ())
    args = params.get("args", ())
    sha = SHAS.get(op)
    if sha is not None:
        return target.evalsha(sha, len(keys), *keys, *args)
    if op == "row":
        return target.hmget(keys[0], ROW_FIELDS)
    if op == "state":
        return target.hmget(keys[0], ("s", "g", "c", "u"))
    if op == "full_row":
        return target.hmget(keys[0], COPY_FIELDS)
    if op == "first":
        return target.zrange(keys[0], 0, 0, withscores=True)
    if op == "below":
        return target.zrangebyscore(keys[0], "-inf", f"({args[0]}", start=0, num=int(args[1]))
    if op == "below_scored":
        return target.zrangebyscore(
            keys[0], "-inf", f"({args[0]}", start=int(args[1]), num=int(args[2]), withscores=True
        )
    if op == "range":
        return target.zrange(keys[0], int(args[0]), int(args[1]), withscores=True)
    if op == "count_below":
        return target.zcount(keys[0], "-inf", f"({args[0]}")
    if op == "card":
        return target.zcard(keys[0])
    if op == "hgetall":
        return target.hgetall(keys[0])
    if op == "hlen":
        return target.hlen(keys[0])
    if op == "hvals":
        return target.hvals(keys[0])
    if op == "version":
        return target.hget(keys[0], "version")
    if op == "time":
        return target.time()
    raise StorageError(f"no Redis operation named {op!r}")


def probe_calls(layout: Layout) -> list[tuple[str, Params]]:
    """The sweep's probe: the oldest entry of every bucket's rows and events."""
    calls: list[tuple[str, Params]] = []
    for b in range(BUCKETS):
        calls.append(("first", {"keys": [layout.rows_by_time(b)]}))
        calls.append(("first", {"keys": [layout.events_by_time(b)]}))
    return calls


def queue(pipe: Any, op: str, params: Params, cluster: bool) -> None:
    """Queue one operation on a pipeline (a `cluster`'s: its scripts go with
    their text where `SCRIPTS_BY_TEXT_IN_CLUSTER_PIPELINES` says so)."""
    if cluster and SCRIPTS_BY_TEXT_IN_CLUSTER_PIPELINES and op in SHAS:
        eval_instead(pipe, op, params)
    else:
        issue(pipe, op, params)


def _cluster_pipelines_refuse_evalsha() -> bool:
    try:
        from redis.cluster import PIPELINE_BLOCKED_COMMANDS
    except ImportError:  # no redis-py: no engine either
        return False
    return "EVALSHA" in PIPELINE_BLOCKED_COMMANDS


# redis-py before 8.2 refuses EVALSHA in a cluster's pipeline (sync and
# asyncio alike) but takes EVAL: there a script is sent with its text, which
# the server compiles once and caches by its digest.
SCRIPTS_BY_TEXT_IN_CLUSTER_PIPELINES = _cluster_pipelines_refuse_evalsha()


def eval_instead(target: Any, op: str, params: Params) -> Any:
    """The same operation with the script's text (EVAL caches it on the server)."""
    keys = params.get("keys", ())
    # The command itself, which is what eval() sends: the cluster pipelines
    # of redis-py before 8.2 refuse eval() (and EVALSHA) but queue this.
    return target.execute_command("EVAL", SCRIPTS[op], len(keys), *keys, *params.get("args", ()))


def is_noscript(reply: object) -> bool:
    return type(reply).__name__ == "NoScriptError" or (isinstance(reply, Exception) and "NOSCRIPT" in str(reply))


def time_ms(reply: Any) -> int:
    seconds, micros = reply
    return int(seconds) * 1000 + int(micros) // 1000
