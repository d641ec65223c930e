"""Request fingerprints and key validation, exactly as the recipe computes them."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping

from .errors import InvalidBodyError, InvalidKeyError
from .policy import DEFAULT_FINGERPRINT_HEADERS

HeadersLike = Mapping[str, str] | Iterable[tuple[str, str]]

# \Z, not $: Python's $ also matches before a trailing newline, which would
# let "abc\n" through where the recipe's JavaScript pattern rejects it.
_KEY_PATTERN = re.compile(r"[\x20-\x7e]{1,255}\Z")

# Fetch's Headers trims HTTP whitespace only; str.strip() would also eat
# vertical tabs, form feeds and Unicode spaces and change the fingerprint.
_HTTP_WHITESPACE = " \t\r\n"


def is_valid_key(key: object) -> bool:
    """Whether `key` is 1-255 characters, each 0x20-0x7E, as a whole string.

    >>> is_valid_key("550e8400-e29b-41d4-a716-446655440000"), is_valid_key("abc\\n")
    (True, False)
    """
    return isinstance(key, str) and _KEY_PATTERN.match(key) is not None


def check_key(key: object) -> None:
    """Raise InvalidKeyError unless `key` is a valid Idempotency-Key.

    >>> check_key("order-42")
    >>> check_key("order 42\\n")
    Traceback (most recent call last):
    ...
    idemctl.errors.InvalidKeyError: invalid Idempotency-Key 'order 42\\n': must be 1-255 printable ASCII characters
    """
    if not is_valid_key(key):
        raise InvalidKeyError(f"invalid Idempotency-Key {key!r}: must be 1-255 printable ASCII characters")


def header_pairs(headers: HeadersLike | None) -> list[tuple[str, str]]:
    """Headers as a list of (name, value) pairs in received order."""
    if headers is None:
        return []
    if isinstance(headers, Mapping):
        return [(str(k), str(v)) for k, v in headers.items()]
    return [(str(k), str(v)) for k, v in headers]


def header_values(headers: HeadersLike | None, names: Iterable[str]) -> dict[str, str | None]:
    """Fetch-style lookup: each wanted name (lower case) maps to its values,
    each trimmed of HTTP whitespace and joined with ", ", or None when absent."""
    wanted = {n.lower(): [] for n in names}  # type: dict[str, list[str]]
    for name, value in header_pairs(headers):
        bucket = wanted.get(name.lower())
        if bucket is not None:
            bucket.append(value.strip(_HTTP_WHITESPACE))
    return {n: (", ".join(v) if v else None) for n, v in wanted.items()}


def as_body_bytes(body: object, what: str = "body") -> bytes:
    """Accept bytes-like bodies only: decoding or re-encoding would change the
    fingerprint of binary payloads."""
    if isinstance(body, bytes):
        return body
    if isinstance(body, (bytearray, memoryview)):
        return bytes(body)
    raise InvalidBodyError(f"{what} must be bytes, got {type(body).__name__}")


def fingerprint(
    method: str,
    path_and_query: str,
    headers: HeadersLike | None,
    body: bytes,
    names: Iterable[str] = DEFAULT_FINGERPRINT_HEADERS,
) -> str:
    """sha256 of "METHOD\\nPATH_AND_QUERY\\nname:value\\n..." followed by the raw body.

    `path_and_query` is taken verbatim; headers outside `names` never count.

    >>> fingerprint("POST", "/orders", [], b"")
    'fc4d6d6663d197e95ef43ecc071614db7227f117beb78b985980d692380c7654'
    """
    raw = as_body_bytes(body)
    names = tuple(n.lower() for n in names)
    values = header_values(headers, names)
    lines = [method.upper(), path_and_query]
    lines.extend(f"{n}:{values[n] or ''}" for n in names)
    digest = hashlib.sha256("\n".join(lines).encode("utf-8") + b"\n")
    digest.update(raw)
    return digest.hexdigest()


_JSON_TYPE = re.compile(r"^\s*application/(?:[\w.+-]+\+)?json\s*(?:;|$)", re.IGNORECASE)


def fingerprint_body(
    body: bytes, headers: HeadersLike | None, mode: str = "raw", ignore: Iterable[str] = ()
) -> tuple[bytes, str]:
    """The bytes a request's fingerprint covers, and which form was used.

    "raw" (the recipe's rule) is the body as received. "json" fingerprints a
    JSON body (by its Content-Type) in canonical form, so key order and
    whitespace do not matter, leaving out the `ignore` fields (dotted paths
    into nested objects); a body that is not JSON stays raw.

    >>> fingerprint_body(b'{"b": 1, "a": {"ts": 9, "x": 2}}', {"content-type": "application/json"}, "json", ["a.ts"])
    (b'{"a":{"x":2},"b":1}', 'json')
    >>> fingerprint_body(b"not json", {"content-type": "application/json"}, "json")
    (b'not json', 'raw (not valid JSON)')
    """
    if mode != "json":
        return body, "raw"
    content_type = header_values(headers, ["content-type"])["content-type"] or ""
    if not _JSON_TYPE.match(content_type):
        return body, "raw (not a JSON content type)"
    try:
        value = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return body, "raw (not valid JSON)"
    for path in ignore:
        _drop(value, path.split("."))
    try:
        canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:  # NaN or Infinity: not JSON a client could mean exactly
        return body, "raw (not valid JSON)"
    return canonical.encode("utf-8"), "json"


def _drop(value: object, path: list[str]) -> None:
    if not isinstance(value, dict) or not path:
        return
    head, rest = path[0], path[1:]
    if not rest:
        value.pop(head, None)
    else:
        _drop(value.get(head), rest)
