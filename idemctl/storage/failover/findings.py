"""A finding of `idemctl doctor`: how much it matters, and what it says."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Severity(enum.Enum):
    """How much a finding of `idemctl doctor` matters to the promise."""

    OK = "ok"
    NOTE = "note"
    WARNING = "warning"


@dataclass(frozen=True)
class Finding:
    """One line of `idemctl doctor`'s verdict on the replication setup.

    >>> Finding(Severity.WARNING, "no synchronous standby").severity.value
    'warning'
    """

    severity: Severity
    message: str
