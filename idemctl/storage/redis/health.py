"""What loses answers on Redis, read from every primary the ledger writes
to (`idemctl doctor`): eviction, persistence, replication and, on a
cluster, its state and slot coverage; each finding says which setting to
change. Findings are (severity, message) pairs: "ok", "note" or "warning"."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..failover.findings import Finding as Verdict
from ..failover.findings import Severity

Finding = tuple[str, str]

CLUSTER_SLOTS = 16384


def _config(node: Any, name: str) -> str | None:
    try:
        got = node.config_get(name)
    except Exception:  # CONFIG renamed or refused (managed services): judged as unknown
        return None
    value = got.get(name) if isinstance(got, Mapping) else None
    return None if value is None else str(value)


def node_facts(node: Any) -> dict[str, Any]:
    """One server's settings that decide whether an acknowledged answer survives."""
    replication = node.info("replication")
    return {
        "maxmemory-policy": _config(node, "maxmemory-policy"),
        "appendonly": _config(node, "appendonly"),
        "appendfsync": _config(node, "appendfsync"),
        "min-replicas-to-write": _config(node, "min-replicas-to-write"),
        "role": str(replication.get("role", "")),
        "connected_slaves": int(replication.get("connected_slaves", 0) or 0),
    }


def assess_node(name: str, facts: Mapping[str, Any], wait_replicas: int) -> list[Finding]:
    """What one primary's settings mean for the ledger's answers.

    >>> facts = {"maxmemory-policy": "allkeys-lru", "appendonly": "yes", "appendfsync": "everysec",
    ...          "min-replicas-to-write": "0", "role": "master", "connected_slaves": 0}
    >>> [severity for severity, _ in assess_node("a:1", facts, 0)]
    ['warning', 'note', 'note']
    """
    found: list[Finding] = []
    policy = facts.get("maxmemory-policy")
    if policy is None:
        found.append(("note", f"{name}: CONFIG GET is not allowed; check that maxmemory-policy is noeviction"))
    elif policy != "noeviction":
        found.append(
            (
                "warning",
                f"{name}: maxmemory-policy is {policy}: under memory pressure Redis evicts ledger rows, and the retry "
                "of an evicted key runs its mutation again; set maxmemory-policy noeviction (a full server then "
                "answers 503 instead)",
            )
        )
    aof, fsync = facts.get("appendonly"), facts.get("appendfsync")
    if aof == "no":
        found.append(
            (
                "warning",
                f"{name}: appendonly is no: a restart loses every completion written since the last RDB snapshot, "
                "and their retries run again; set appendonly yes",
            )
        )
    elif aof == "yes" and fsync == "everysec":
        found.append(
            (
                "note",
                f"{name}: appendfsync is everysec: a crash of the host (not of Redis alone) can lose up to a second "
                "of acknowledged completions; appendfsync always closes that at a cost on every write",
            )
        )
    elif aof == "yes" and fsync == "no":
        found.append(
            (
                "warning",
                f"{name}: appendfsync is no: the OS decides when completions reach the disk; set everysec or always",
            )
        )
    replicas = int(facts.get("connected_slaves") or 0)
    if facts.get("role") not in (None, "", "master"):
        found.append(
            ("warning", f"{name}: this server is a replica and refuses writes (503): point the URL at a primary")
        )
    elif replicas == 0:
        found.append(
            (
                "note",
                f"{name}: no replica: losing this host loses the ledger; a replica and a failover manager "
                "(Sentinel or Redis Cluster) keep it answering",
            )
        )
    elif wait_replicas < 1:
        found.append(
            (
                "warning",
                f"{name}: replication is asynchronous ({replicas} replica(s)): a failover can lose completions "
                "acknowledged just before it, and their retries run again; add wait_replicas=1 to the ledger's URL "
                "(a completion is acknowledged once a replica holds it) and min-replicas-to-write 1",
            )
        )
    elif replicas < wait_replicas:
        found.append(
            (
                "warning",
                f"{name}: wait_replicas={wait_replicas} but {replicas} replica(s) connected: every completion waits "
                "out wait_timeout_ms and is refused (503)",
            )
        )
    else:
        found.append(
            ("ok", f"{name}: a completion is acknowledged once {wait_replicas} of {replicas} replica(s) hold it (WAIT)")
        )
    return found


def assess_cluster(info: Mapping[str, Any]) -> list[Finding]:
    """A cluster's state and slot coverage (CLUSTER INFO).

    >>> assess_cluster({"cluster_state": "ok", "cluster_slots_assigned": 16384, "cluster_slots_ok": 16384})[0][0]
    'ok'
    """
    state = str(info.get("cluster_state"))
    assigned, ok = int(info.get("cluster_slots_assigned", 0)), int(info.get("cluster_slots_ok", 0))
    if state != "ok" or assigned < CLUSTER_SLOTS or ok < CLUSTER_SLOTS:
        return [
            (
                "warning",
                f"cluster_state is {state}, {ok} of {CLUSTER_SLOTS} slots served: requests whose keys fall in the "
                "other slots get 503; assign every slot (redis-cli --cluster fix) and bring failed primaries back",
            )
        ]
    return [("ok", f"cluster_state ok, all {CLUSTER_SLOTS} slots served")]


@dataclass(frozen=True)
class RedisFacts:
    """What doctor read of a Redis ledger's servers (storage.failover.FailoverFacts)."""

    product: str
    facts: dict[str, dict[str, Any]]
    found: tuple[Finding, ...]

    def assess(self) -> tuple[Verdict, ...]:
        return tuple(Verdict(Severity(severity), message) for severity, message in self.found)

    def document(self) -> dict[str, Any]:
        return {name: dict(values) for name, values in self.facts.items()}


def read_facts(client: Any, kind: str, wait_replicas: int) -> RedisFacts:
    """Read every primary's settings (and a cluster's state) through `client`."""
    if kind != "cluster":
        version = str(client.info("server").get("redis_version", "?"))
        name = "the Sentinel's primary" if kind == "sentinel" else "the server"
        facts = node_facts(client)
        return RedisFacts(f"Redis {version} ({kind})", {name: facts}, tuple(assess_node(name, facts, wait_replicas)))
    found: list[Finding] = []
    every: dict[str, dict[str, Any]] = {}
    primaries = client.get_primaries()
    version = "?"
    for node in primaries:
        conn = node.redis_connection
        version = str(conn.info("server").get("redis_version", "?"))
        name = f"{node.host}:{node.port}"
        every[name] = node_facts(conn)
        found += assess_node(name, every[name], wait_replicas)
    info = primaries[0].redis_connection.cluster("info") if primaries else {}
    every["cluster"] = {k: info.get(k) for k in ("cluster_state", "cluster_slots_assigned", "cluster_slots_ok")}
    found += assess_cluster(info)
    return RedisFacts(f"Redis {version} (cluster of {len(primaries)} primaries)", every, tuple(found))
