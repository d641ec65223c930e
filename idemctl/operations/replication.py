"""Whether the ledger's database keeps acknowledged completions across a
failover (docs/postgres.md, "High availability"; docs/mysql.md, "Failover").

The engine reads its own facts and they judge themselves
(`idemctl.storage.failover`: PostgreSQL's synchronous replication, MariaDB
Galera and replicas); an engine with no replication says so in its own
kind's words. This module only puts the verdict together."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..storage import Store, engine_kind, failover_facts
from ..storage.failover import FailoverFacts, Finding, Severity
from ..storage.failover.postgres import ReplicationSettings, assess

__all__ = ["FailoverCheck", "Finding", "ReplicationSettings", "Severity", "assess", "check_failover"]


class OpenLedger(Protocol):
    """A ledger or its operator (`Ledger.operator`): its store, and where it lives."""

    @property
    def store(self) -> Store: ...
    def describe(self) -> str: ...


@dataclass(frozen=True)
class FailoverCheck:
    where: str
    engine: str  # "SQLite", "PostgreSQL", or the MariaDB/MySQL server's name and version
    settings: FailoverFacts | None  # None: an engine with no replication to read (a SQLite file)
    findings: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        """No finding is a warning."""
        return all(f.severity is not Severity.WARNING for f in self.findings)


def check_failover(ledger: OpenLedger) -> FailoverCheck:
    """Read the replication settings of the server the ledger writes to and
    assess them for its engine; a SQLite ledger lives on one host and has none.
    `ledger` is a :class:`~idemctl.Ledger` or its operator.

    >>> from idemctl import Ledger
    >>> check_failover(Ledger.open(":memory:")).findings[0].message
    'SQLite: the ledger is a file on one host; there is no replication to fail over to'
    """
    engine = ledger.store.engine
    facts = failover_facts(engine)
    settings = facts if engine_kind(engine).capabilities.replicates else None
    return FailoverCheck(ledger.describe(), facts.product, settings, facts.assess())
