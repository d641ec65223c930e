"""Cloudflare D1 through its HTTP API (``d1://ACCOUNT_ID/DATABASE_ID``): the
recipe's own database, administered with the same CLI and library."""

from .engine import D1Engine
from .errors import D1AccountError, D1DatabaseNotFoundError, D1RateLimitedError, D1TimeoutError, D1TokenRefusedError
from .location import D1Location, is_d1_url

__all__ = [
    "D1AccountError",
    "D1DatabaseNotFoundError",
    "D1Engine",
    "D1Location",
    "D1RateLimitedError",
    "D1TimeoutError",
    "D1TokenRefusedError",
    "is_d1_url",
]
