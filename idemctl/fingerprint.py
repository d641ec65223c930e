"""Request fingerprints and key validation, exactly as the recipe computes them."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Container, Iterable, Mapping

from .errors import InvalidBodyError, InvalidKeyError
from .policy import DEFAULT_FINGERPRINT_HEADERS

HeadersLike = Mapping[str, str] | Iterable[tuple[str, str]]

# \Z, not $: Python's $ also matches before a trailing newline, which would
# let "abc\n" through where the recipe's JavaScript pattern rejects it.
_KEY_PATTERN = re.compile(r"[\x20-\x7e]{1,255}\Z")
# RFC 8941 §4.2.3.2 (and RFC 9651, which adds dates and display strings):
# the parameters after an sf-string, each ";" straight after what precedes
# it, spaces allowed only after the ";"; a value is a bare item. They are
# checked, then ignored.
_SF_BARE_ITEM = (
    r"(?:-?[0-9]{1,15}(?:\.[0-9]{1,3})?"  # integer, decimal
    r'|"(?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\[\\"])*"'  # string
    r"|[A-Za-z*][!#$%&'*+\-.^_`|~0-9A-Za-z:/]*"  # token
    r"|:[A-Za-z0-9+/=]*:"  # byte sequence
    r"|\?[01]"  # boolean
    r"|@-?[0-9]{1,15}"  # date
    r'|%"(?:[\x20\x21\x23\x24\x26-\x5b\x5d-\x7e]|%[0-9a-f]{2})*")'  # display string
)
_SF_PARAMETERS = re.compile(r"(?:; *[a-z*][a-z0-9_.*-]*(?:=" + _SF_BARE_ITEM + r")?)*\Z")

# Fetch's Headers trims HTTP whitespace only; str.strip() would also eat
# vertical tabs, form feeds and Unicode spaces and change the fingerprint.
_HTTP_WHITESPACE = " \t\r\n"


def parse_key(value: object) -> str | None:
    r"""The key an ``Idempotency-Key`` value carries, or None when it carries
    none that is valid.

    A value that begins with ``"`` is an RFC 8941 sf-string item, as the
    IETF draft sends it: the key is the string inside (``\"`` and ``\\``
    unescaped); parameters after it (``;name=value``, the ``;`` straight
    after the string, spaces only after it) are checked and ignored;
    anything else after it (a space before the ``;``, a second list
    member), or a string that is not terminated, is invalid. Any other
    value (a bare token, as Stripe's SDKs and the recipe send) is the key
    as it is, but for a comma: HTTP lets a server or proxy join several
    fields into one with commas (RFC 9110 §5.3), so ``t1, t2`` may be two
    fields and is refused (see :func:`is_key_list`); a key holding a comma
    is sent quoted (``"a,b"``). Either way the key is 1-255 characters of
    0x20-0x7E, and it never begins with ``"``: a stored value that begins
    with one is the header as an older writer stored it (see
    :func:`stored_key_identity`).

    >>> parse_key('"8e03978e-40d5-43e8-bc93-6894a57f9324"'), parse_key("order-42")
    ('8e03978e-40d5-43e8-bc93-6894a57f9324', 'order-42')
    >>> parse_key('"a\\"b";v=1'), parse_key('"abc'), parse_key('""'), parse_key("abc\n")
    ('a"b', None, None, None)
    >>> parse_key('"lx"; x=1'), parse_key('"lx" ;x=1'), parse_key('"ly";x=1,"other"'), parse_key("t2, t2")
    ('lx', None, None, None)
    >>> parse_key('"a,b"')
    'a,b'
    """
    if not isinstance(value, str):
        return None
    if value.startswith('"'):
        key = _sf_string(value)
        if key is None or key.startswith('"'):
            return None
    elif "," in value:
        return None
    else:
        key = value
    return key if _KEY_PATTERN.match(key) is not None else None


def is_key_list(value: object) -> bool:
    r"""Whether an ``Idempotency-Key`` value is a list: a comma outside its
    sf-string, as a server that joined several fields (WSGI's environ,
    Django's META) or a client sending a list writes it. Such a value
    carries no one key: it is answered like several fields.

    >>> is_key_list("t2, t2"), is_key_list('"ly";x=1,"other"'), is_key_list('"a,b"'), is_key_list("k")
    (True, True, False, False)
    """
    if not isinstance(value, str):
        return False
    if not value.startswith('"'):
        return "," in value
    i, end = 1, len(value)
    while i < end:
        if value[i] == "\\":
            i += 2
        elif value[i] == '"':
            return "," in value[i + 1 :]
        else:
            i += 1
    return False


def stored_key_identity(stored: str) -> str:
    r"""The key a value in the ledger's ``key`` column names: what the
    database computes as ``key_id`` (schema/*/0004_idemctl_v3.sql), for rows
    of every writer. idemctl stores the key itself; the recipe's Worker, and
    idemctl before it parsed sf-strings, stored the header as it came, so
    ``"k"`` there is the key ``k``. Leniently, as the SQL does: escapes
    undone, anything after the closing quote ignored, a value with no
    closing quote its own key.

    >>> stored_key_identity('"legacy-1"'), stored_key_identity("k"), stored_key_identity('"a\\"b";v=1')
    ('legacy-1', 'k', 'a"b')
    """
    if not stored.startswith('"'):
        return stored
    inner = stored[1:].replace("\\\\", "\x01").replace('\\"', "\x02")
    end = inner.find('"')
    if end < 0:
        return stored
    return inner[:end].replace("\x01", "\\").replace("\x02", '"')


def _sf_string(value: str) -> str | None:
    """RFC 8941 §4.2.5: the string of an sf-string item, its parameters
    ignored; None when `value` is not one."""
    out: list[str] = []
    i, end = 1, len(value)
    while i < end:
        char = value[i]
        if char == "\\":
            if i + 1 >= end or value[i + 1] not in '"\\':
                return None
            out.append(value[i + 1])
            i += 2
        elif char == '"':
            # The field's trailing whitespace is not the value's (RFC 9110 §5.5).
            rest = value[i + 1 :].rstrip(" \t")
            if rest and not _SF_PARAMETERS.match(rest):
                return None
            return "".join(out)
        elif " " <= char <= "~":
            out.append(char)
            i += 1
        else:
            return None
    return None  # never terminated


def stored_key(value: object) -> str:
    r"""The key an operator names to find a row: as a request's header is
    read (:func:`check_key`), or, for a value no request may send any more
    that an older writer stored as it came (the recipe took any 1-255
    printable characters: ``"abc`` unterminated, say), that value itself.
    InvalidKeyError when it is neither.

    >>> stored_key('"legacy-1"'), stored_key('"abc'), stored_key("k")
    ('legacy-1', '"abc', 'k')
    """
    parsed = parse_key(value)
    if parsed is None and isinstance(value, str) and _KEY_PATTERN.match(value) and _older_only(value):
        return value
    return check_key(value)


def _older_only(value: str) -> bool:
    """A value an older writer stored as it came that no request may send
    any more: it begins with a quote, or holds a comma."""
    return value.startswith('"') or "," in value


def is_valid_key(key: object) -> bool:
    r"""Whether `key` carries a valid key (see :func:`parse_key`).

    >>> is_valid_key("550e8400-e29b-41d4-a716-446655440000"), is_valid_key("abc\n"), is_valid_key('"abc"')
    (True, False, True)
    """
    return parse_key(key) is not None


def check_key(key: object) -> str:
    r"""The key `key` carries (see :func:`parse_key`); InvalidKeyError when none.

    >>> check_key("order-42"), check_key('"order-42"')
    ('order-42', 'order-42')
    >>> check_key("order 42\n")
    Traceback (most recent call last):
    ...
    idemctl.errors.InvalidKeyError: invalid Idempotency-Key 'order 42\n': must be 1-255 printable ASCII characters
    """
    parsed = parse_key(key)
    if parsed is None and is_key_list(key):
        raise InvalidKeyError(
            f"invalid Idempotency-Key {key!r}: a comma outside quotes makes it a list of keys "
            '(send a key holding a comma as an sf-string: "a,b")'
        )
    if parsed is None:
        raise InvalidKeyError(f"invalid Idempotency-Key {_shown_key(key)}: {_why_invalid(key)}")
    return parsed


# How much of a refused key an error message shows: a client may send
# kilobytes, and the message is a log line or one line on a terminal.
_SHOWN_KEY_CHARS = 40


def _shown_key(key: object) -> str:
    r"""A refused key for a message: its first characters, escaped (ASCII
    only, control characters as \n or \x1b), and how many more there were.

    >>> _shown_key("k" * 300)
    "'kkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkk'… (260 more)"
    >>> print(_shown_key("\u00e9\x1b"))
    '\xe9\x1b'
    """
    text = key if isinstance(key, str) else repr(key)
    more = len(text) - _SHOWN_KEY_CHARS
    return ascii(text[:_SHOWN_KEY_CHARS]) + (f"… ({more} more)" if more > 0 else "")


def _why_invalid(key: object) -> str:
    """What is wrong with a key `parse_key` refused.

    >>> _why_invalid("k" * 300)
    'it is 300 characters long, over the limit of 255 (printable ASCII)'
    """
    if isinstance(key, str):
        inner = key[1:-1] if len(key) >= 2 and key[0] == key[-1] == '"' else key
        if len(inner) > 255:
            return f"it is {len(inner)} characters long, over the limit of 255 (printable ASCII)"
    return "must be 1-255 printable ASCII characters"


def header_pairs(headers: HeadersLike | None) -> list[tuple[str, str]]:
    """Headers as a list of (name, value) pairs in received order."""
    if headers is None:
        return []
    if isinstance(headers, Mapping):
        return [(str(k), str(v)) for k, v in headers.items()]
    return [(str(k), str(v)) for k, v in headers]


def header_values(headers: HeadersLike | None, names: Iterable[str]) -> dict[str, str | None]:
    """Fetch-style lookup: each wanted name (lower case) maps to its values,
    each trimmed of HTTP whitespace and joined with ", ", or None when absent.

    >>> header_values([("Accept", "a"), ("accept", " b ")], ["accept", "x-api-version"])
    {'accept': 'a, b', 'x-api-version': None}
    """
    wanted = tuple(dict.fromkeys(n.lower() for n in names))
    found = picked_headers(headers, wanted)
    return {n: (", ".join(found[n]) if n in found else None) for n in wanted}


def picked_headers(headers: HeadersLike | None, names: Container[str]) -> dict[str, list[str]]:
    """The values of the headers `names` lists (lower-case names), by
    lower-case name, in the order sent, each trimmed of HTTP whitespace; a
    name not sent is absent. One pass over the headers, and no pair list:
    every request and every answer goes through it.

    >>> picked_headers([("Accept", "a"), ("X-Other", "b"), ("accept", " c ")], ("accept",))
    {'accept': ['a', 'c']}
    """
    found: dict[str, list[str]] = {}
    if headers is None:
        return found
    # A dict first: isinstance against the Mapping ABC is a Python call.
    sent = headers.items() if type(headers) is dict or isinstance(headers, Mapping) else headers
    for name, value in sent:
        lname = str(name).lower()
        if lname in names:
            if lname in found:
                found[lname].append(str(value).strip(_HTTP_WHITESPACE))
            else:
                found[lname] = [str(value).strip(_HTTP_WHITESPACE)]
    return found


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
    return request_digest(method, path_and_query, headers, as_body_bytes(body), _lowered(names))


# The lower-cased form of each tuple of names asked for (a policy's, mostly):
# lower-casing them is not redone per request. Bounded: emptied when full.
_LOWERED: dict[tuple[str, ...], tuple[str, ...]] = {}
_LOWERED_MAX = 64


def _lowered(names: Iterable[str]) -> tuple[str, ...]:
    if not isinstance(names, tuple):
        return tuple(n.lower() for n in names)
    lowered = _LOWERED.get(names)
    if lowered is None:
        if len(_LOWERED) >= _LOWERED_MAX:
            _LOWERED.clear()
        lowered = _LOWERED[names] = tuple(n.lower() for n in names)
    return lowered


def request_digest(
    method: str, path_and_query: str, headers: HeadersLike | None, body: bytes, names: tuple[str, ...]
) -> str:
    """:func:`fingerprint` of a body already known to be bytes, with `names`
    already lower-case (a `Policy`'s are): what every request computes, in
    one pass over its headers. A name given twice counts twice.

    >>> request_digest("POST", "/orders", {}, b"", ("content-type", "x-api-version"))
    'fc4d6d6663d197e95ef43ecc071614db7227f117beb78b985980d692380c7654'
    """
    found = picked_headers(headers, names)
    # Fetch-style: a header's values trimmed and joined with ", "; absent is empty.
    lines = "".join([f"{n}:{', '.join(found[n]) if n in found else ''}\n" for n in names])
    digest = hashlib.sha256(f"{method.upper()}\n{path_and_query}\n{lines}".encode())
    digest.update(body)
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
