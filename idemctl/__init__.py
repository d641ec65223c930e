"""idemctl: the server side of the Idempotency-Key contract.

>>> from idemctl import Ledger, Policy
>>> ledger = Ledger.open("idempotency.db", policy=Policy())  # doctest: +SKIP
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from .errors import (
    ConnectionFailedError,
    DatabaseLockedError,
    IdemctlError,
    InvalidBodyError,
    InvalidKeyError,
    InvalidPrincipalError,
    InvalidRequestError,
    LedgerNotFoundError,
    LedgerUnavailableError,
    MalformedRowError,
    NotADatabaseError,
    PolicyError,
    ReadOnlyDatabaseError,
    SchemaMissingError,
    SchemaOutdatedError,
    SchemaTooNewError,
    StorageError,
)
from .fingerprint import fingerprint, is_valid_key
from .ledger import Ledger, wall_clock_ms
from .outcomes import (
    Answer,
    Completion,
    FencedEvent,
    InitAction,
    InitResult,
    Outcome,
    PurgeOutcome,
    PurgeResult,
    Reservation,
    RowView,
    State,
    Stats,
    Status,
    StoredRow,
    SweepResult,
)
from .policy import Policy
from .schema import SCHEMA_VERSION

try:
    __version__ = version("idemctl")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"

__all__ = [
    "Answer",
    "Completion",
    "ConnectionFailedError",
    "DatabaseLockedError",
    "FencedEvent",
    "IdemctlError",
    "InitAction",
    "InitResult",
    "InvalidBodyError",
    "InvalidKeyError",
    "InvalidPrincipalError",
    "InvalidRequestError",
    "Ledger",
    "LedgerNotFoundError",
    "LedgerUnavailableError",
    "MalformedRowError",
    "NotADatabaseError",
    "Outcome",
    "Policy",
    "PolicyError",
    "PurgeOutcome",
    "PurgeResult",
    "ReadOnlyDatabaseError",
    "Reservation",
    "RowView",
    "SCHEMA_VERSION",
    "SchemaMissingError",
    "SchemaOutdatedError",
    "SchemaTooNewError",
    "State",
    "Stats",
    "Status",
    "StorageError",
    "StoredRow",
    "SweepResult",
    "fingerprint",
    "is_valid_key",
    "wall_clock_ms",
    "__version__",
]
