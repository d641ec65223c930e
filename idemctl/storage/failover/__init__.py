"""What `idemctl doctor` reads of an engine's replication, and what it means.

An engine whose kind replicates (`Capabilities.replicates`) has a
``failover_facts()`` method that reads, through the ledger's own session,
what decides whether a completion it acknowledged survives a failover, and
returns a value of its own type that follows :class:`FailoverFacts`: its
product's name, the findings it assesses itself into, and the document
`doctor --json` shows. Nothing in this package needs a driver:
`postgres.py` (synchronous replication) and `mysql.py` (Galera, replicas)
hold the facts and their assessments; an engine that does not replicate is
described by :class:`SingleHost`, in its kind's own words."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from .findings import Finding, Severity

__all__ = ["FailoverFacts", "Finding", "Severity", "SingleHost"]


class FailoverFacts(Protocol):
    """What an engine read about its replication, able to judge itself."""

    @property
    def product(self) -> str:
        """The database's name as doctor shows it ("PostgreSQL", "MariaDB 10.11.6")."""

    def assess(self) -> tuple[Finding, ...]:
        """What these facts mean for acknowledged completions at a failover."""

    def document(self) -> dict[str, Any] | None:
        """What was read, as `doctor --json` shows it (None: nothing was read)."""


@dataclass(frozen=True)
class SingleHost:
    """The facts of an engine with no replication to read: `product` is its
    kind's title; `file` says whether the ledger is a file on one host.

    >>> SingleHost("SQLite", file=True).assess()[0].message
    'SQLite: the ledger is a file on one host; there is no replication to fail over to'
    """

    product: str
    file: bool

    def assess(self) -> tuple[Finding, ...]:
        if self.file:
            return (
                Finding(
                    Severity.OK,
                    f"{self.product}: the ledger is a file on one host; there is no replication to fail over to",
                ),
            )
        return (
            Finding(
                Severity.NOTE,
                f"{self.product}: idemctl cannot read how this database replicates; check with its operator "
                "that a write it acknowledged survives a failover",
            ),
        )

    def document(self) -> None:
        return None
