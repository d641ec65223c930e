"""Where copying between ledgers was first importable from; it lives in
`idemctl.operations.copying` now, and this path keeps working.

>>> DEFAULT_COPY_BATCH
500
"""

from __future__ import annotations

from .operations.copying import (
    DEFAULT_COPY_BATCH,
    MAX_COPY_BATCH,
    CopyConflict,
    CopyProgress,
    CopyResult,
    KeptReason,
    KeptRow,
    copy_ledger,
    source_is_newer,
)

__all__ = [
    "DEFAULT_COPY_BATCH",
    "MAX_COPY_BATCH",
    "CopyConflict",
    "CopyProgress",
    "CopyResult",
    "KeptReason",
    "KeptRow",
    "copy_ledger",
    "source_is_newer",
]
