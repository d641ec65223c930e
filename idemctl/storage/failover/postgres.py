"""What `idemctl doctor` checks on PostgreSQL: whether the server the ledger
writes to keeps acknowledged completions across a failover
(docs/postgres.md, "High availability").

With asynchronous replication a standby can be promoted without the last
completions its primary acknowledged; a retry then finds no row (or a
pending one) and runs the mutation again. Synchronous replication
(`synchronous_standby_names` set, `synchronous_commit` on or remote_apply)
acknowledges a completion only once a standby holds it. Nothing here needs
the driver: the engine reads the settings (`PostgresEngine.failover_facts`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .findings import Finding, Severity

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

    product: ClassVar[str] = "PostgreSQL"

    def sync_states(self) -> list[str]:
        return [s.rpartition("=")[2] for s in self.standbys]

    def assess(self) -> tuple[Finding, ...]:
        """What these settings mean at a failover (see :func:`assess`)."""
        return assess(self)

    def document(self) -> dict[str, Any]:
        """The settings as `idemctl doctor --json` shows them.

        >>> ReplicationSettings("on", "*", False, ("replica1=sync",)).document()["standbys"]
        ['replica1=sync']
        """
        return {
            "synchronous_commit": self.synchronous_commit,
            "synchronous_standby_names": self.synchronous_standby_names,
            "in_recovery": self.in_recovery,
            "standbys": list(self.standbys),
        }


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
