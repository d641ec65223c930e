"""What gets stored for an answer, and how stored rows turn back into answers.

Replays go through `from_stored`; the first caller's answer is
`ToStore.answer`, built from exactly the columns stored (the same header
pairs, already checked, and the same bytes), so the two cannot differ by a
byte: the tests compare them for every shape of answer."""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .errors import InvalidResponseError
from .fingerprint import HeadersLike, as_body_bytes, picked_headers
from .outcomes import quick_init
from .policy import Policy

NULL_BODY_STATUSES = frozenset({204, 205, 304})
OVERSIZE_STATUS = 500

# Every header name idemctl itself emits is lower-case, as stored answers'
# names are (the allowlist is matched and stored lower-case).
JSON_CONTENT_TYPE = ("content-type", "application/json")

Headers = tuple[tuple[str, str], ...]

log = logging.getLogger("idemctl")

# RFC 9110 §5.1 field-name (token) and §5.5 field-value characters: the same
# sets gunicorn enforces on responses (it answers 500 for anything else), and
# all latin-1, as PEP 3333 requires. CR, LF and NUL are the response-splitting
# ones; the rest would only make every replay fail.
_FIELD_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*\Z")
_SPLITTING = re.compile(r"[\r\n\x00]")
_LOGGED_CHARS = 200  # a dropped value is quoted in the log up to this many characters
# Pairs already found sendable: most answers repeat the same few headers
# (content-type), and every replay checks its row's again. Bounded: emptied
# when full. Only str pairs that passed every check are ever added.
_SENDABLE: set[tuple[str, str]] = set()
_SENDABLE_MAX = 1024


# Compact separators: identical to the recipe's JSON.stringify output, so
# rows and error bodies are byte-compatible with the Worker's. Built once:
# json.dumps with any option builds a new encoder on every call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


# The JSON string encoder _ENCODER uses (ensure_ascii=False).
_string = json.encoder.encode_basestring


def _dumps(payload: object) -> str:
    return _ENCODER.encode(payload)


@dataclass(frozen=True)
class OversizeBody:
    """An answer body that outgrew the cap while it was captured: only its
    size was kept, and it is stored as the oversize sentinel."""

    size: int


@quick_init
@dataclass(frozen=True)
class ToStore:
    """The three response columns of a completed row, and the answer they
    replay as."""

    status: int
    body: str | bytes | None  # TEXT for valid UTF-8, BLOB otherwise, NULL when over the cap
    headers_json: str
    oversize: bool
    # Which cap an oversize answer went over: "body" or "headers" ("" when none).
    over_cap: str = ""
    # What `from_stored` rebuilds from these columns, kept from building
    # them: the first answer then costs no JSON decoding and no second check
    # of every header (the pairs in `headers_json` passed `header_problem`).
    wire_headers: Headers = ()
    wire_body: bytes = b""

    @property
    def answer(self) -> tuple[int, Headers, bytes]:
        """The answer every replay of this row sends (`from_stored` of its columns).

        >>> stored = to_store(201, {"location": "/orders/7"}, b"made", Policy())
        >>> stored.answer == from_stored(stored.status, stored.body, stored.headers_json)
        True
        """
        if self.oversize:
            return not_stored()
        body = b"" if self.status in NULL_BODY_STATUSES else self.wire_body
        return self.status, self.wire_headers, body


def header_problem(name: object, value: object) -> str | None:
    """Why a header may not be stored or sent, or None when it may.

    >>> header_problem("location", "/x\\r\\nSet-Cookie: admin=1")
    'its value contains CR, LF or NUL'
    >>> header_problem("location", "/orders/42") is None
    True
    """
    if type(name) is str and type(value) is str and (name, value) in _SENDABLE:
        return None
    if not isinstance(name, str) or not _FIELD_NAME.match(name):
        return "its name is not a valid HTTP field name"
    if isinstance(value, str) and _FIELD_VALUE.match(value):
        # A valid value has no CR, LF or NUL either (they are not field-value characters).
        if type(name) is str and type(value) is str:  # a subclass could hash or compare its own way
            if len(_SENDABLE) >= _SENDABLE_MAX:
                _SENDABLE.clear()
            _SENDABLE.add((name, value))
        return None
    if not isinstance(value, str):
        return f"its value is a JSON {_json_type(value)}, not a string"
    if _SPLITTING.search(value):
        return "its value contains CR, LF or NUL"
    if not _FIELD_VALUE.match(value):
        return "its value has characters HTTP does not allow in a field value"
    return None


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _quoted(value: object) -> str:
    # ascii() escapes every control, format and non-ASCII character, so the
    # log line can neither split nor carry terminal escapes. A stored value
    # that is not a string is shown as the JSON it was (5, null, [...]).
    if not isinstance(value, str):
        return json.dumps(value, ensure_ascii=True, default=repr)[:_LOGGED_CHARS]
    if len(value) > _LOGGED_CHARS:
        return ascii(value[:_LOGGED_CHARS]) + "..."
    return ascii(value)


def _sendable(
    pairs: Iterable[tuple[object, object]], action: str, row: tuple[str, str] | None
) -> list[tuple[str, str]]:
    """The pairs that may go on the wire, repeats and order kept; each one
    that may not is logged at ERROR."""
    out: list[tuple[str, str]] = []
    for name, value in pairs:
        problem = header_problem(name, value)
        if problem is None:
            out.append((name, value))  # type: ignore[arg-type]  # checked by header_problem
        else:
            _dropped(name, value, problem, action, row)
    return out


def _dropped(name: object, value: object, problem: str, action: str, row: tuple[str, str] | None) -> None:
    where = "" if row is None else f" for principal={_quoted(row[0])} key={_quoted(row[1])}"
    log.error("response header %s %s%s: %s: %s", _quoted(name), action, where, problem, _quoted(value))


def to_store(
    status: int,
    headers: HeadersLike | None,
    body: object,
    policy: Policy,
    *,
    row: tuple[str, str] | None = None,
) -> ToStore:
    """Apply the replayable-header allowlist and the body cap. A header that
    may not be sent (see `header_problem`) is dropped and logged at ERROR;
    `row`, the (principal, key) being completed, only names it in that log."""
    if isinstance(body, OversizeBody):
        body, oversize = b"", True
    else:
        oversize = False
    if isinstance(body, str):
        body = body.encode("utf-8")
    raw = as_body_bytes(body, "response body")
    if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 999:
        raise InvalidResponseError(f"response status must be an integer 100-999, got {status!r}")
    wire_headers, headers_json = _replayable(headers, policy.replayable_headers, row)
    if len(headers_json.encode("utf-8")) > policy.header_cap_bytes:
        # Like an oversize body: nothing partial is stored, replays fail loudly.
        return ToStore(OVERSIZE_STATUS, None, "{}", True, "headers")
    if oversize or len(raw) > policy.body_cap_bytes:
        # Never store a truncated body: replays fail loudly with a 500 instead.
        return ToStore(OVERSIZE_STATUS, None, headers_json, True, "body", wire_headers)
    column: str | bytes
    try:
        column = raw.decode("utf-8")
    except UnicodeDecodeError:
        column = raw
    return ToStore(status, column, headers_json, False, "", wire_headers, raw)


def _replayable(
    headers: HeadersLike | None, names: tuple[str, ...], row: tuple[str, str] | None
) -> tuple[Headers, str]:
    """The allowlisted headers that may be sent, as (name, value) pairs, and
    the `response_headers` column that replays as exactly those pairs, made
    in one pass over the headers (`names` lower-case, as a Policy's are).

    Names come in the allowlist's order, every field of a repeated header
    kept separately in the order sent (never folded: a folded Set-Cookie is
    a different cookie), each value trimmed of surrounding HTTP whitespace.
    A pair that may not be sent (see `header_problem`) is left out and
    logged at ERROR.

    >>> sent = [("Set-Cookie", "a=1"), ("Location", "/x"), ("set-cookie", "b=2")]
    >>> pairs, column = _replayable(sent, ("location", "set-cookie"), None)
    >>> pairs
    (('location', '/x'), ('set-cookie', 'a=1'), ('set-cookie', 'b=2'))
    >>> column
    '{"location":"/x","set-cookie":["a=1","b=2"]}'
    """
    found = picked_headers(headers, names)
    pairs: list[tuple[str, str]] = []
    kept: dict[str, list[str]] = {}
    for name in names:
        for value in found.get(name, ()):
            # The memo first: a pair once found sendable costs no call.
            if (name, value) in _SENDABLE or (problem := header_problem(name, value)) is None:
                pairs.append((name, value))
                if name in kept:
                    kept[name].append(value)
                else:
                    kept[name] = [value]
            else:
                _dropped(name, value, problem, "not stored", row)
    return tuple(pairs), headers_to_json(kept)


def headers_to_json(grouped: Mapping[str, Sequence[str]]) -> str:
    """The `response_headers` column: the recipe's JSON object of name to
    value, and a JSON array of the values for a header sent more than once
    (the recipe's rows, one string per name, read back unchanged).

    >>> headers_to_json({"content-type": ["text/plain"], "set-cookie": ["a=1", "b=2"]})
    '{"content-type":"text/plain","set-cookie":["a=1","b=2"]}'
    """
    # What _dumps writes for this object of strings, without building an
    # encoder for it on every completion: the string encoder is the one it uses.
    fields = [
        f"{_string(name)}:{_string(values[0]) if len(values) == 1 else '[' + ','.join(map(_string, values)) + ']'}"
        for name, values in grouped.items()
    ]
    return "{" + ",".join(fields) + "}"


def stored_header_pairs(headers_json: str | None) -> list[tuple[str, object]]:
    """The stored `response_headers` object as (name, JSON value) pairs,
    unchecked, one pair per field (a JSON array of values is a header sent
    more than once); [] when the column is empty or not a JSON object.

    >>> stored_header_pairs('{"location":"/x","set-cookie":["a=1","b=2"]}')
    [('location', '/x'), ('set-cookie', 'a=1'), ('set-cookie', 'b=2')]
    """
    try:
        parsed = json.loads(headers_json) if headers_json else {}
    except ValueError:
        parsed = {}
    if not isinstance(parsed, dict):
        return []
    pairs: list[tuple[str, object]] = []
    for name, value in parsed.items():
        if isinstance(value, list):
            pairs.extend((name, item) for item in value)
        else:
            pairs.append((name, value))
    return pairs


def from_stored(
    status: int | None,
    body: str | bytes | None,
    headers_json: str | None,
    *,
    row: tuple[str, str] | None = None,
) -> tuple[int, Headers, bytes]:
    """Rebuild (status, headers, body) from the stored columns. Rows written
    by other programs are not trusted: a header that may not be sent (see
    `header_problem`) is left out and logged at ERROR, on every replay.

    The oversize sentinel (a 500 with no body) is answered as the ledger's
    own error (`not_stored`), never with the app's headers: they describe a
    body that is not there (a client would parse its empty JSON).

    >>> from_stored(201, "made", '{"location":"/orders/7"}')
    (201, (('location', '/orders/7'),), b'made')
    >>> from_stored(500, None, '{"content-type":"text/csv","location":"/x"}') == not_stored()
    True
    """
    status = OVERSIZE_STATUS if status is None else int(status)
    if status == OVERSIZE_STATUS and body is None:
        return not_stored()
    headers = _replayed_headers(headers_json, row)
    if status in NULL_BODY_STATUSES or body is None:
        raw = b""
    elif isinstance(body, str):
        raw = body.encode("utf-8")
    else:
        raw = bytes(body)
    return status, headers, raw


# Headers columns every pair of which may be sent, and the pairs they replay
# as: most rows hold one of a few columns (the app's content-type), and every
# replay decoded and checked its row's again. A column with a pair that may
# not be sent is never kept, so it is logged on every replay. Bounded like
# _SENDABLE: emptied when full, and only short columns are kept.
_REPLAYED: dict[str, Headers] = {}
_REPLAYED_MAX = 256
_REPLAYED_LONGEST = 1024


def _replayed_headers(headers_json: str | None, row: tuple[str, str] | None) -> Headers:
    if type(headers_json) is str:  # a subclass could hash or compare its own way
        known = _REPLAYED.get(headers_json)
        if known is not None:
            return known
    pairs = stored_header_pairs(headers_json)
    headers = tuple(_sendable(pairs, "not replayed", row))
    if len(headers) == len(pairs) and type(headers_json) is str and len(headers_json) <= _REPLAYED_LONGEST:
        if len(_REPLAYED) >= _REPLAYED_MAX:
            _REPLAYED.clear()
        _REPLAYED[headers_json] = headers
    return headers


# RFC 9457 problem types: one stable URI per error code, documented in docs/library.md.
PROBLEM_TYPE_PREFIX = "urn:idemctl:problem:"
PROBLEM_CONTENT_TYPE = ("content-type", "application/problem+json")
PROBLEM_TITLES = {
    "idempotency_key_required": "Idempotency-Key required",
    "idempotency_key_invalid": "Idempotency-Key invalid",
    "unauthenticated": "No authenticated principal",
    "idempotency_key_reused": "Idempotency-Key reused for another request",
    "idempotency_key_in_progress": "Request with this Idempotency-Key in progress",
    "idempotency_key_retry": "Retry the request",
    "idempotency_ledger_unavailable": "Idempotency ledger unavailable",
    "content_length_required": "Content-Length required",
    "content_length_invalid": "Content-Length invalid",
    "request_body_too_large": "Request body too large",
    "request_body_incomplete": "Request body incomplete",
    "request_target_too_long": "Request target too long",
    "request_target_invalid": "Request target invalid",
    "idempotency_response_not_stored": "Answer too large to store",
}
_PROBLEM_DETAILS = {
    "idempotency_key_required": "This request needs an Idempotency-Key header.",
    "idempotency_key_reused": "This Idempotency-Key was used for a different request.",
    "idempotency_key_in_progress": "A request with this Idempotency-Key is still running; retry later.",
}


def as_problem(answer: tuple[int, Headers, bytes]) -> tuple[int, Headers, bytes]:
    """One of idemctl's own `{"error": ...}` answers as RFC 9457 problem
    details: `type` (a URI per error), `title`, `status`, `detail`, and the
    members the plain answer carries (`error`, `retry_after_ms`,
    `limit_bytes`). Other headers (Retry-After) are kept.

    >>> status, headers, body = as_problem(reused(Policy()))
    >>> headers[0], json.loads(body)["type"], json.loads(body)["status"]
    (('content-type', 'application/problem+json'), 'urn:idemctl:problem:idempotency_key_reused', 409)
    """
    status, headers, body = answer
    payload = json.loads(body)
    code = str(payload.pop("error"))
    message = payload.pop("message", None) or _PROBLEM_DETAILS.get(code) or PROBLEM_TITLES.get(code, code) + "."
    problem = {
        "type": PROBLEM_TYPE_PREFIX + code,
        "title": PROBLEM_TITLES.get(code, code),
        "status": status,
        "detail": message,
        "error": code,
        **payload,
    }
    kept = tuple((n, v) for n, v in headers if n != "content-type")
    return status, (PROBLEM_CONTENT_TYPE, *kept), _dumps(problem).encode("utf-8")


def is_not_stored(answer: tuple[int, Headers, bytes]) -> bool:
    """Whether `answer` is the oversize sentinel's (see `not_stored`), the
    one answer built from a stored row that is the ledger's own error.

    >>> is_not_stored(not_stored()), is_not_stored((500, (), b""))
    (True, False)
    """
    return answer[0] == OVERSIZE_STATUS and answer[2] == _NOT_STORED_BODY


def json_error(status: int, payload: dict[str, object], extra: Headers = ()) -> tuple[int, Headers, bytes]:
    return status, (JSON_CONTENT_TYPE, *extra), _dumps(payload).encode("utf-8")


def _refusal(status: int, error: str, message: str) -> tuple[int, Headers, bytes]:
    return json_error(status, {"error": error, "message": message})


def key_required() -> tuple[int, Headers, bytes]:
    return json_error(400, {"error": "idempotency_key_required"})


def key_invalid() -> tuple[int, Headers, bytes]:
    return _refusal(400, "idempotency_key_invalid", "Idempotency-Key must be 1-255 printable ASCII characters.")


def key_repeated() -> tuple[int, Headers, bytes]:
    # Several fields, and one value with a comma outside its quotes (the
    # same fields joined by a server or proxy), get this one answer.
    return _refusal(
        400,
        "idempotency_key_invalid",
        "Send exactly one Idempotency-Key: several fields, or a comma outside a quoted key, are a list.",
    )


def unauthenticated() -> tuple[int, Headers, bytes]:
    return _refusal(401, "unauthenticated", "No authenticated principal for this request.")


def reused(policy: Policy) -> tuple[int, Headers, bytes]:
    return json_error(policy.reuse_status, {"error": "idempotency_key_reused"})


def in_progress(policy: Policy, retry_after_ms: int | None = None) -> tuple[int, Headers, bytes]:
    """409 in progress; by default the client is told to come back after a
    whole TTL (the recipe's answer), or after `retry_after_ms`."""
    ms = policy.pending_ttl_ms if retry_after_ms is None else retry_after_ms
    return json_error(
        409,
        {"error": "idempotency_key_in_progress", "retry_after_ms": ms},
        _retry_after(ms),
    )


def _retry_after(ms: int) -> Headers:
    # Whole seconds, rounded up, never 0 (which would invite an instant retry).
    return (("retry-after", str(max(1, math.ceil(ms / 1000)))),)


def retry() -> tuple[int, Headers, bytes]:
    return _refusal(409, "idempotency_key_retry", "Retry the request.")


def unavailable(retry_after_ms: int) -> tuple[int, Headers, bytes]:
    return json_error(
        503,
        {"error": "idempotency_ledger_unavailable", "message": "The idempotency ledger is unavailable; retry later."},
        _retry_after(retry_after_ms),
    )


# -- refusals of the WSGI middleware: the request body could not be read safely,
# so nothing was claimed and the client may fix the request and retry.


def length_required() -> tuple[int, Headers, bytes]:
    return _refusal(411, "content_length_required", "A request body needs a Content-Length header.")


def content_length_invalid() -> tuple[int, Headers, bytes]:
    return _refusal(400, "content_length_invalid", "Content-Length must be a non-negative decimal integer.")


def body_too_large(limit_bytes: int) -> tuple[int, Headers, bytes]:
    return json_error(
        413,
        {
            "error": "request_body_too_large",
            "message": f"The request body exceeds {limit_bytes} bytes.",
            "limit_bytes": limit_bytes,
        },
    )


# The answer of an oversize sentinel: what the app answered was over a cap,
# so nothing of it was stored; the request did run, once, and never runs
# again under this key.
_NOT_STORED_BODY = _dumps(
    {
        "error": "idempotency_response_not_stored",
        "message": "The request was processed, but its response was too large to store, "
        "so it cannot be replayed; it will not run again under this Idempotency-Key.",
    }
).encode("utf-8")


def not_stored() -> tuple[int, Headers, bytes]:
    """What the first caller and every retry of an oversize sentinel get:
    500 with the ledger's JSON error body (problem details with
    ``Policy(problem_details=True)``, as the other refusals).

    >>> not_stored()[:2]
    (500, (('content-type', 'application/json'),))
    """
    return OVERSIZE_STATUS, (JSON_CONTENT_TYPE,), _NOT_STORED_BODY


def body_incomplete() -> tuple[int, Headers, bytes]:
    return _refusal(400, "request_body_incomplete", "The request body ended before Content-Length bytes arrived.")


def target_too_long(limit_bytes: int) -> tuple[int, Headers, bytes]:
    """414: a request target (path and query) over the ledger's bound, which
    it neither hashes nor logs whole."""
    return _refusal(414, "request_target_too_long", f"The request target is longer than {limit_bytes} bytes.")


def target_invalid() -> tuple[int, Headers, bytes]:
    """400: a method or target with control characters, which HTTP cannot carry."""
    return _refusal(400, "request_target_invalid", "The method or request target holds a control character.")


def principal_unusable() -> tuple[int, Headers, bytes]:
    """401: the app's auth layer resolved a principal the ledger cannot hold
    exactly; no principal is as good as none (SPEC: never a shared namespace)."""
    return _refusal(401, "unauthenticated", "The authenticated principal cannot be used as an idempotency namespace.")
