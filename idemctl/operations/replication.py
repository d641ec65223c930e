"""Whether the ledger's database keeps acknowledged completions across a
failover (docs/postgres.md, "High availability").

With asynchronous replication a standby can be promoted without the last
completions its primary acknowledged; a retry then finds no row (or a
pending one) and runs the mutation again. Synchronous replication
(`synchronous_standby_names` set, `synchronous_commit` on or remote_apply)
acknowledges a completion only once a standby holds it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..storage import Store
from .findings import Finding, Severity
from .replication_mysql import MysqlFacts, assess_mysql

__all__ = ["FailoverCheck", "Finding", "ReplicationSettings", "Severity", "assess", "check_failover"]


class OpenLedger(Protocol):
    """A ledger or its operator (`Ledger.operator`): its store, and where it lives."""

    @property
    def store(self) -> Store: ...
    def describe(self) -> str: ...


# Values of synchronous_commit under which a commit waits for the
# synchronous standbys (remote_write: received, not yet flushed there).
WAITS_FOR_STANDBY = ("on", "remote_apply", "remote_write")


@dataclass(frozen=True)
class ReplicationSettings:
    """What the ledger's own session sees on the server it writes to."""

    synchronous_commit: str
    synchronous_standby_names: str
    in_recovery: bool
    standbys: tuple[str, ...]  # "name=sync_state" per connected standby

    def sync_states(self) -> list[str]:
        return [s.rpartition("=")[2] for s in self.standbys]


@dataclass(frozen=True)
class FailoverCheck:
    where: str
    engine: str  # "SQLite", "PostgreSQL", or the MariaDB/MySQL server's name and version
    settings: ReplicationSettings | MysqlFacts | None  # None: a SQLite ledger
    findings: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        """No finding is a warning."""
        return all(f.severity is not Severity.WARNING for f in self.findings)


def assess(s: ReplicationSettings) -> tuple[Finding, ...]:
    """What these settings mean for acknowledged completions at a failover.

    >>> async_standby = ReplicationSettings("on", "", False, ("replica1=async",))
    >>> [f.severity.value for f in assess(async_standby)]
    ['warning']
    >>> sync = ReplicationSettings("on", "ANY 1 (replica1, replica2)", False, ("replica1=quorum", "replica2=quorum"))
    >>> [f.severity.value for f in assess(sync)]
    ['ok']
    """
    if s.in_recovery:
        return (
            Finding(
                Severity.WARNING,
                "this server is a standby (in recovery): it accepts no writes, so every request that needs the "
                "ledger is refused with 503; point the URL at the primary, or list every host with "
                "target_session_attrs=read-write",
            ),
        )
    commit, names, states = s.synchronous_commit, s.synchronous_standby_names.strip(), s.sync_states()
    if not names:
        if not s.standbys:
            return (
                Finding(
                    Severity.NOTE,
                    "no standby streams from this server: a failover to a standby that is added later, or restored "
                    "from a backup, can miss completions acknowledged here; with standbys, set "
                    "synchronous_standby_names",
                ),
            )
        return (
            Finding(
                Severity.WARNING,
                f"replication is asynchronous (synchronous_standby_names is empty; {len(s.standbys)} standby(s) "
                "connected): a promoted standby can miss completions this server acknowledged, and their retries "
                "run the mutation again; set synchronous_standby_names and synchronous_commit=on or remote_apply",
            ),
        )
    if commit not in WAITS_FOR_STANDBY:
        return (
            Finding(
                Severity.WARNING,
                f"synchronous_commit is {commit} for the ledger's session: its commits do not wait for the "
                f"synchronous standby ({names}), so a promoted standby can miss acknowledged completions; "
                "set it to on or remote_apply (ALTER ROLE … SET synchronous_commit = on)",
            ),
        )
    findings = []
    if commit == "remote_write":
        findings.append(
            Finding(
                Severity.NOTE,
                "synchronous_commit is remote_write: an acknowledged completion is in the standby's memory, "
                "not yet on its disk; it survives the primary's failure, not a crash of both; on or remote_apply "
                "also covers that",
            )
        )
    if "unknown" in states:
        findings.append(
            Finding(
                Severity.NOTE,
                "the standbys' sync state is hidden from this role (grant it pg_monitor to see it)",
            )
        )
    elif not any(state in ("sync", "quorum") for state in states):
        findings.append(
            Finding(
                Severity.WARNING,
                f"synchronous_standby_names is {names!r} but no synchronous standby is connected: every commit waits "
                "for one, so every request that writes is refused with 503 after the commit timeout until a standby "
                "connects",
            )
        )
    if not findings or all(f.severity is Severity.NOTE for f in findings):
        findings.insert(
            0,
            Finding(
                Severity.OK,
                f"synchronous replication (synchronous_standby_names={names!r}, synchronous_commit={commit}): "
                "a completion is acknowledged only once a standby holds it",
            ),
        )
    return tuple(findings)


def check_failover(ledger: OpenLedger) -> FailoverCheck:
    """Read the replication settings of the server the ledger writes to and
    assess them for its engine; a SQLite ledger lives on one host and has none.
    `ledger` is a :class:`~idemctl.Ledger` or its operator.

    >>> from idemctl import Ledger
    >>> check_failover(Ledger.open(":memory:")).findings[0].message
    'SQLite: the ledger is a file on one host; there is no replication to fail over to'
    """
    engine = ledger.store.engine
    dialect = ledger.store.dialect.name
    own = getattr(engine, "failover_check", None)
    if own is not None:  # an engine that judges its own server (Redis)
        product, found = own()
        return FailoverCheck(ledger.describe(), product, None, tuple(Finding(Severity(s), m) for s, m in found))
    if dialect == "mysql":
        facts = MysqlFacts(engine.replication_facts())  # type: ignore[attr-defined]
        return FailoverCheck(ledger.describe(), facts.product, facts, assess_mysql(facts))
    if dialect == "postgres":
        settings = ReplicationSettings(*engine.replication_settings())  # type: ignore[attr-defined]
        return FailoverCheck(ledger.describe(), "PostgreSQL", settings, assess(settings))
    note = Finding(Severity.OK, "SQLite: the ledger is a file on one host; there is no replication to fail over to")
    return FailoverCheck(ledger.describe(), "SQLite", None, (note,))
