"""D1's answers as idemctl's errors: the API's error codes (a refused token,
an account or a database it cannot reach) and D1's SQL error texts. None of
them says "cannot reach" unless nothing answered."""

from __future__ import annotations

from ...errors import (
    ConnectionFailedError,
    DatabaseLockedError,
    LedgerNotFoundError,
    LedgerUnavailableError,
    StorageError,
)
from ..server import database_error, missing_table
from .location import TOKEN_VARIABLE


class D1TokenRefusedError(StorageError):
    """Cloudflare refused the API token (wrong, expired, or without D1 rights)."""


class D1AccountError(StorageError):
    """The token cannot reach the account in the URL (a wrong account id, or
    a token made for another account)."""


class D1DatabaseNotFoundError(LedgerNotFoundError):
    """No D1 database of that id in the account."""


class D1RateLimitedError(LedgerUnavailableError):
    """Cloudflare kept answering 429 after every retry."""


class D1TimeoutError(LedgerUnavailableError):
    """A call got no answer within the engine's timeout."""


# Cloudflare's API error codes (the envelope's errors[].code).
_TOKEN_CODES = {6003, 6111, 9106, 9109, 10000, 10001}
_ACCOUNT_CODES = {7403}
_DATABASE_CODES = {7404}
_ROUTE_CODES = {7003}


def api_error(where: str, status: int, code: int | None, message: str) -> StorageError:
    """The error for an API answer that is not a statement's own failure.

    >>> str(api_error("d1://a/b", 403, 10000, "Authentication error"))
    'Cloudflare refused the API token for d1://a/b (403, code 10000: Authentication error): \
give a token with D1 edit rights in CLOUDFLARE_API_TOKEN'
    """
    said = f"({status}, code {code}: {message})"
    if code in _TOKEN_CODES or (code is None and status == 401):
        return D1TokenRefusedError(
            f"Cloudflare refused the API token for {where} {said}: give a token with D1 edit rights in {TOKEN_VARIABLE}"
        )
    if code in _ACCOUNT_CODES:
        return D1AccountError(f"the API token cannot reach the account of {where} {said}: check the account id")
    if code in _DATABASE_CODES or code in _ROUTE_CODES or (code is None and status == 404):
        return D1DatabaseNotFoundError(where, f"no D1 database at {where} {said}: check the database id")
    if status == 429:
        return D1RateLimitedError(f"D1 at {where} is rate limiting this token {said}; try again later")
    if status >= 500:
        return ConnectionFailedError(f"D1 at {where} failed to answer {said}")
    return StorageError(f"D1 at {where} refused the call {said}")


def sql_error(where: str, message: str) -> StorageError:
    """A statement's own failure (code 7500, D1's text).

    >>> type(sql_error("d1://a/b", "D1_ERROR: no such table: idempotency_keys: SQLITE_ERROR")).__name__
    'SchemaMissingError'
    """
    text = message.removeprefix("D1_ERROR: ")
    if "no such table" in text:
        found = missing_table(where, text)
        if found is not None:
            return found
    if "SQLITE_BUSY" in text or "database is locked" in text:
        return DatabaseLockedError(f"{where} is locked by another writer ({text})")
    if "not authorized" in text or "SQLITE_AUTH" in text:
        return StorageError(f"D1 at {where} does not allow this statement ({text})")
    return database_error(where, text)
