"""A Redis ledger's replies as the ledger's values: a row's hash fields as a
StoredRow or LedgerRow (a malformed foreign hash is a typed error naming
it), and a fenced-out event, stored as length-prefixed fields so that Lua
and Python write the very same bytes for the same event."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...errors import MalformedRowError
from ...outcomes import FencedEvent, Status, StoredRow
from ..rows import LedgerRow
from .keys import BUCKETS

_STATUS = {b"pending": Status.PENDING, b"completed": Status.COMPLETED}


def _text(value: Any, what: str, principal: object, key: object) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            pass
    raise MalformedRowError(principal, key, f"{what} {value!r} is not UTF-8 text")


def _int(value: Any, what: str, principal: object, key: object) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise MalformedRowError(principal, key, f"{what} {value!r} is not an integer") from None


def _body(raw: Any) -> str | bytes | None:
    # The stored-row contract: text when the bytes are UTF-8, else the bytes.
    if raw is None:
        return None
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        return bytes(raw)


def stored_row(fields: Sequence[Any] | None) -> StoredRow | None:
    """A row's fields (keys.ROW_FIELDS, as HMGET gives them); None when the
    row is gone.

    >>> stored_row([b"acct", b"k", b"fp", b"pending", b"1", None, None, None, b"5", b"5"]).generation
    1
    """
    if not fields or fields[0] is None:
        return None
    p, k, f, s, g, rs, rb, rh, c, u = fields
    principal = _text(p, "principal", p, k)
    key = _text(k, "key", principal, k)
    status = _STATUS.get(s)
    if status is None:
        raise MalformedRowError(principal, key, f"status {s!r} is neither pending nor completed")
    return StoredRow(
        principal,
        key,
        _text(f, "fingerprint", principal, key),
        status,
        _int(g, "generation", principal, key),
        None if rs is None else _int(rs, "response_status", principal, key),
        _body(rb),
        None if rh is None else _text(rh, "response_headers", principal, key),
        _int(c, "created_at", principal, key),
        _int(u, "updated_at", principal, key),
    )


def ledger_row(fields: Sequence[Any] | None) -> LedgerRow | None:
    """A row with every column a copy carries (keys.COPY_FIELDS); None when gone."""
    if not fields or fields[0] is None:
        return None
    p, k, f, s, g, t, rs, rb, rh, c, u = fields
    principal = _text(p, "principal", p, k)
    key = _text(k, "key", principal, k)
    return LedgerRow(
        principal,
        key,
        _text(f, "fingerprint", principal, key),
        _text(s, "status", principal, key),
        _int(g, "generation", principal, key),
        None if t is None else _int(t, "token", principal, key),
        None if rs is None else _int(rs, "response_status", principal, key),
        None if rb is None else bytes(rb),
        None if rh is None else _text(rh, "response_headers", principal, key),
        _int(c, "created_at", principal, key),
        _int(u, "updated_at", principal, key),
    )


def row_fields(row: LedgerRow) -> list[Any]:
    """A row as HSET's field, value pairs (absent fields for NULLs)."""
    pairs: list[Any] = ["p", row.principal, "k", row.key, "f", row.fingerprint, "s", row.status]
    pairs += ["g", str(row.generation), "c", str(row.created_at), "u", str(row.updated_at)]
    for name, value in (("t", row.token), ("rs", row.response_status)):
        if value is not None:
            pairs += [name, str(value)]
    if row.response_body is not None:
        pairs += ["rb", row.response_body]
    if row.response_headers is not None:
        pairs += ["rh", row.response_headers]
    return pairs


def encode_event(principal: str, key: str, superseded: int, current: int | None, status: int, at: int) -> bytes:
    """An event as stored: each field ``<length>:<bytes>``, as the Lua of
    scripts.RECORD_FENCED writes it.

    >>> encode_event("acct", "k", 1, None, 201, 7)
    b'4:acct1:k1:10:3:2011:7'
    """
    out = b""
    for value in (principal, key, str(superseded), "" if current is None else str(current), str(status), str(at)):
        raw = value.encode("utf-8")
        out += b"%d:" % len(raw) + raw
    return out


def decode_event(seq: Any, bucket: int, stored: bytes) -> FencedEvent:
    """An event of a bucket's log (its sequence number and stored bytes).

    >>> decode_event(b"3", 5, b'4:acct1:k1:10:3:2011:7').id
    3077
    """
    fields: list[bytes] = []
    rest = stored
    while rest:
        size, _, rest = rest.partition(b":")
        n = int(size)
        fields.append(rest[:n])
        rest = rest[n:]
    principal, key, superseded, current, status, at = (f.decode("utf-8") for f in fields)
    return FencedEvent(
        int(seq) * BUCKETS + bucket,
        principal,
        key,
        int(superseded),
        int(current) if current else None,
        int(status),
        int(at),
    )
