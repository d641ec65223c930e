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
    ConnectionFailedError,
    DatabaseLockedError,
    IdemctlError,
    InvalidBodyError,
    InvalidKeyError,
    InvalidPrincipalError,
    InvalidRequestError,
    InvalidResponseError,
    KeyReusedError,
    LedgerNotFoundError,
    LedgerUnavailableError,
    MalformedRowError,
    NotADatabaseError,
    PolicyError,
    ReadOnlyDatabaseError,
    ResultNotSerializableError,
    ResultNotStoredError,
    ResultTooLargeError,
    SchemaMissingError,
    SchemaOutdatedError,
    SchemaTooNewError,
    StorageError,
    UnserializableArgumentsError,
)
from .fingerprint import fingerprint, is_valid_key
from .ledger import Ledger, wall_clock_ms
from .outcomes import (
    Answer,
    Completion,
    Drained,
    DrainStop,
    Event,
    FencedEvent,
    InitAction,
    InitResult,
    Outcome,
    Prediction,
    PurgeOutcome,
    PurgeResult,
    Reservation,
    RowView,
    State,
    Stats,
    Status,
    StoredRow,
    SweepResult,
    Ticket,
    Verdict,
)
from .policy import Policy
from .schema import SCHEMA_VERSION

try:
    __version__ = version("idemctl")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"

__all__ = [
    "SCHEMA_VERSION",
    "Answer",
    "AnswerNotStoredError",
    "CallInProgressError",
    "Completion",
    "ConnectionFailedError",
    "DatabaseLockedError",
    "DrainStop",
    "Drained",
    "Event",
    "FencedEvent",
    "IdemctlError",
    "InitAction",
    "InitResult",
    "InvalidBodyError",
    "InvalidKeyError",
    "InvalidPrincipalError",
    "InvalidRequestError",
    "InvalidResponseError",
    "KeyReusedError",
    "Ledger",
    "LedgerNotFoundError",
    "LedgerUnavailableError",
    "MalformedRowError",
    "NotADatabaseError",
    "Outcome",
    "Policy",
    "PolicyError",
    "Prediction",
    "PurgeOutcome",
    "PurgeResult",
    "ReadOnlyDatabaseError",
    "Reservation",
    "ResultNotSerializableError",
    "ResultNotStoredError",
    "ResultTooLargeError",
    "RowView",
    "SchemaMissingError",
    "SchemaOutdatedError",
    "SchemaTooNewError",
    "State",
    "Stats",
    "Status",
    "StorageError",
    "StoredRow",
    "SweepResult",
    "Ticket",
    "UnserializableArgumentsError",
    "Verdict",
    "__version__",
    "fingerprint",
    "is_valid_key",
    "wall_clock_ms",
]
