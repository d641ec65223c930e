"""What a row is: the one definition of a row's state (in Python for one
row, in SQL for counting and listing), and every decoding of what the
statements return, a malformed foreign row being a typed error naming it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from ..errors import MalformedRowError
from ..outcomes import FencedEvent, State, Status, StoredRow
from .dialect import Dialect
from .engine import Rows

# -- a row's state: the one definition ------------------------------------------------
# `derive_state` and STATE_SQL say the same thing, in Python for one row and
# in SQL for counting and listing; tests check that they agree row for row.

STATE_SQL: Mapping[State, str] = {
    State.EXPIRED: "updated_at < :expired_before",
    State.COMPLETED: "status = 'completed' AND updated_at >= :expired_before",
    State.PENDING_STALE: "status = 'pending' AND updated_at < :stale_before AND updated_at >= :expired_before",
    State.PENDING_FRESH: "status = 'pending' AND updated_at >= :stale_before AND updated_at >= :expired_before",
}

# A stale reservation, whatever its age: its owner has not written it for a
# TTL, and the next retry takes it over. That is every PENDING_STALE row and
# also every pending row past retention (state EXPIRED: the sweep may delete
# it, but until then a retry takes it over just the same). `pending --stale`
# lists these rows and `stats().pending_stale` counts them, so a worker that
# died days ago is still reported; `RowView.takes_over_now` is the same test.
STALE_PENDING_SQL = "status = 'pending' AND updated_at < :stale_before"


def derive_state(row: StoredRow, stale_before: int, expired_before: int) -> State:
    """A row's state at the instant whose cutoffs are given."""
    if row.updated_at < expired_before:
        return State.EXPIRED
    if row.status is Status.COMPLETED:
        return State.COMPLETED
    if row.updated_at < stale_before:
        return State.PENDING_STALE
    return State.PENDING_FRESH


class LedgerRow(NamedTuple):
    """A ledger row with every column a copy carries; the body is the exact
    bytes whatever the engine's column type (None when there is none)."""

    principal: str
    key: str
    fingerprint: str
    status: str
    generation: int
    token: int | None
    response_status: int | None
    response_body: bytes | None
    response_headers: str | None
    created_at: int
    updated_at: int

    @property
    def where(self) -> tuple[str, str]:
        return self.principal, self.key


def exact_bytes(value: object) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(type(value).__name__)


def as_stored(body: bytes | None) -> str | bytes | None:
    # What the ledger itself stores: text when the bytes are UTF-8 (so that a
    # SQLite copy holds TEXT, as the recipe's own readers expect), else bytes.
    if body is None:
        return None
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        return body


def database_ms(rows: Rows) -> int:
    return int(rows[0][0])


def as_int(value: object, what: str, principal: object, key: object, *, nullable: bool = False) -> int | None:
    if value is None and nullable:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise MalformedRowError(principal, key, f"{what} {value!r} is not an integer")


# How a statement's rows decode (Statement.decode).


def all_rows(rows: Rows) -> Rows:
    return rows


def first_int(rows: Rows) -> int | None:
    return int(rows[0][0]) if rows else None


def any_row(rows: Rows) -> bool:
    return bool(rows)


def fenced_event(rows: Rows) -> FencedEvent | None:
    return FencedEvent(*rows[0]) if rows else None


def version_of(rows: Rows) -> int:
    return int(rows[0][0]) if rows and rows[0][0] is not None else 0


# A status column's value as the enum member, without Enum's own call.
_STATUS: Mapping[object, Status] = {s.value: s for s in Status}


def decode_row(dialect: Dialect, values: tuple[Any, ...]) -> StoredRow:
    """A row as stored, or MalformedRowError naming what is wrong with it.

    >>> from idemctl.storage.dialect import SQLITE
    >>> decode_row(SQLITE, ("acct", "k", "fp", "pending", 1, None, None, None, 5, 5)).status
    <Status.PENDING: 'pending'>
    """
    principal, key, fp, status, generation, rstatus, rbody, rheaders, created, updated = values
    if type(rbody) is bytes:
        rbody = dialect.body.read(rbody)  # PostgreSQL: text again when it is UTF-8
    state = _STATUS.get(status) if type(status) is str else None
    # Every replay decodes a row: the common case is checked in one
    # expression, the detailed checks (and their messages) only run when it fails.
    if (
        state is not None
        and type(principal) is str
        and type(key) is str
        and type(fp) is str
        and type(generation) is int
        and type(created) is int
        and type(updated) is int
        and (rstatus is None or type(rstatus) is int)
        and (rheaders is None or type(rheaders) is str)
        and (rbody is None or type(rbody) is str or type(rbody) is bytes)
    ):
        return StoredRow(principal, key, fp, state, generation, rstatus, rbody, rheaders, created, updated)
    return _decode_row_checked(dialect, values)


def _decode_row_checked(dialect: Dialect, values: tuple[Any, ...]) -> StoredRow:
    principal, key, fp, status, generation, rstatus, rbody, rheaders, created, updated = values
    text = dialect.read_text
    principal, key, fp = text(principal), text(key), text(fp)
    if not isinstance(principal, str) or not isinstance(key, str):
        raise MalformedRowError(principal, key, "principal and key must be text")
    try:
        state = Status(status)
    except ValueError:
        raise MalformedRowError(principal, key, f"status {status!r} is neither pending nor completed") from None
    if not isinstance(fp, str):
        raise MalformedRowError(principal, key, f"fingerprint {fp!r} is not text")
    if rheaders is not None and not isinstance(rheaders, str):
        raise MalformedRowError(principal, key, f"response_headers {rheaders!r} is not text")
    body = dialect.body.read(rbody)
    if body is not None and not isinstance(body, (str, bytes)):
        raise MalformedRowError(principal, key, f"response_body {rbody!r} is neither text nor bytes")
    return StoredRow(
        principal=principal,
        key=key,
        fingerprint=fp,
        status=state,
        generation=as_int(generation, "generation", principal, key) or 0,
        response_status=as_int(rstatus, "response_status", principal, key, nullable=True),
        response_body=body,
        response_headers=rheaders,
        created_at=as_int(created, "created_at", principal, key) or 0,
        updated_at=as_int(updated, "updated_at", principal, key) or 0,
    )


def decode_full_row(dialect: Dialect, values: tuple[Any, ...]) -> LedgerRow:
    """A row with every column a copy carries (COPY_COLUMNS), or MalformedRowError."""
    principal, key, fp, status, generation, token, rstatus, rbody, rheaders, created, updated = values
    # A copy decodes every row of both ledgers: the common case is checked
    # in one expression, the detailed checks only run when it fails.
    if (
        type(principal) is str
        and type(key) is str
        and type(fp) is str
        and type(status) is str
        and type(generation) is int
        and type(created) is int
        and type(updated) is int
        and (token is None or type(token) is int)
        and (rstatus is None or type(rstatus) is int)
        and (rheaders is None or type(rheaders) is str)
        and (rbody is None or type(rbody) is bytes)
    ):
        return LedgerRow._make(values)
    # MariaDB/MySQL hand principals and keys back as bytes (VARBINARY).
    principal, key = dialect.read_text(principal), dialect.read_text(key)
    if not isinstance(principal, str) or not isinstance(key, str):
        raise MalformedRowError(principal, key, "principal and key must be text")
    for name, value in (("fingerprint", fp), ("status", status), ("response_headers", rheaders)):
        if value is not None and not isinstance(value, str):
            raise MalformedRowError(principal, key, f"{name} {value!r} is not text")
    try:
        body = exact_bytes(rbody)
    except TypeError:
        raise MalformedRowError(principal, key, f"response_body {rbody!r} is neither text nor bytes") from None
    return LedgerRow(
        principal,
        key,
        fp,
        status,
        as_int(generation, "generation", principal, key) or 0,
        as_int(token, "token", principal, key, nullable=True),
        as_int(rstatus, "response_status", principal, key, nullable=True),
        body,
        rheaders,
        as_int(created, "created_at", principal, key) or 0,
        as_int(updated, "updated_at", principal, key) or 0,
    )


def decode_event(dialect: Dialect, values: tuple[Any, ...]) -> FencedEvent:
    """A fenced-out event, its principal and key read as text."""
    decoded = list(values)
    decoded[1:3] = [dialect.read_text(v) for v in values[1:3]]
    return FencedEvent(*decoded)
