"""The ledger: the Idempotency-Key contract on top of the SQL store.

`Ledger` is the one front door. Its body is split by job, one module each:
`base` (opening, clock, schema, events, leases), `requests` (begin, finish,
abandon, handle), `steps` (one statement each), `maintenance` (sweep, drain,
copy), `reads` (what operators ask), `shortcuts` (idempotent functions),
`inputs` (what a principal and a request line may hold)."""

from __future__ import annotations

from .base import Clock, wall_clock_ms
from .inputs import MAX_PATH_BYTES, MAX_PRINCIPAL_BYTES, check_principal, check_request_line
from .reads import OperatorReads
from .requests import Mutation, RunResult
from .shortcuts import FunctionShortcuts


class Ledger(FunctionShortcuts, OperatorReads):
    """An idempotency ledger. Safe to share between threads; each thread (and
    each forked process) gets its own database connection.

    >>> ledger = Ledger.open(":memory:")  # a file path or a postgresql:// URL
    >>> ledger.init().describe()
    'created (schema version 3)'
    >>> ledger.handle("acct_1", "key-1", "POST", "/orders", {}, b"{}",
    ...               lambda body: (201, {"content-type": "application/json"}, b'{"id":1}')).status
    201
    """


__all__ = [
    "MAX_PATH_BYTES",
    "MAX_PRINCIPAL_BYTES",
    "Clock",
    "Ledger",
    "Mutation",
    "RunResult",
    "check_principal",
    "check_request_line",
    "wall_clock_ms",
]
