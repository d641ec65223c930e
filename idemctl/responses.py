"""What gets stored for an answer, and how stored rows turn back into answers.

The first caller's answer and every replay go through `from_stored`, so they
cannot differ by a byte."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from .fingerprint import HeadersLike, as_body_bytes, header_values
from .policy import Policy

NULL_BODY_STATUSES = frozenset({204, 205, 304})
OVERSIZE_STATUS = 500

JSON_CONTENT_TYPE = ("Content-Type", "application/json")

Headers = tuple[tuple[str, str], ...]


def _dumps(payload: object) -> str:
    # Compact separators: identical to the recipe's JSON.stringify output, so
    # rows and error bodies are byte-compatible with the Worker's.
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class ToStore:
    """The three response columns of a completed row."""

    status: int
    body: str | bytes | None  # TEXT for valid UTF-8, BLOB otherwise, NULL when over the cap
    headers_json: str
    oversize: bool


def to_store(status: int, headers: HeadersLike | None, body: object, policy: Policy) -> ToStore:
    """Apply the replayable-header allowlist and the body cap."""
    if isinstance(body, str):
        body = body.encode("utf-8")
    raw = as_body_bytes(body, "response body")
    if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 999:
        raise ValueError(f"response status must be an integer 100-999, got {status!r}")
    values = header_values(headers, policy.replayable_headers)
    headers_json = _dumps({n: v for n, v in values.items() if v is not None})
    if len(raw) > policy.body_cap_bytes:
        # Never store a truncated body: replays fail loudly with a 500 instead.
        return ToStore(OVERSIZE_STATUS, None, headers_json, True)
    column: str | bytes
    try:
        column = raw.decode("utf-8")
    except UnicodeDecodeError:
        column = raw
    return ToStore(status, column, headers_json, False)


def from_stored(status: int | None, body: str | bytes | None, headers_json: str | None) -> tuple[int, Headers, bytes]:
    """Rebuild (status, headers, body) from the stored columns."""
    status = OVERSIZE_STATUS if status is None else int(status)
    try:
        parsed = json.loads(headers_json) if headers_json else {}
    except ValueError:
        parsed = {}
    headers: Headers = tuple((str(k), str(v)) for k, v in parsed.items()) if isinstance(parsed, dict) else ()
    if status in NULL_BODY_STATUSES or body is None:
        raw = b""
    elif isinstance(body, str):
        raw = body.encode("utf-8")
    else:
        raw = bytes(body)
    return status, headers, raw


def json_error(status: int, payload: dict[str, object], extra: Headers = ()) -> tuple[int, Headers, bytes]:
    return status, (JSON_CONTENT_TYPE, *extra), _dumps(payload).encode("utf-8")


def key_required() -> tuple[int, Headers, bytes]:
    return json_error(400, {"error": "idempotency_key_required"})


def key_invalid() -> tuple[int, Headers, bytes]:
    return json_error(
        400,
        {"error": "idempotency_key_invalid", "message": "Idempotency-Key must be 1-255 printable ASCII characters."},
    )


def unauthenticated() -> tuple[int, Headers, bytes]:
    return json_error(401, {"error": "unauthenticated", "message": "No authenticated principal for this request."})


def reused(policy: Policy) -> tuple[int, Headers, bytes]:
    return json_error(policy.reuse_status, {"error": "idempotency_key_reused"})


def in_progress(policy: Policy) -> tuple[int, Headers, bytes]:
    return json_error(
        409,
        {"error": "idempotency_key_in_progress", "retry_after_ms": policy.pending_ttl_ms},
        (("Retry-After", str(policy.retry_after_seconds)),),
    )


def retry() -> tuple[int, Headers, bytes]:
    return json_error(409, {"error": "idempotency_key_retry", "message": "Retry the request."})


def unavailable(retry_after_ms: int) -> tuple[int, Headers, bytes]:
    return json_error(
        503,
        {"error": "idempotency_ledger_unavailable", "message": "The idempotency ledger is unavailable; retry later."},
        (("Retry-After", str(max(1, math.ceil(retry_after_ms / 1000)))),),
    )


# -- refusals of the WSGI middleware: the request body could not be read safely,
# so nothing was claimed and the client may fix the request and retry.


def length_required() -> tuple[int, Headers, bytes]:
    return json_error(
        411,
        {"error": "content_length_required", "message": "A request body needs a Content-Length header."},
    )


def content_length_invalid() -> tuple[int, Headers, bytes]:
    return json_error(
        400,
        {"error": "content_length_invalid", "message": "Content-Length must be a non-negative decimal integer."},
    )


def body_too_large(limit_bytes: int) -> tuple[int, Headers, bytes]:
    return json_error(
        413,
        {
            "error": "request_body_too_large",
            "message": f"The request body exceeds {limit_bytes} bytes.",
            "limit_bytes": limit_bytes,
        },
    )


def body_incomplete() -> tuple[int, Headers, bytes]:
    return json_error(
        400,
        {"error": "request_body_incomplete", "message": "The request body ended before Content-Length bytes arrived."},
    )
