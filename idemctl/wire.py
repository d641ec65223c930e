"""An Answer on the wire, kept importable here: it lives in
:mod:`idemctl.exchange.wire`.

>>> from idemctl.wire import wire_headers
>>> wire_headers.__module__
'idemctl.exchange.wire'
"""

from __future__ import annotations

from .exchange.wire import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_UNAVAILABLE_RETRY_AFTER_MS,
    NO_LENGTH_STATUSES,
    REPLAYED_HEADER,
    wire_headers,
)

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_UNAVAILABLE_RETRY_AFTER_MS",
    "NO_LENGTH_STATUSES",
    "REPLAYED_HEADER",
    "wire_headers",
]
