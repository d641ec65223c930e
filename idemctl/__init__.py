"""idemctl: the server side of the Idempotency-Key contract.

>>> from idemctl import Ledger, Policy
>>> ledger = Ledger.open(":memory:", policy=Policy(pending_ttl_ms=60_000))  # or a path, or postgresql://
>>> ledger.init().action.value
'created'
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from .errors import (
    AnswerNotStoredError,
    CallInProgressError,
    IdemctlError,
    KeyReusedError,
    LedgerUnavailableError,
    PolicyError,
    StorageError,
)
from .fingerprint import fingerprint, is_valid_key
from .ledger import Ledger, wall_clock_ms
from .outcomes import (
    Answer,
    Completion,
    Event,
    FencedEvent,
    Outcome,
    Reservation,
    RowView,
    State,
    Stats,
    Status,
    StoredRow,
    SweepResult,
    Ticket,
)
from .policy import Policy
from .schema import SCHEMA_VERSION

try:
    __version__ = version("idemctl")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"

# The front door, its policy, what it returns and the errors an app catches.
# Every other error is in idemctl.errors, every other result in idemctl.outcomes.
__all__ = [
    "SCHEMA_VERSION",
    "Answer",
    "AnswerNotStoredError",
    "CallInProgressError",
    "Completion",
    "Event",
    "FencedEvent",
    "IdemctlError",
    "KeyReusedError",
    "Ledger",
    "LedgerUnavailableError",
    "Outcome",
    "Policy",
    "PolicyError",
    "Reservation",
    "RowView",
    "State",
    "Stats",
    "Status",
    "StorageError",
    "StoredRow",
    "SweepResult",
    "Ticket",
    "__version__",
    "fingerprint",
    "is_valid_key",
    "wall_clock_ms",
]
