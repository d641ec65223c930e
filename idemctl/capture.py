"""The bounded capture, kept importable here: it lives in
:mod:`idemctl.exchange.capture`.

>>> from idemctl.capture import Capture
>>> Capture.__module__
'idemctl.exchange.capture'
"""

from __future__ import annotations

from .exchange.capture import Capture, CaptureError

__all__ = ["Capture", "CaptureError"]
