"""The gate, kept importable here: it lives in :mod:`idemctl.exchange.gate`
(the body rules in :mod:`idemctl.exchange.body`).

>>> from idemctl.gate import Gate
>>> Gate.__module__
'idemctl.exchange.gate'
"""

from __future__ import annotations

from .exchange.body import (
    BodyRefused,
    check_complete,
    check_read,
    declared_length,
    incomplete,
    length_required,
)
from .exchange.gate import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_UNAVAILABLE_RETRY_AFTER_MS,
    KEY_HEADER,
    Delivery,
    Gate,
    GatedMiddleware,
    adapter_gate,
    check_options,
    check_principal_source,
    release_wanted,
    replied,
)

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_UNAVAILABLE_RETRY_AFTER_MS",
    "KEY_HEADER",
    "BodyRefused",
    "Delivery",
    "Gate",
    "GatedMiddleware",
    "adapter_gate",
    "check_complete",
    "check_options",
    "check_principal_source",
    "check_read",
    "declared_length",
    "incomplete",
    "length_required",
    "release_wanted",
    "replied",
]
