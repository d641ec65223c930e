"""Where `check_failover` was first documented; it lives in
`idemctl.operations.replication` now, and this path keeps working.

>>> from idemctl import Ledger
>>> check_failover(Ledger.open(":memory:")).ok
True
"""

from __future__ import annotations

from .operations.replication import FailoverCheck, Finding, ReplicationSettings, Severity, assess, check_failover

__all__ = ["FailoverCheck", "Finding", "ReplicationSettings", "Severity", "assess", "check_failover"]
