"""What the ledger accepts as a principal and a request line, checked before
any statement."""

from __future__ import annotations

import re

from ..errors import InvalidPrincipalError, InvalidRequestError

# One limit for every engine, checked before any statement: the primary key
# (principal, key) must fit PostgreSQL's btree entry (about 2.7 kB, whatever
# compression does) and a 4-bytes-a-character VARCHAR index, so that no
# engine turns a long principal into a storage error that a client retries.
MAX_PRINCIPAL_BYTES = 512
# Paths are hashed, never stored; the bound keeps log lines and events sane.
MAX_PATH_BYTES = 65_536


def check_principal(principal: object) -> None:
    """A principal is stored and compared exactly: it must be a non-empty
    str that encodes as UTF-8 in at most MAX_PRINCIPAL_BYTES (512) bytes and
    holds no NUL (PostgreSQL text cannot).

    >>> check_principal("acct_1")
    >>> check_principal(5)
    Traceback (most recent call last):
    ...
    TypeError: principal must be a str, got int
    """
    if not isinstance(principal, str):
        raise TypeError(f"principal must be a str, got {type(principal).__name__}")
    if principal == "":
        raise InvalidPrincipalError("principal must not be empty")
    try:
        size = len(principal.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidPrincipalError(f"principal {principal!r} is not valid UTF-8 (it holds a lone surrogate)") from None
    if size > MAX_PRINCIPAL_BYTES:
        raise InvalidPrincipalError(
            f"principal {principal[:40]!r}... is {size} bytes in UTF-8; the most is {MAX_PRINCIPAL_BYTES}"
        )
    if "\x00" in principal:
        raise InvalidPrincipalError(f"principal {principal!r} holds a NUL character")


# C0 controls and DEL: one regex scan, not a Python step per character.
_has_control = re.compile(r"[\x00-\x1f\x7f]").search


def check_request_line(method: object, path_and_query: object) -> None:
    """HTTP cannot carry a control character in a method or path; refusing
    them keeps two different requests from sharing a fingerprint (the
    fingerprint joins its lines with newlines).

    >>> check_request_line("POST", "/orders?x=1")
    >>> check_request_line("POST", "/a\\ncontent-type:x")
    Traceback (most recent call last):
    ...
    idemctl.errors.InvalidRequestError: path '/a\\ncontent-type:x' holds a control character
    """
    if not isinstance(method, str) or not method or _has_control(method) or " " in method:
        raise InvalidRequestError(f"method {method!r} is not an HTTP method token")
    if not isinstance(path_and_query, str):
        raise InvalidRequestError(f"path must be a str, got {type(path_and_query).__name__}")
    if _has_control(path_and_query):
        raise InvalidRequestError(f"path {path_and_query!r} holds a control character")
    too_long = len(path_and_query) > MAX_PATH_BYTES // 4
    if too_long and len(path_and_query.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise InvalidRequestError(f"path {path_and_query[:40]!r}... is longer than {MAX_PATH_BYTES} bytes")
