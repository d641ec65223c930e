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


class Findings(list[Finding]):
    """An assessment's findings in the making, in the order `doctor` shows them.

    >>> found = Findings()
    >>> found.note("no replica is connected"); found.ok_first("one server"); found.warned
    False
    >>> [f.severity.value for f in found]
    ['ok', 'note']
    """

    def warning(self, message: str) -> None:
        self.append(Finding(Severity.WARNING, message))

    def note(self, message: str) -> None:
        self.append(Finding(Severity.NOTE, message))

    def ok_first(self, message: str) -> None:
        """The verdict that the setup keeps the promise, shown above the notes."""
        self.insert(0, Finding(Severity.OK, message))

    @property
    def warned(self) -> bool:
        return any(f.severity is Severity.WARNING for f in self)
