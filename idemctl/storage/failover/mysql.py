"""What `idemctl doctor` checks on MariaDB and MySQL: whether a completion the
ledger acknowledged survives the loss of the server it was written to, and
whether the request path can write at all (docs/mysql.md, "Galera" and
"Failover").

On a Galera node: the cluster's state (a Primary component, this node
Synced, how many nodes), and the causal reads (`wsrep_sync_wait`) in force
for the ledger's own session. Without Galera: whether this server takes
writes (read_only, a replica), the binary log format that READ COMMITTED
needs, whether replicas are fed semi-synchronously (an asynchronous replica
promoted at a failover can lack acknowledged completions), and whether a
commit is on disk when it is acknowledged. Nothing here needs the driver:
the engine reads the facts (`MysqlEngine.failover_facts`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .findings import Finding, Findings, Severity


@dataclass(frozen=True)
class MysqlFacts:
    """Variables and status values as the ledger's own session reads them
    (lower-case names; a value the server lacks is absent).

    >>> MysqlFacts({"version": "10.11.6-MariaDB", "wsrep_on": "ON"}).galera
    True
    """

    values: Mapping[str, str]

    def get(self, name: str, default: str = "") -> str:
        return self.values.get(name, default)

    def number(self, name: str) -> int | None:
        try:
            return int(self.values[name])
        except (KeyError, ValueError):
            return None

    def on(self, name: str) -> bool:
        return self.get(name).upper() in ("ON", "1", "YES")

    @property
    def galera(self) -> bool:
        return self.on("wsrep_on")

    @property
    def product(self) -> str:
        """MariaDB or MySQL, and which version.

        >>> MysqlFacts({"version": "10.11.6-MariaDB-0+deb12u1"}).product
        'MariaDB 10.11.6'
        """
        version = self.get("version")
        name = "MariaDB" if "mariadb" in version.lower() else "MySQL"
        return f"{name} {version.split('-', 1)[0]}".rstrip()

    def assess(self) -> tuple[Finding, ...]:
        """What these facts mean (see :func:`assess_mysql`)."""
        return assess_mysql(self)

    def document(self) -> dict[str, Any]:
        """The facts as `idemctl doctor --json` shows them, by name.

        >>> MysqlFacts({"wsrep_on": "OFF", "version": "8.0.36"}).document()
        {'version': '8.0.36', 'wsrep_on': 'OFF'}
        """
        return dict(sorted(self.values.items()))


def assess_mysql(facts: MysqlFacts) -> tuple[Finding, ...]:
    """What these facts mean for acknowledged completions and for the
    request path.

    >>> galera = {"wsrep_on": "ON", "wsrep_cluster_status": "Primary", "wsrep_local_state_comment": "Synced",
    ...           "wsrep_cluster_size": "3", "wsrep_sync_wait": "3", "innodb_flush_log_at_trx_commit": "1"}
    >>> [f.severity.value for f in assess_mysql(MysqlFacts(galera))]
    ['ok']
    >>> [f.severity.value for f in assess_mysql(MysqlFacts({**galera, "wsrep_sync_wait": "0"}))]
    ['warning']
    """
    return _assess_galera(facts) if facts.galera else _assess_single(facts)


def _assess_galera(facts: MysqlFacts) -> tuple[Finding, ...]:
    status, state = facts.get("wsrep_cluster_status"), facts.get("wsrep_local_state_comment")
    size, wait = facts.number("wsrep_cluster_size") or 0, facts.number("wsrep_sync_wait") or 0
    if status != "Primary":
        return (
            Finding(
                Severity.WARNING,
                f"Galera: this node is not in a Primary component (wsrep_cluster_status={status or 'unknown'}): "
                "it refuses every statement, so every request that needs the ledger is refused with 503; "
                "point the URL at a node of the Primary component",
            ),
        )
    findings = Findings()
    if state != "Synced":
        findings.warning(
            f"Galera: this node is {state or 'in an unknown state'}, not Synced: it is behind the cluster "
            "(causal reads wait for it, statements may be refused); point the URL at a Synced node"
        )
    if size < 2:
        findings.warning(
            f"Galera: a cluster of {size or 'unknown'} node(s): no other node holds the completions this "
            "one acknowledges, so losing its host loses them; run three nodes"
        )
    elif size == 2:
        findings.note(
            "Galera: a cluster of 2 nodes: losing either one leaves the other without a majority, and it "
            "refuses every statement (503) until an operator bootstraps it; three nodes (or two and a garbd "
            "arbitrator) keep a majority through one failure"
        )
    if not wait & 1:
        findings.warning(
            f"Galera: wsrep_sync_wait is {wait} for the ledger's session, so its reads are not causal: a "
            "retry sent to another node right after the completion can read the claim it replaced and "
            "answer 409 in progress; leave wsrep_sync_wait out of the URL (idemctl sets 3) or include 1"
        )
    elif not wait & 2:
        findings.note(
            f"Galera: wsrep_sync_wait is {wait} for the ledger's session: reads are causal, but a completion "
            "or takeover sent to another node than its claim (a load balancer that spreads one app's "
            "connections over the nodes) may not find the claim yet; include 2 (idemctl's default is 3)"
        )
    _check_flush(facts, findings)
    if not findings.warned:
        name = facts.get("wsrep_cluster_name")
        findings.ok_first(
            f"Galera cluster{f' {name!r}' if name else ''} of {size} nodes, this node Synced in the Primary "
            f"component, wsrep_sync_wait={wait} for the ledger's session: every node certifies a completion "
            "before it is acknowledged, and the ledger's reads wait for the cluster's earlier commits"
        )
    return tuple(findings)


def _check_flush(facts: MysqlFacts, findings: Findings) -> None:
    """innodb_flush_log_at_trx_commit other than 1: a commit acknowledged
    before it is on disk. On a Galera node another node holds it; on a
    single server it is lost with the host."""
    flush = facts.number("innodb_flush_log_at_trx_commit")
    if flush is None or flush == 1:
        return
    if facts.galera:
        findings.note(
            f"innodb_flush_log_at_trx_commit is {flush}: a completion survives as long as one node holds "
            "it, but a crash of every node at once can lose the last second of them"
        )
    else:
        findings.warning(
            f"innodb_flush_log_at_trx_commit is {flush}: a crash of this server's host can lose the last "
            "second of acknowledged completions, and their retries run the mutation again; set it to 1"
        )


def _assess_single(facts: MysqlFacts) -> tuple[Finding, ...]:
    findings = Findings()
    if (facts.number("slaves_running") or 0) > 0:
        findings.warning(
            "this server is a replica (its replication threads are running): the ledger must live on the "
            "primary, where every client's claims meet; point the URL at the primary"
        )
    if facts.on("read_only"):
        findings.warning(
            "read_only is ON: this server refuses the ledger's writes, so every request that needs the ledger "
            "is refused with 503; point the URL at the primary"
        )
    binlog = facts.on("log_bin")
    if binlog and facts.get("binlog_format").upper() == "STATEMENT":
        findings.warning(
            "binlog_format is STATEMENT: the server refuses writes under READ COMMITTED, which the ledger's "
            "sessions use, so every claim fails; set it to ROW or MIXED"
        )
    _check_flush(facts, findings)
    replicas = facts.number("slaves_connected")
    semi_sync = facts.on("rpl_semi_sync_master_enabled")
    if not binlog:
        findings.note(
            "the binary log is off, so no replica can follow this server: the ledger lives on this one "
            "server and its backups; for a failover without lost completions, run Galera or replicas fed "
            "semi-synchronously"
        )
    elif not replicas:
        findings.note(
            "no replica is connected to this server: a failover to a replica added later, or restored from a "
            "backup, can miss completions acknowledged here; with replicas, enable semi-synchronous "
            "replication (rpl_semi_sync_master_enabled=ON, rpl_semi_sync_master_wait_point=AFTER_SYNC)"
        )
    elif not semi_sync:
        findings.warning(
            f"replication is asynchronous ({replicas} replica(s) connected, rpl_semi_sync_master_enabled=OFF): "
            "a promoted replica can miss completions this server acknowledged, and their retries run the "
            "mutation again; enable semi-synchronous replication with wait point AFTER_SYNC, or run Galera"
        )
    elif not facts.on("rpl_semi_sync_master_status"):
        findings.warning(
            "semi-synchronous replication is enabled but inactive (no replica acknowledged within "
            "rpl_semi_sync_master_timeout): commits are acknowledged without any replica holding them"
        )
    else:
        point = facts.get("rpl_semi_sync_master_wait_point", "AFTER_COMMIT").upper()
        if point != "AFTER_SYNC":
            findings.note(
                f"rpl_semi_sync_master_wait_point is {point}: another session can read a completion before "
                "a replica has it, and lose it at a failover; AFTER_SYNC waits first"
            )
        findings.ok_first(
            f"semi-synchronous replication ({replicas} replica(s) connected): a completion is acknowledged "
            "only once a replica has received it"
        )
    if binlog:
        sync_binlog = facts.number("sync_binlog")
        if sync_binlog is not None and sync_binlog != 1:
            findings.note(
                f"sync_binlog is {sync_binlog}: after a crash of this server's host its binary log can lack "
                "commits InnoDB kept, and a replica then misses them; set it to 1"
            )
    return tuple(findings)
