"""Every statement idemctl runs, and every decoding of what they return.

The store is the one SQL core: request-path steps are one auto-committed
statement each, operator reads and the sweep are bounded statements, and
the schema decision of `init` is made here. An engine (storage/sqlite.py,
storage/postgres.py, storage/mysql.py) only runs statements: its
connections, its locking and its error classes. Statements are written once
with ``:name`` parameters and spelled for an engine by its dialect; an
engine without RETURNING (MariaDB, MySQL) runs the forms written for it
below, which decide in the same WHERE clauses."""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

from ..errors import InvalidPrincipalError, MalformedRowError, SchemaTooNewError, StorageError
from ..outcomes import (
    FencedEvent,
    InitAction,
    InitResult,
    PurgeOutcome,
    PurgeResult,
    State,
    Stats,
    Status,
    StoredRow,
    SweepResult,
)
from ..schema import SCHEMA_VERSION, schema_files
from .engine import Engine, Rows, SchemaTx

R = TypeVar("R")

LEDGER_TABLE = "idempotency_keys"
FENCED_TABLE = "idemctl_fenced_out"
VERSION_TABLE = "idemctl_schema_version"
TABLES = (LEDGER_TABLE, FENCED_TABLE, VERSION_TABLE)

# The schema version whose request path this idemctl runs: the fencing token
# column arrived in version 2.
REQUEST_PATH_VERSION = 2

ROW_COLUMNS = (
    "principal, key, fingerprint, status, generation, response_status, "
    "response_body, response_headers, created_at, updated_at"
)
EVENT_COLUMNS = "id, principal, key, superseded_generation, current_generation, computed_status, fenced_at"

# -- the request path: one statement each ----------------------------------------

CLAIM = """
INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, token, created_at, updated_at)
VALUES (:principal, :key, :fingerprint, 'pending', 1, :token, :now, :now)
ON CONFLICT (principal, key) DO NOTHING
RETURNING generation
"""

LOOKUP = f"SELECT {ROW_COLUMNS} FROM idempotency_keys WHERE principal = :principal AND key = :key"

# Two kinds of takeover, decided in the WHERE so two racers cannot both win;
# the new owner draws a new token and the generation goes up either way.
#  * A stale reservation: still pending, still stale, still the same request.
#  * A row past retention, whatever it holds: it counts as absent, so the
#    request is a new operation (any fingerprint; a completed answer is
#    forgotten, never replayed past retention). The row is reset to a fresh
#    pending reservation of this request, created now.
# SET expressions read the row as it was, on every engine, so the CASE sees
# the old updated_at. For a stale takeover the reset columns already hold
# those values (pending, same fingerprint, no response).
TAKEOVER = """
UPDATE idempotency_keys
SET generation = generation + 1, token = :token, updated_at = :now,
    created_at = CASE WHEN updated_at < :expired_before THEN :now ELSE created_at END,
    fingerprint = :fingerprint, status = 'pending',
    response_status = NULL, response_body = NULL, response_headers = NULL
WHERE principal = :principal AND key = :key
  AND ((status = 'pending' AND fingerprint = :fingerprint AND updated_at < :stale_before)
       OR updated_at < :expired_before)
RETURNING generation
"""

# Fenced by generation and token together: the token because generations
# restart at 1 once a row is deleted and claimed again; the generation
# because an older writer (the recipe's Worker) bumps it without a token.
COMPLETE = """
UPDATE idempotency_keys
SET status = 'completed', response_status = :status, response_body = :body,
    response_headers = :headers, updated_at = :now
WHERE principal = :principal AND key = :key AND generation = :generation
  AND token = :token AND status = 'pending'
RETURNING generation
"""

RELEASE = """
DELETE FROM idempotency_keys
WHERE principal = :principal AND key = :key AND generation = :generation
  AND token = :token AND status = 'pending'
RETURNING generation
"""

# A live owner's reservations, renewed together (see leases.py): each row
# only while it is still pending under the very generation and token it was
# claimed with, so a renewal never revives or steals a row a takeover moved
# on. The VALUES list is padded to a power of two (the statement text is
# cached per size).
RENEW_MAX = 512


def renew_text(size: int, returning: bool = True) -> str:
    values = ", ".join(f"(:p{i}, :k{i}, :g{i}, :t{i})" for i in range(size))
    return (
        "UPDATE idempotency_keys SET updated_at = :now"
        f" WHERE status = 'pending' AND (principal, key, generation, token) IN (VALUES {values})"
        # Without RETURNING the engine hands back one row per affected row.
        + (" RETURNING generation" if returning else "")
    )


# One statement: the event and the generation the row held then are read and
# written together, so the log never disagrees with the row it describes.
RECORD_FENCED = f"""
INSERT INTO idemctl_fenced_out
  (principal, key, superseded_generation, current_generation, computed_status, fenced_at)
VALUES (:principal, :key, :generation,
        (SELECT generation FROM idempotency_keys WHERE principal = :principal AND key = :key),
        :status, :now)
RETURNING {EVENT_COLUMNS}
"""

# -- the sweep -----------------------------------------------------------------------

SWEEP_FENCED = """
DELETE FROM idemctl_fenced_out WHERE id IN (
  SELECT id FROM idemctl_fenced_out WHERE fenced_at < :cutoff ORDER BY fenced_at LIMIT :limit
)
RETURNING id
"""

# Read-only probes through the same indexes (a min() is one index step):
# when nothing is past retention, the per-request sweep takes no write lock,
# and the oldest timestamps say how long nothing will be. `:after` is where
# the index walk may start (see Store.sweep).
OLDEST = "SELECT (SELECT min(updated_at) FROM idempotency_keys WHERE updated_at >= :after)"
OLDEST_WITH_FENCED = (
    "SELECT (SELECT min(updated_at) FROM idempotency_keys WHERE updated_at >= :after),"
    " (SELECT min(fenced_at) FROM idemctl_fenced_out)"
)
# Below every timestamp a ledger holds: an index walk from the start.
FROM_THE_START = -(2**62)

INSERT_VERSION = (
    "INSERT INTO idemctl_schema_version (version, applied_at) VALUES (:version, :now)"
    " ON CONFLICT DO NOTHING RETURNING version"
)

COUNT_EXPIRED = "SELECT count(*) FROM idempotency_keys WHERE updated_at < :cutoff"
COUNT_FENCED_EXPIRED = "SELECT count(*) FROM idemctl_fenced_out WHERE fenced_at < :cutoff"
COUNT_FENCED = "SELECT count(*) FROM idemctl_fenced_out"

# -- a row's state: the one definition ------------------------------------------------
# `derive_state` and STATE_SQL say the same thing, in Python for one row and
# in SQL for counting and listing; tests check that they agree row for row.

STATE_SQL: Mapping[State, str] = {
    State.EXPIRED: "updated_at < :expired_before",
    State.COMPLETED: "status = 'completed' AND updated_at >= :expired_before",
    State.PENDING_STALE: "status = 'pending' AND updated_at < :stale_before AND updated_at >= :expired_before",
    State.PENDING_FRESH: "status = 'pending' AND updated_at >= :stale_before AND updated_at >= :expired_before",
}


def derive_state(row: StoredRow, stale_before: int, expired_before: int) -> State:
    """A row's state at the instant whose cutoffs are given."""
    if row.updated_at < expired_before:
        return State.EXPIRED
    if row.status is Status.COMPLETED:
        return State.COMPLETED
    if row.updated_at < stale_before:
        return State.PENDING_STALE
    return State.PENDING_FRESH


def _count(state: State) -> str:
    return f"coalesce(sum(CASE WHEN {STATE_SQL[state]} THEN 1 ELSE 0 END), 0)"


STATS = f"""
SELECT
  count(*),
  {_count(State.PENDING_FRESH)},
  {_count(State.PENDING_STALE)},
  {_count(State.COMPLETED)},
  {_count(State.EXPIRED)},
  coalesce(sum(CASE WHEN generation > 1 THEN 1 ELSE 0 END), 0),
  min(CASE WHEN status = 'pending' THEN created_at END),
  min(CASE WHEN status = 'completed' THEN created_at END),
  min(created_at)
FROM idempotency_keys
"""

# Purge refuses a fresh pending row inside the statement itself: its owner may
# still be running, and deleting it would let a retry run the mutation twice.
PURGE = f"""
DELETE FROM idempotency_keys
WHERE principal = :principal AND key = :key
  AND (status <> 'pending' OR CAST(:stale_before AS BIGINT) IS NULL OR updated_at < :stale_before)
RETURNING {ROW_COLUMNS}
"""

# -- engines without RETURNING (MariaDB, MySQL) ----------------------------------------
# MariaDB has RETURNING on INSERT and DELETE but not on UPDATE; MySQL has
# none. One set of forms serves both: the engine hands back one row per
# affected row, holding LAST_INSERT_ID(), so the affected-row count answers
# "did this statement decide for me" and a form that must return a value
# sets it with LAST_INSERT_ID(expr) inside the same statement. Every
# decision stays in the same WHERE clause as above.


def _without_returning(sql: str) -> str:
    """A statement whose RETURNING only said "a row matched": its
    affected-row count says the same."""
    return re.sub(r"\s*RETURNING [^;]*\Z", "\n", sql)


# A no-op update of a duplicate affects no row (the driver does not set
# CLIENT_FOUND_ROWS), so exactly the claim that inserted gets a row back.
# Not INSERT IGNORE: that would also turn a value the column cannot hold
# into a warning.
MYSQL_CLAIM = """
INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, token, created_at, updated_at)
VALUES (:principal, :key, :fingerprint, 'pending', LAST_INSERT_ID(1), :token, :now, :now)
ON DUPLICATE KEY UPDATE generation = generation
"""

# TAKEOVER's two kinds, decided in the same WHERE. The new generation travels
# back through LAST_INSERT_ID(expr), set by the very assignment the WHERE
# allowed. MySQL assigns left to right, each assignment seeing the ones
# before it: created_at reads the old updated_at, so updated_at comes last.
MYSQL_TAKEOVER = """
UPDATE idempotency_keys
SET created_at = CASE WHEN updated_at < :expired_before THEN :now ELSE created_at END,
    generation = LAST_INSERT_ID(generation + 1), token = :token,
    fingerprint = :fingerprint, status = 'pending',
    response_status = NULL, response_body = NULL, response_headers = NULL,
    updated_at = :now
WHERE principal = :principal AND key = :key
  AND ((status = 'pending' AND fingerprint = :fingerprint AND updated_at < :stale_before)
       OR updated_at < :expired_before)
"""

# The event's id comes back as LAST_INSERT_ID(); the event is read back by
# it (the log is append-only: the row cannot change in between).
MYSQL_RECORD_FENCED = """
INSERT INTO idemctl_fenced_out
  (principal, key, superseded_generation, current_generation, computed_status, fenced_at)
VALUES (:principal, :key, :generation,
        (SELECT generation FROM idempotency_keys WHERE principal = :principal AND key = :key),
        :status, :now)
"""
FENCED_EVENT = f"SELECT {EVENT_COLUMNS} FROM idemctl_fenced_out WHERE id = :id"

MYSQL_SWEEP_FENCED = """
DELETE FROM idemctl_fenced_out WHERE fenced_at < :cutoff ORDER BY fenced_at LIMIT :limit
"""

# Purge without RETURNING: read the row, then delete exactly that version of
# it (token, generation, status and updated_at in the WHERE, with the
# refusal of a fresh pending row): a row that changed in between is not
# deleted, and is read again.
PURGE_READ = f"SELECT {ROW_COLUMNS}, token FROM idempotency_keys WHERE principal = :principal AND key = :key"
PURGE_VERSION = """
DELETE FROM idempotency_keys
WHERE principal = :principal AND key = :key AND token <=> :token AND generation = :generation
  AND status = :status AND updated_at = :updated_at
  AND (status <> 'pending' OR :stale_before IS NULL OR updated_at < :stale_before)
"""
PURGE_TRIES = 10

WITHOUT_RETURNING: Mapping[str, str] = {
    CLAIM: MYSQL_CLAIM,
    TAKEOVER: MYSQL_TAKEOVER,
    COMPLETE: _without_returning(COMPLETE),
    RELEASE: _without_returning(RELEASE),
    RECORD_FENCED: MYSQL_RECORD_FENCED,
    SWEEP_FENCED: MYSQL_SWEEP_FENCED,
    INSERT_VERSION: (
        "INSERT INTO idemctl_schema_version (version, applied_at) VALUES (:version, :now)"
        " ON DUPLICATE KEY UPDATE version = version"
    ),
}


# -- copying a ledger to another: every statement reads one page or writes one batch --------

# A row with every column a copy carries: the recipe's columns and the token.
COPY_COLUMNS = (
    "principal",
    "key",
    "fingerprint",
    "status",
    "generation",
    "token",
    "response_status",
    "response_body",
    "response_headers",
    "created_at",
    "updated_at",
)

# Keyset pagination on the primary key: each page is one index range read
# from where the last one ended, so no page costs more than the first and no
# page is ever held open (a live source keeps taking requests meanwhile).
# The source's own collation orders the page and the `>`, so they agree.
_COPY_PAGE = "SELECT {columns} FROM idempotency_keys{after} ORDER BY principal, key LIMIT :limit"
_COPY_AFTER = " WHERE (principal, key) > (:after_principal, :after_key)"

# Insert if absent, many rows in one statement: the conflict clause decides
# row by row, exactly as a claim does, so a row that appeared in the
# destination since it was read is left alone (and looked at again).
_COPY_INSERT = """
INSERT INTO idempotency_keys ({columns})
VALUES {values}
ON CONFLICT (principal, key) DO NOTHING
RETURNING principal, key
"""

# Overwrite only an older version of the same request: same fingerprint, and
# a lower generation, or the same generation and completed over pending, or
# the same status written earlier. `copying.source_is_newer` says the same
# in Python (to skip the statement for rows that are already equal); this
# WHERE is what decides.
COPY_UPDATE = """
UPDATE idempotency_keys
SET status = :status, generation = :generation, token = :token, response_status = :response_status,
    response_body = :response_body, response_headers = :response_headers,
    created_at = :created_at, updated_at = :updated_at
WHERE principal = :principal AND key = :key AND fingerprint = :fingerprint
  AND (generation < :generation
       OR (generation = :generation AND status = 'pending' AND :status = 'completed')
       OR (generation = :generation AND status = :status AND updated_at < :updated_at))
RETURNING generation
"""

# The fenced-out log's ids are each database's own: an event is the same
# event when every other column is equal. Inserted unless already there.
_COPY_FENCED_PAGE = f"""
SELECT {EVENT_COLUMNS} FROM idemctl_fenced_out WHERE id > :after ORDER BY id LIMIT :limit
"""
_SAME_EVENT = """principal = :principal AND key = :key AND superseded_generation = :superseded
  AND (current_generation = :current OR (current_generation IS NULL AND CAST(:current AS INTEGER) IS NULL))
  AND computed_status = :status AND fenced_at = :fenced_at"""
COPY_FENCED = f"""
INSERT INTO idemctl_fenced_out
  (principal, key, superseded_generation, current_generation, computed_status, fenced_at)
SELECT :principal, :key, :superseded, CAST(:current AS INTEGER), :status, :fenced_at
WHERE NOT EXISTS (SELECT 1 FROM idemctl_fenced_out WHERE {_SAME_EVENT})
RETURNING id
"""

# The same two statements with one array per column (Dialect.batch_arrays).
_COLUMN_TYPES = {
    "principal": "TEXT",
    "key": "TEXT",
    "fingerprint": "TEXT",
    "status": "TEXT",
    "generation": "INTEGER",
    "token": "BIGINT",
    "response_status": "INTEGER",
    "response_body": "BYTEA",
    "response_headers": "TEXT",
    "created_at": "BIGINT",
    "updated_at": "BIGINT",
}
_COPY_INSERT_ARRAYS = f"""
INSERT INTO idempotency_keys ({", ".join(COPY_COLUMNS)})
SELECT * FROM unnest({", ".join(f"CAST(:{c} AS {_COLUMN_TYPES[c]}[])" for c in COPY_COLUMNS)})
ON CONFLICT (principal, key) DO NOTHING
RETURNING principal, key
"""
_COPY_UPDATE_ARRAYS = f"""
UPDATE idempotency_keys AS t
SET status = s.status, generation = s.generation, token = s.token, response_status = s.response_status,
    response_body = s.response_body, response_headers = s.response_headers,
    created_at = s.created_at, updated_at = s.updated_at
FROM unnest({", ".join(f"CAST(:{c} AS {_COLUMN_TYPES[c]}[])" for c in COPY_COLUMNS)}) AS s ({", ".join(COPY_COLUMNS)})
WHERE t.principal = s.principal AND t.key = s.key AND t.fingerprint = s.fingerprint
  AND (t.generation < s.generation
       OR (t.generation = s.generation AND t.status = 'pending' AND s.status = 'completed')
       OR (t.generation = s.generation AND t.status = s.status AND t.updated_at < s.updated_at))
RETURNING t.principal, t.key
"""
_ROWS_AT_ARRAYS = f"""
SELECT {", ".join(COPY_COLUMNS)} FROM idempotency_keys
WHERE (principal, key) IN (SELECT * FROM unnest(CAST(:principals AS TEXT[]), CAST(:keys AS TEXT[])))
"""

# The same statements without RETURNING (MariaDB, MySQL): one row a
# statement, a batch of them on one connection (Engine.write_turn), each
# committed on its own and its affected-row count saying what it decided for
# its row. One row a statement also keeps each within max_allowed_packet,
# whatever the batch's bodies add up to.
#  * The page's lower bound as two ranges of the primary key: MariaDB does
#    not read a row comparison as an index range, and would scan from the
#    start of the index for every page.
#  * Insert if absent: a duplicate's no-op update affects no row, as in
#    MYSQL_CLAIM; only the statement that inserted gets a row back.
#  * COPY_UPDATE's WHERE allows only a version that differs (a higher
#    generation, another status or a later updated_at), so the row it
#    matched is also a row it changed: the affected-row count says it.
#  * The fenced-out event, NULL-safe on the current generation.
_MYSQL_COPY_AFTER = " WHERE (principal = :after_principal AND key > :after_key) OR principal > :after_principal"
_MYSQL_COPY_INSERT = f"""
INSERT INTO idempotency_keys ({", ".join(COPY_COLUMNS)})
VALUES ({", ".join(f":{c}" for c in COPY_COLUMNS)})
ON DUPLICATE KEY UPDATE generation = generation
"""
MYSQL_COPY_UPDATE = _without_returning(COPY_UPDATE)
_MYSQL_SAME_EVENT = """principal = :principal AND key = :key AND superseded_generation = :superseded
  AND current_generation <=> :current AND computed_status = :status AND fenced_at = :fenced_at"""
MYSQL_COPY_FENCED = f"""
INSERT INTO idemctl_fenced_out
  (principal, key, superseded_generation, current_generation, computed_status, fenced_at)
SELECT :principal, :key, :superseded, :current, :status, :fenced_at FROM DUAL
WHERE NOT EXISTS (SELECT 1 FROM idemctl_fenced_out WHERE {_MYSQL_SAME_EVENT})
"""

COUNT_ROWS = "SELECT count(*) FROM idempotency_keys"


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


def _exact_bytes(value: object) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(type(value).__name__)


def _as_stored(body: bytes | None) -> str | bytes | None:
    # What the ledger itself stores: text when the bytes are UTF-8 (so that a
    # SQLite copy holds TEXT, as the recipe's own readers expect), else bytes.
    if body is None:
        return None
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        return body


def _database_ms(rows: Rows) -> int:
    return int(rows[0][0])


def new_token() -> int:
    """A fencing token: random, positive, fits a signed 64-bit column."""
    return secrets.randbits(63) or 1


def _int(value: object, what: str, principal: object, key: object, *, nullable: bool = False) -> int | None:
    if value is None and nullable:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise MalformedRowError(principal, key, f"{what} {value!r} is not an integer")


# -- one statement, whichever way it runs ---------------------------------------------
# Each request-path method of Store is split in two halves: `*_statement`
# builds a Statement (the text as the engine spells it, its parameters, and
# how its rows decode), and the method itself runs it with `Store.run`. The
# asynchronous store (storage/aio.py) runs the very same Statements on an
# asynchronous connection: the SQL and its decoding exist once, only the
# execution differs.


@dataclass(frozen=True)
class Statement(Generic[R]):
    """One statement ready to run: spelled, bound, and how its rows decode.
    A `write` runs only after the store's schema guard."""

    sql: str
    params: Mapping[str, Any]
    decode: Callable[[Rows], R]
    write: bool


@dataclass(frozen=True)
class Turn:
    """Statements that run together in one turn of the engine's writers
    (`Engine.write_turn`); the sweep's deletes."""

    statements: Sequence[tuple[str, Mapping[str, Any]]]


#: The sweep as steps: it yields a read (a Statement) or a Turn and is sent
#: the rows (a list of rows per statement for a Turn); it returns its result.
SweepSteps = Generator["Statement[Rows] | Turn", Any, SweepResult]


def _rows(rows: Rows) -> Rows:
    return rows


def _first_int(rows: Rows) -> int | None:
    return int(rows[0][0]) if rows else None


def _any_row(rows: Rows) -> bool:
    return bool(rows)


def _fenced_event(rows: Rows) -> FencedEvent | None:
    return FencedEvent(*rows[0]) if rows else None


def _version(rows: Rows) -> int:
    return int(rows[0][0]) if rows and rows[0][0] is not None else 0


VERSION = f"SELECT max(version) FROM {VERSION_TABLE}"


class Store:
    """The ledger's statements over one engine.

    >>> from idemctl.storage import open_engine
    >>> store = Store(open_engine(":memory:"))
    >>> store.init(0, dry_run=False).action.value
    'created'
    >>> store.claim("acct", "k", "fp", 1, 1000)
    1
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.dialect = engine.dialect
        spell = engine.dialect.params
        self._sql: dict[str, str] = {}
        self._spell = spell
        self._tables: frozenset[str] | None = None
        self._checked = False
        # Where the last batch that deleted rows ended (the newest timestamp
        # it deleted). While a backlog drains, the next batch starts its index
        # walk there: on PostgreSQL the rows earlier batches deleted stay in
        # the index as dead entries until VACUUM, and a walk from the start
        # would step over all of them. Rows only get newer (claims and
        # takeovers write the current time), so nothing is left below it;
        # it is dropped once a sweep finds nothing due, after one more walk
        # from the start.
        self._sweep_from = FROM_THE_START
        # The last batch was full: the backlog goes on, and the next batch
        # skips the probe (its DELETE decides on its own anyway).
        self._draining = False

    # -- plumbing -------------------------------------------------------------------
    def sql(self, text: str) -> str:
        """A statement as this engine spells it (cached: the hot path asks twice a request)."""
        spelled = self._sql.get(text)
        if spelled is None:
            form = text if self.dialect.returning else WITHOUT_RETURNING.get(text, text)
            if not self.dialect.returning and "RETURNING" in form:
                raise StorageError(f"no form for {self.dialect.name} of: {' '.join(text.split())}")
            spelled = self._sql[text] = self._spell(form)
        return spelled

    def _read(self, text: str, params: Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
        return self.engine.read(self.sql(text), params or {})

    def _write(self, text: str, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        return self.engine.write(self.sql(text), params)

    def describe(self) -> str:
        return self.engine.describe()

    def close(self) -> None:
        self.engine.close()

    @property
    def drain_batch(self) -> int:
        return self.dialect.drain_batch

    def run(self, statement: Statement[R]) -> R:
        """Run a built statement on this store's engine and decode its rows."""
        if statement.write:
            self._guard()
            return statement.decode(self.engine.write(statement.sql, statement.params))
        return statement.decode(self.engine.read(statement.sql, statement.params))

    def database_now_statement(self) -> Statement[int]:
        return Statement(self.sql(self.dialect.now_sql), {}, _database_ms, False)

    def database_now(self) -> int:
        """The database server's clock in ms since the epoch (one round trip)."""
        return self.run(self.database_now_statement())

    def decode_row(self, values: tuple[Any, ...]) -> StoredRow:
        """A row as stored, or MalformedRowError naming what is wrong with it."""
        principal, key, fp, status, generation, rstatus, rbody, rheaders, created, updated = values
        text = self.dialect.read_text
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
        body = self.dialect.read_body(rbody)
        if body is not None and not isinstance(body, (str, bytes)):
            raise MalformedRowError(principal, key, f"response_body {rbody!r} is neither text nor bytes")
        return StoredRow(
            principal=principal,
            key=key,
            fingerprint=fp,
            status=state,
            generation=_int(generation, "generation", principal, key) or 0,
            response_status=_int(rstatus, "response_status", principal, key, nullable=True),
            response_body=body,
            response_headers=rheaders,
            created_at=_int(created, "created_at", principal, key) or 0,
            updated_at=_int(updated, "updated_at", principal, key) or 0,
        )

    # -- schema ---------------------------------------------------------------------
    def tables(self) -> frozenset[str]:
        """Which of idemctl's tables exist. Only a complete schema is
        remembered (idemctl never drops a table): while one is missing,
        every use looks again, because `idemctl init` in another process may
        have just created it. A current ledger pays nothing; an outdated one
        one catalog read per use, and only until it is upgraded."""
        if self._tables is not None:
            return self._tables
        found = frozenset(self.engine.table_names(TABLES))
        if len(found) == len(TABLES):
            self._tables = found
        return found

    def forget_schema(self) -> None:
        """Look the tables up again at next use (another process may have run init)."""
        self._tables = None

    def has_fenced_log(self) -> bool:
        return FENCED_TABLE in self.tables()

    def _version_in(
        self, tables: frozenset[str] | set[str], read: Callable[[str], list[tuple[Any, ...]]]
    ) -> int | None:
        if LEDGER_TABLE not in tables:
            return None
        if VERSION_TABLE not in tables:
            return 0
        return _version(read(VERSION))

    def schema_version(self) -> int | None:
        """None: no ledger table; 0: the recipe's table only; N: idemctl schema N."""
        self.forget_schema()
        return self._version_in(self.tables(), lambda text: self._read(text))

    def check_not_newer(self) -> None:
        """Refuse a ledger written by a newer idemctl before writing to it."""
        version = self.schema_version()
        if version is not None and version > SCHEMA_VERSION:
            raise SchemaTooNewError(self.describe(), version, SCHEMA_VERSION)
        self._checked = version is not None

    def _guard(self) -> None:
        # Once per store (and so per process), before its first write.
        if not self._checked:
            self.check_not_newer()

    def init(self, now: int, dry_run: bool) -> InitResult:
        """Create or upgrade the schema in one transaction that the engine
        serialises against other inits."""

        def decide(tx: SchemaTx) -> InitResult:
            before = self._version_in(tx.table_names(TABLES), lambda text: tx.execute(self.sql(text), {}))
            if before is not None and before > SCHEMA_VERSION:
                raise SchemaTooNewError(self.describe(), before, SCHEMA_VERSION)
            if before == SCHEMA_VERSION:
                return InitResult(InitAction.UP_TO_DATE, before, SCHEMA_VERSION, dry_run)
            action = InitAction.CREATED if before is None else InitAction.UPGRADED
            if before == 0:
                tx.check_recipe_table()
            if dry_run:
                return InitResult(action, before, SCHEMA_VERSION, dry_run)
            floor = -1 if before is None else before
            for f in schema_files(self.dialect.name):
                if f.version > floor:
                    tx.script(f.sql)
            mine = tx.execute(self.sql(INSERT_VERSION), {"version": SCHEMA_VERSION, "now": now})
            if not mine:
                # Another init decided from the same state and committed first
                # (with no version table there was nothing to lock); our
                # IF NOT EXISTS DDL did nothing. Whoever inserted the row did the work.
                return InitResult(InitAction.UP_TO_DATE, SCHEMA_VERSION, SCHEMA_VERSION, dry_run)
            return InitResult(action, before, SCHEMA_VERSION, dry_run)

        result = self.engine.migrate(decide, write=not dry_run)
        self.forget_schema()
        return result

    # -- request path -----------------------------------------------------------------
    # Each step: `*_statement` builds it, the method of the step's own name runs it.
    def claim_statement(
        self, principal: str, key: str, fingerprint: str, token: int, now: int
    ) -> Statement[int | None]:
        limit = self.dialect.max_principal_bytes
        if limit is not None and len(principal.encode("utf-8")) > limit:
            # Refused before any statement, as for the principals no engine can store.
            raise InvalidPrincipalError(
                f"principal is {len(principal.encode('utf-8'))} bytes in UTF-8; "
                f"a {self.dialect.name} ledger stores principals of up to {limit} bytes"
            )
        params = {"principal": principal, "key": key, "fingerprint": fingerprint, "token": token, "now": now}
        return Statement(self.sql(CLAIM), params, _first_int, True)

    def claim(self, principal: str, key: str, fingerprint: str, token: int, now: int) -> int | None:
        return self.run(self.claim_statement(principal, key, fingerprint, token, now))

    def lookup_statement(self, principal: str, key: str) -> Statement[StoredRow | None]:
        return Statement(self.sql(LOOKUP), {"principal": principal, "key": key}, self._decode_first_row, False)

    def _decode_first_row(self, rows: Rows) -> StoredRow | None:
        return self.decode_row(rows[0]) if rows else None

    def lookup(self, principal: str, key: str) -> StoredRow | None:
        return self.run(self.lookup_statement(principal, key))

    def takeover_statement(
        self, principal: str, key: str, fingerprint: str, token: int, now: int, stale_before: int, expired_before: int
    ) -> Statement[int | None]:
        params = {
            "principal": principal,
            "key": key,
            "fingerprint": fingerprint,
            "token": token,
            "now": now,
            "stale_before": stale_before,
            "expired_before": expired_before,
        }
        return Statement(self.sql(TAKEOVER), params, _first_int, True)

    def takeover(
        self, principal: str, key: str, fingerprint: str, token: int, now: int, stale_before: int, expired_before: int
    ) -> int | None:
        """A stale reservation of this request, or any row past retention,
        as the next generation (see TAKEOVER); None when neither."""
        return self.run(self.takeover_statement(principal, key, fingerprint, token, now, stale_before, expired_before))

    def complete_statement(
        self,
        principal: str,
        key: str,
        generation: int,
        token: int | None,
        status: int,
        body: str | bytes | None,
        headers_json: str,
        now: int,
    ) -> Statement[bool]:
        params = {
            "principal": principal,
            "key": key,
            "generation": generation,
            "token": token,
            "status": status,
            "body": self.dialect.bind_body(body),
            "headers": headers_json,
            "now": now,
        }
        return Statement(self.sql(COMPLETE), params, _any_row, True)

    def complete(
        self,
        principal: str,
        key: str,
        generation: int,
        token: int | None,
        status: int,
        body: str | bytes | None,
        headers_json: str,
        now: int,
    ) -> bool:
        return self.run(self.complete_statement(principal, key, generation, token, status, body, headers_json, now))

    def release_statement(self, principal: str, key: str, generation: int, token: int | None) -> Statement[bool]:
        params = {"principal": principal, "key": key, "generation": generation, "token": token}
        return Statement(self.sql(RELEASE), params, _any_row, True)

    def release(self, principal: str, key: str, generation: int, token: int | None) -> bool:
        return self.run(self.release_statement(principal, key, generation, token))

    def record_fenced_statement(
        self, principal: str, key: str, generation: int, computed_status: int, now: int
    ) -> Statement[FencedEvent | None]:
        """Only for a ledger with the fenced-out log (`has_fenced_log`)."""
        params = {"principal": principal, "key": key, "generation": generation, "status": computed_status, "now": now}
        return Statement(self.sql(RECORD_FENCED), params, _fenced_event, True)

    def renew(self, held: Sequence[tuple[str, str, int, int | None]], now: int) -> int:
        """Move `updated_at` to `now` for every (principal, key, generation,
        token) still pending as held; how many rows were renewed (on
        MariaDB/MySQL, rows whose `updated_at` changed). One statement per
        RENEW_MAX reservations."""
        self._guard()
        renewed = 0
        for start in range(0, len(held), RENEW_MAX):
            chunk = list(held[start : start + RENEW_MAX])
            size = 1 << (len(chunk) - 1).bit_length()
            chunk += [chunk[-1]] * (size - len(chunk))  # a repeated row matches once
            params: dict[str, Any] = {"now": now}
            for i, (principal, key, generation, token) in enumerate(chunk):
                params.update({f"p{i}": principal, f"k{i}": key, f"g{i}": generation, f"t{i}": token})
            renewed += len(self._write(renew_text(size, self.dialect.returning), params))
        return renewed

    def record_fenced(
        self, principal: str, key: str, generation: int, computed_status: int, now: int
    ) -> FencedEvent | None:
        if not self.has_fenced_log():
            return None
        if not self.dialect.returning:
            # No RETURNING: the insert hands back the event's id; the event is read back by it.
            params = {"principal": principal, "key": key, "generation": generation}
            rows = self._write(RECORD_FENCED, {**params, "status": computed_status, "now": now})
            return self._event(self._read(FENCED_EVENT, {"id": rows[0][0]})[0]) if rows else None
        return self.run(self.record_fenced_statement(principal, key, generation, computed_status, now))

    def _event(self, values: tuple[Any, ...]) -> FencedEvent:
        decoded = list(values)
        decoded[1:3] = [self.dialect.read_text(v) for v in values[1:3]]
        return FencedEvent(*decoded)

    # -- sweep ------------------------------------------------------------------------------
    def sweep(self, now: int, cutoff: int, fenced_cutoff: int, limit: int) -> SweepResult:
        """At most `limit` expired rows and `limit` expired fenced-out events,
        in one turn of the engine's writer queue (see `sweep_steps`)."""
        self._guard()
        steps = self.sweep_steps(now, cutoff, fenced_cutoff, limit, self.has_fenced_log())
        sent: Any = None
        while True:
            try:
                step = steps.send(sent)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            if isinstance(step, Turn):
                sent = self.engine.write_turn(step.statements)
            else:
                sent = self.engine.read(step.sql, step.params)

    def sweep_steps(self, now: int, cutoff: int, fenced_cutoff: int, limit: int, fenced_log: bool) -> SweepSteps:
        """The sweep's statements as steps, run by `sweep` here and by the
        asynchronous store: it yields a read or a Turn and is sent its rows.
        First one indexed read of
        the oldest timestamps: when nothing is past retention it deletes
        nothing, takes no write lock, and says in `quiet_for_ms` how long
        nothing can be (rows only get newer). While a backlog drains (the
        last batch was full) the read is skipped. Not check-then-act: each
        DELETE decides on its own. `fenced_log`: whether the ledger has the
        fenced-out log (the caller asks `has_fenced_log`, its own way)."""
        if self._draining:
            self._draining = False
            keys, _ = yield from self._delete_batch(cutoff, limit, self._sweep_from, None)
            if keys:
                return SweepResult(keys, 0, cutoff, fenced_cutoff)
        probe = self.sql(OLDEST_WITH_FENCED if fenced_log else OLDEST)
        after = self._sweep_from
        while True:
            oldest = (yield Statement(probe, {"after": after}, _rows, False))[0]
            oldest_row = oldest[0]
            oldest_event = oldest[1] if fenced_log else None
            # With no row (or event), the first one to expire is one written from now on.
            row_headroom = (now if oldest_row is None else int(oldest_row)) - cutoff
            event_headroom = (now if oldest_event is None else int(oldest_event)) - fenced_cutoff
            if not fenced_log:
                event_headroom = row_headroom
            if row_headroom <= 0 or after == FROM_THE_START:
                break
            # Nothing due past the hint: one walk from the start makes sure
            # (a row written by a host whose clock lags would sit below it).
            after = self._sweep_from = FROM_THE_START
        if row_headroom > 0 and event_headroom > 0:
            return SweepResult(0, 0, cutoff, fenced_cutoff, min(row_headroom, event_headroom))
        fenced_cutoff_due = fenced_cutoff if fenced_log and event_headroom <= 0 else None
        if row_headroom > 0:
            (events,) = yield Turn([self._fenced_batch(fenced_cutoff, limit)])
            return SweepResult(0, len(events), cutoff, fenced_cutoff)
        keys, fenced = yield from self._delete_batch(cutoff, limit, int(oldest_row), fenced_cutoff_due)
        return SweepResult(keys, fenced, cutoff, fenced_cutoff)

    def _fenced_batch(self, cutoff: int, limit: int) -> tuple[str, Mapping[str, Any]]:
        return self.sql(SWEEP_FENCED), {"cutoff": cutoff, "limit": limit}

    def _delete_batch(
        self, cutoff: int, limit: int, after: int, fenced_cutoff: int | None
    ) -> Generator[Turn, Any, tuple[int, int]]:
        """One batch of expired rows from `after` on, and one of the
        fenced-out log's when `fenced_cutoff` is given, in one turn; it
        remembers where the rows' batch ended."""
        batch = {"after": after, "cutoff": cutoff, "limit": limit}
        statements: list[tuple[str, Mapping[str, Any]]] = [(self.sql(self.dialect.sweep_keys), batch)]
        if fenced_cutoff is not None:
            statements.append(self._fenced_batch(fenced_cutoff, limit))
        results = yield Turn(statements)
        keys, newest = self.dialect.sweep_tally(results[0])
        if newest is not None:
            self._sweep_from = newest
        self._draining = keys >= limit
        return keys, len(results[1]) if fenced_cutoff is not None else 0

    def count_expired(self, cutoff: int) -> int:
        return int(self._read(COUNT_EXPIRED, {"cutoff": cutoff})[0][0])

    def count_fenced_expired(self, cutoff: int) -> int:
        if not self.has_fenced_log():
            return 0
        return int(self._read(COUNT_FENCED_EXPIRED, {"cutoff": cutoff})[0][0])

    # -- copying ------------------------------------------------------------------------------
    def count_rows(self) -> int:
        return int(self._read(COUNT_ROWS)[0][0])

    def _full_row(self, values: tuple[Any, ...]) -> LedgerRow:
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
        principal, key = self.dialect.read_text(principal), self.dialect.read_text(key)
        if not isinstance(principal, str) or not isinstance(key, str):
            raise MalformedRowError(principal, key, "principal and key must be text")
        for name, value in (("fingerprint", fp), ("status", status), ("response_headers", rheaders)):
            if value is not None and not isinstance(value, str):
                raise MalformedRowError(principal, key, f"{name} {value!r} is not text")
        try:
            body = _exact_bytes(rbody)
        except TypeError:
            raise MalformedRowError(principal, key, f"response_body {rbody!r} is neither text nor bytes") from None
        return LedgerRow(
            principal,
            key,
            fp,
            status,
            _int(generation, "generation", principal, key) or 0,
            _int(token, "token", principal, key, nullable=True),
            _int(rstatus, "response_status", principal, key, nullable=True),
            body,
            rheaders,
            _int(created, "created_at", principal, key) or 0,
            _int(updated, "updated_at", principal, key) or 0,
        )

    def copy_page(self, after: tuple[str, str] | None, limit: int, *, with_token: bool = True) -> list[LedgerRow]:
        """At most `limit` rows in primary-key order, after `after` (None: from the start).
        A ledger older than the token column copies its rows with none."""
        columns = ", ".join(c if c != "token" or with_token else "NULL" for c in COPY_COLUMNS)
        params: dict[str, Any] = {"limit": limit}
        where = ""
        if after is not None:
            where = _COPY_AFTER if self.dialect.returning else _MYSQL_COPY_AFTER
            params["after_principal"], params["after_key"] = after
        rows = self._read(_COPY_PAGE.format(columns=columns, after=where), params)
        return [self._full_row(values) for values in rows]

    def rows_at(self, keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], LedgerRow]:
        """The rows of these (principal, key) pairs that exist, in one statement
        (an OR of primary-key lookups: every engine answers it from the index)."""
        if not keys:
            return {}
        if self.dialect.batch_arrays:
            principals, names = zip(*keys, strict=True)
            rows = self._read(_ROWS_AT_ARRAYS, {"principals": list(principals), "keys": list(names)})
        else:
            params: dict[str, Any] = {}
            tests = []
            for i, (principal, key) in enumerate(keys):
                params[f"p{i}"], params[f"k{i}"] = principal, key
                tests.append(f"(principal = :p{i} AND key = :k{i})")
            sql = f"SELECT {', '.join(COPY_COLUMNS)} FROM idempotency_keys WHERE {' OR '.join(tests)}"
            # Spelled without the cache: the text differs with the number of keys.
            rows = self.engine.read(self._spell(sql), params)
        found = (self._full_row(values) for values in rows)
        return {row.where: row for row in found}

    def _bind_row(self, row: LedgerRow, suffix: str = "") -> dict[str, Any]:
        params: dict[str, Any] = {f"{name}{suffix}": value for name, value in zip(COPY_COLUMNS, row, strict=True)}
        params[f"response_body{suffix}"] = self.dialect.bind_body(_as_stored(row.response_body))
        return params

    def _columns(self, rows: Sequence[LedgerRow]) -> dict[str, Any]:
        """The rows as one list per column (Dialect.batch_arrays)."""
        by_column = zip(*rows, strict=True)
        columns: dict[str, Any] = {name: list(c) for name, c in zip(COPY_COLUMNS, by_column, strict=True)}
        bind = self.dialect.bind_body
        columns["response_body"] = [bind(_as_stored(body)) for body in columns["response_body"]]
        return columns

    def copy_insert(self, rows: Sequence[LedgerRow]) -> set[tuple[str, str]]:
        """Insert the rows that are absent, in one statement; which ones it inserted."""
        if not rows:
            return set()
        self._guard()
        if self.dialect.batch_arrays:
            return {(str(p), str(k)) for p, k in self._write(_COPY_INSERT_ARRAYS, self._columns(rows))}
        if not self.dialect.returning:
            return self._row_by_row(_MYSQL_COPY_INSERT, rows)
        params: dict[str, Any] = {}
        values = []
        for i, row in enumerate(rows):
            params.update(self._bind_row(row, f"_{i}"))
            values.append("(" + ", ".join(f":{name}_{i}" for name in COPY_COLUMNS) + ")")
        sql = _COPY_INSERT.format(columns=", ".join(COPY_COLUMNS), values=", ".join(values))
        return {(str(p), str(k)) for p, k in self.engine.write(self._spell(sql), params)}

    def copy_update(self, rows: Sequence[LedgerRow]) -> set[tuple[str, str]]:
        """Overwrite the stored versions of these rows that are older (COPY_UPDATE's
        WHERE); which ones it overwrote. With arrays, one statement for all;
        else one statement a row, all in one turn of the engine's writers."""
        if not rows:
            return set()
        self._guard()
        if self.dialect.batch_arrays:
            return {(str(p), str(k)) for p, k in self._write(_COPY_UPDATE_ARRAYS, self._columns(rows))}
        return self._row_by_row(COPY_UPDATE if self.dialect.returning else MYSQL_COPY_UPDATE, rows)

    def _row_by_row(self, text: str, rows: Sequence[LedgerRow]) -> set[tuple[str, str]]:
        """One statement a row, all in one turn of the engine's writers; the
        rows whose statement returned (or affected) a row."""
        sql = self.sql(text)
        done = self.engine.write_turn([(sql, self._bind_row(row)) for row in rows])
        return {row.where for row, returned in zip(rows, done, strict=True) if returned}

    def fenced_page(self, after: int, limit: int) -> list[FencedEvent]:
        """At most `limit` fenced-out events with an id above `after`, by id."""
        if not self.has_fenced_log():
            return []
        return [self._event(values) for values in self._read(_COPY_FENCED_PAGE, {"after": after, "limit": limit})]

    def copy_fenced(self, event: FencedEvent) -> bool:
        """Record this event unless an equal one is there already."""
        self._guard()
        return bool(self._write(COPY_FENCED if self.dialect.returning else MYSQL_COPY_FENCED, _event_params(event)))

    def has_event(self, event: FencedEvent) -> bool:
        same = _SAME_EVENT if self.dialect.returning else _MYSQL_SAME_EVENT
        return bool(self._read(f"SELECT 1 FROM idemctl_fenced_out WHERE {same}", _event_params(event)))

    # -- operator side ----------------------------------------------------------------------------
    def iter_pending(
        self,
        state: State | None,
        stale_before: int,
        expired_before: int,
        principal: str | None,
        limit: int | None,
    ) -> Iterator[tuple[Any, ...]]:
        """Raw pending rows, oldest first, streamed (decoding is the caller's,
        so that one malformed row does not end the listing)."""
        sql = f"SELECT {ROW_COLUMNS} FROM idempotency_keys WHERE status = 'pending'"
        params: dict[str, Any] = {"stale_before": stale_before, "expired_before": expired_before}
        if state is not None:
            sql += f" AND {STATE_SQL[state]}"
        if principal is not None:
            sql += " AND principal = :principal"
            params["principal"] = principal
        sql += " ORDER BY updated_at, principal, key"
        if limit is not None:
            sql += " LIMIT :limit"
            params["limit"] = limit
        return self.engine.stream(self.sql(sql), params)

    def iter_fenced(
        self, principal: str | None, key: str | None, since: int | None, limit: int | None
    ) -> Iterator[FencedEvent]:
        if not self.has_fenced_log():
            return
        sql = f"SELECT {EVENT_COLUMNS} FROM idemctl_fenced_out WHERE 1 = 1"
        params: dict[str, Any] = {}
        for clause, name, value in (
            ("principal = :principal", "principal", principal),
            ("key = :key", "key", key),
            ("fenced_at >= :since", "since", since),
        ):
            if value is not None:
                sql += f" AND {clause}"
                params[name] = value
        sql += " ORDER BY fenced_at DESC, id DESC"
        if limit is not None:
            sql += " LIMIT :limit"
            params["limit"] = limit
        for values in self._read(sql, params):
            yield self._event(values)

    def stats(self, now: int, stale_before: int, expired_before: int) -> Stats:
        counts = self._read(STATS, {"stale_before": stale_before, "expired_before": expired_before})[0]
        fenced = int(self._read(COUNT_FENCED)[0][0]) if self.has_fenced_log() else 0
        total, fresh, stale, completed, expired, taken, oldest_p, oldest_c, oldest = counts
        return Stats(
            now=now,
            total=int(total),
            pending_fresh=int(fresh),
            pending_stale=int(stale),
            completed=int(completed),
            expired=int(expired),
            taken_over=int(taken),
            fenced_out_events=fenced,
            oldest_pending_at=None if oldest_p is None else int(oldest_p),
            oldest_completed_at=None if oldest_c is None else int(oldest_c),
            oldest_row_at=None if oldest is None else int(oldest),
            storage_bytes=self.engine.storage_bytes(TABLES),
            schema_version=self.schema_version() or 0,
        )

    def purge(self, principal: str, key: str, stale_before: int | None) -> PurgeResult:
        self._guard()
        if not self.dialect.returning:
            return self._purge_by_version(principal, key, stale_before)
        rows = self._write(PURGE, {"principal": principal, "key": key, "stale_before": stale_before})
        if rows:
            return PurgeResult(PurgeOutcome.PURGED, self.decode_row(rows[0]))
        row = self.lookup(principal, key)
        if row is None:
            return PurgeResult(PurgeOutcome.NOT_FOUND, None)
        return PurgeResult(PurgeOutcome.REFUSED_FRESH_PENDING, row)

    def _purge_by_version(self, principal: str, key: str, stale_before: int | None) -> PurgeResult:
        where = {"principal": principal, "key": key}
        seen = self._read(PURGE_READ, where)
        for _ in range(PURGE_TRIES):
            if not seen:
                return PurgeResult(PurgeOutcome.NOT_FOUND, None)
            *values, token = seen[0]
            row = self.decode_row(tuple(values))
            _, _, _, status, generation, _, _, _, _, updated = values
            version = {"token": token, "generation": generation, "status": status, "updated_at": updated}
            if self._write(PURGE_VERSION, {**where, **version, "stale_before": stale_before}):
                return PurgeResult(PurgeOutcome.PURGED, row)
            again = self._read(PURGE_READ, where)
            if again == seen:
                # The same version is still there: the WHERE refused it.
                return PurgeResult(PurgeOutcome.REFUSED_FRESH_PENDING, row)
            seen = again
        # Rewritten under us every time: as busy as a fresh reservation.
        if not seen:
            return PurgeResult(PurgeOutcome.NOT_FOUND, None)
        return PurgeResult(PurgeOutcome.REFUSED_FRESH_PENDING, self.decode_row(tuple(seen[0][:-1])))


def _event_params(event: FencedEvent) -> dict[str, Any]:
    return {
        "principal": event.principal,
        "key": event.key,
        "superseded": event.superseded_generation,
        "current": event.current_generation,
        "status": event.computed_status,
        "fenced_at": event.fenced_at,
    }
