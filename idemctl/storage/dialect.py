"""What differs between SQL engines in the statements themselves.

Every statement is written once, in storage/statements.py, with ``:name``
parameters; a dialect says how an engine spells parameters, how it bounds a
DELETE (SQLite and PostgreSQL have no ``DELETE … LIMIT``), how it binds
response bodies and whether its statements can hand rows back with
RETURNING. Adding an engine means one more value here and one engine class."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

_NAMED = re.compile(r"(?<![:\w]):([a-z_][a-z0-9_]*)")


def _keep(sql: str) -> str:
    return sql


def _pyformat(sql: str) -> str:
    return _NAMED.sub(r"%(\1)s", sql)


# `key` is a reserved word in MariaDB and MySQL (and only there): quoted
# wherever it stands as the column's name, never as the parameter `:key`.
_KEY_COLUMN = re.compile(r"(?<![:\w`])key(?![\w`])")


def _mysql_spelling(sql: str) -> str:
    return _pyformat(_KEY_COLUMN.sub("`key`", sql))


def _text_as_is(value: object) -> object:
    return value


def _text_from_utf8(value: object) -> object:
    # Principals and keys sit in VARBINARY columns (compared byte for byte,
    # trailing spaces included): their UTF-8 comes back as text; bytes that
    # are not UTF-8 stay bytes, which decoding reports as a malformed row.
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return bytes(value)
    return value


def _body_as_is(body: object) -> object:
    return body


def _body_as_bytes(body: str | bytes | None) -> object:
    # A str bound to BYTEA would go through bytea's text input, which reads
    # backslashes as escapes: always bind the exact bytes.
    return body.encode("utf-8") if isinstance(body, str) else body


def _body_text_or_bytes(value: object) -> object:
    # The stored-row contract: text when the bytes are valid UTF-8, bytes
    # otherwise, which is what the ledger stored; replays use the bytes anyway.
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw
    return value


@dataclass(frozen=True)
class BodyCodec:
    """How an engine binds a response body (text, bytes or None) and how it
    reads one back (text when it is UTF-8, else bytes).

    >>> UTF8_OR_BYTES.bind("é"), UTF8_OR_BYTES.read(b"\\xc3\\xa9")
    (b'\\xc3\\xa9', 'é')
    """

    bind: Callable[[str | bytes | None], object]
    read: Callable[[object], object]


# SQLite stores text as TEXT and bytes as a BLOB, and hands each back as it is.
AS_STORED = BodyCodec(_body_as_is, _body_as_is)
# Bodies as the exact bytes (BYTEA, LONGBLOB, a Redis string).
UTF8_OR_BYTES = BodyCodec(_body_as_bytes, _body_text_or_bytes)


@dataclass(frozen=True)
class SweepForm:
    """How an engine deletes one batch of expired rows: the statement, what
    its rows say as (rows deleted, newest updated_at deleted), and how many
    rows one batch deletes when an operator drains a backlog (`idemctl sweep`)."""

    statement: str
    tally: Callable[[list[tuple[Any, ...]]], tuple[int, int | None]]
    drain_batch: int


# SQLite has no DELETE … LIMIT: bound the batch through a rowid subquery that
# walks idx_idempotency_keys_updated_at oldest first, from `:after` (a lower
# bound of the oldest row: where the walk can start). The deleted rows'
# timestamps come back: the newest one is where the next batch starts.
_SQLITE_SWEEP_KEYS = """
DELETE FROM idempotency_keys WHERE rowid IN (
  SELECT rowid FROM idempotency_keys WHERE updated_at >= :after AND updated_at < :cutoff
  ORDER BY updated_at LIMIT :limit
)
RETURNING updated_at
"""


def _tally_returned(rows: list[tuple[Any, ...]]) -> tuple[int, int | None]:
    return len(rows), max((int(r[0]) for r in rows), default=None)


# PostgreSQL has no DELETE … LIMIT either. An InitPlan walks the updated_at
# index oldest first from `:after` (rows deleted by earlier batches stay in
# the index as dead entries until VACUUM: a walk from the index's start would
# step over all of them, more each batch) and collects at most N row
# addresses (ctid); the delete
# visits exactly those by TID Scan. If a takeover refreshes a chosen row
# while this statement waits for its row lock, READ COMMITTED re-checks the
# quals against the committed version; the outer cutoff test (written
# `updated_at + 0` so the planner cannot answer it with a second scan of the
# whole backlog) makes that re-check skip the refreshed row.
# The count and the newest timestamp deleted come back as one row.
_POSTGRES_SWEEP_KEYS = """
WITH gone AS (
  DELETE FROM idempotency_keys
  WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM idempotency_keys WHERE updated_at >= :after AND updated_at < :cutoff
    ORDER BY updated_at LIMIT :limit
  )) AND updated_at + 0 < :cutoff
  RETURNING updated_at
)
SELECT count(*), max(updated_at) FROM gone
"""


# MariaDB and MySQL bound a DELETE natively, walking idx_..._updated_at
# oldest first; under READ COMMITTED a row a takeover refreshed while this
# waited for its lock is re-read and no longer matches the cutoff. Without
# RETURNING (MySQL has none on DELETE) only the count comes back: the walk
# starts at `:after` from the probe, which InnoDB's purge keeps cheap.
_MYSQL_SWEEP_KEYS = """
DELETE FROM idempotency_keys WHERE updated_at >= :after AND updated_at < :cutoff
ORDER BY updated_at LIMIT :limit
"""


def _tally_affected(rows: list[tuple[Any, ...]]) -> tuple[int, int | None]:
    # One row per deleted row (see Dialect.returning), no timestamps.
    return len(rows), None


def _tally_row(rows: list[tuple[Any, ...]]) -> tuple[int, int | None]:
    count, newest = rows[0]
    return int(count), None if newest is None else int(newest)


@dataclass(frozen=True)
class Dialect:
    """One SQL engine's spelling of idemctl's statements."""

    name: str  # also the folder of its DDL under schema/
    sweep: SweepForm
    body: BodyCodec
    # The database's own clock, in ms since the epoch.
    now_sql: str
    # Turns ``:name`` parameters into the driver's style (by default, as
    # written: SQLite's, and a Redis operation's names).
    params: Callable[[str], str] = _keep
    # How a statement carries a batch of rows (`idemctl copy`): False, one
    # VALUES tuple or OR test per row, which every engine takes; True, one
    # array per column that the server unnests, where parsing and planning
    # thousands of placeholders would cost more than the statement itself.
    batch_arrays: bool = False
    # False: the engine has no RETURNING, and statements.py has its own forms of
    # the statements that need one; the engine hands back one row per
    # affected row holding LAST_INSERT_ID(), through which those forms
    # return the one value they must (storage/engine.py, Engine.write).
    returning: bool = True
    # How principals, keys and fingerprints come back from the driver.
    read_text: Callable[[object], object] = _text_as_is
    # The longest principal (UTF-8 bytes) the primary key can hold; None: any.
    max_principal_bytes: int | None = None
    # True: a claim that finds the key taken hands back the row in the same
    # statement (CLAIM_OR_READ: a data-modifying WITH), one round trip for
    # a replay or a 409 instead of two. False: the claim, then LOOKUP.
    claim_reads_row: bool = False
    # How a lease renewal reaches its rows by the key's unique index on this engine's
    # planner: "values", "or" or "each" (storage/statements.py, RENEW_MAX).
    renew_form: str = "values"
    # Whether a body that is not UTF-8 can be stored (as a BLOB). False: the
    # ledger stores such an answer as the oversize sentinel instead
    # (ledger/steps.py), as it does an answer over the cap.
    binary_bodies: bool = True
    # The most parameters one statement may bind; None: no limit worth
    # counting. The copy splits its batches to stay under it.
    max_params: int | None = None
    # The folder of its DDL under schema/ when it is not `name`.
    ddl: str = ""
    # The most rows one read of an operator's listing (`pending`) asks for,
    # on an engine that answers a statement in one document (D1's HTTP API):
    # a long listing is read page by page. None: one statement, whose rows
    # the driver streams.
    list_page: int | None = None

    @property
    def schema_folder(self) -> str:
        """Where its DDL lives under schema/.

        >>> SQLITE.schema_folder
        'sqlite'
        """
        return self.ddl or self.name


SQLITE = Dialect(
    name="sqlite",
    # A batch holds the one database-wide write lock that every claim waits
    # for: 250 rows keep a concurrent claimer's p99 low on a large backlog
    # (docs/performance.md, sweep table) at no cost in drain time.
    sweep=SweepForm(_SQLITE_SWEEP_KEYS, _tally_returned, drain_batch=250),
    body=AS_STORED,
    now_sql="SELECT CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)",
    # One primary-key UPDATE per reservation, one transaction: the VALUES
    # form is a SCAN of the table (EXPLAIN QUERY PLAN), 0.1 s a tick at 10^6 rows.
    renew_form="each",
)

POSTGRES = Dialect(
    name="postgres",
    params=_pyformat,
    # Row locks: a batch blocks only claims of the expired keys it deletes,
    # for the few ms it runs; a batch's fixed cost (round trip, plan,
    # commit) shrinks with its size (docs/performance.md, sweep table).
    sweep=SweepForm(_POSTGRES_SWEEP_KEYS, _tally_row, drain_batch=5000),
    body=UTF8_OR_BYTES,
    now_sql="SELECT CAST(floor(extract(epoch FROM clock_timestamp()) * 1000) AS BIGINT)",
    # 500 OR tests cost PostgreSQL's planner ~0.1 s a statement, and psycopg
    # as long to parse 5,500 placeholders; two arrays cost neither.
    batch_arrays=True,
    claim_reads_row=True,
)

# MariaDB and MySQL alike: as PostgreSQL (bytes bodies; row locks, so a
# sweep batch locks only the expired rows it deletes), except for these.
MYSQL = replace(
    POSTGRES,
    name="mysql",
    params=_mysql_spelling,
    sweep=replace(POSTGRES.sweep, statement=_MYSQL_SWEEP_KEYS, tally=_tally_affected),
    # The session's time zone is UTC (storage/mysql.py): no DST fold.
    now_sql="SELECT CAST(FLOOR(UNIX_TIMESTAMP(NOW(3)) * 1000) AS SIGNED)",
    batch_arrays=False,
    returning=False,
    claim_reads_row=False,  # no data-modifying WITH
    read_text=_text_from_utf8,
    # schema/mysql: principal VARBINARY(1024) + key VARBINARY(255) is well
    # inside InnoDB's 3072-byte index key limit. The width of the column, not
    # the limit: every engine refuses a principal past MAX_PRINCIPAL_BYTES
    # (512, ledger/inputs.py) before any statement.
    max_principal_bytes=1024,
    # EXPLAIN: the VALUES form is type `index` over the whole primary key (a
    # dependent subquery per row: seconds a tick at 10^6 rows), the OR form
    # a `range` on PRIMARY with one row per reservation.
    renew_form="or",
)


def _body_from_d1(value: object) -> object:
    # D1 hands a BLOB back as an array of byte values.
    if isinstance(value, list):
        return bytes(value)
    return value


# Cloudflare D1 through its HTTP API: SQLite's statements, with D1's rules.
D1 = replace(
    SQLITE,
    name="d1",
    ddl="sqlite",
    body=replace(AS_STORED, read=_body_from_d1),
    # JSON carries no bytes, and the recipe's Worker cannot replay a BLOB.
    binary_bodies=False,
    max_params=100,
    # A batch is one API call and one transaction; D1 runs one at a time.
    sweep=replace(SQLITE.sweep, drain_batch=250),
    # Each statement's rows come in one JSON answer: `pending` reads pages.
    list_page=500,
)
