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
from collections.abc import Callable, Iterator, Mapping
from typing import Any

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
from .engine import Engine, SchemaTx

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

# Still pending, still stale, still the same request: all in the WHERE, so
# two racers cannot both take over. The new owner draws a new token.
TAKEOVER = """
UPDATE idempotency_keys
SET generation = generation + 1, token = :token, updated_at = :now
WHERE principal = :principal AND key = :key AND status = 'pending'
  AND fingerprint = :fingerprint AND updated_at < :stale_before
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

# The new generation travels back through LAST_INSERT_ID(expr), set by the
# very assignment the WHERE allowed.
MYSQL_TAKEOVER = """
UPDATE idempotency_keys
SET generation = LAST_INSERT_ID(generation + 1), token = :token, updated_at = :now
WHERE principal = :principal AND key = :key AND status = 'pending'
  AND fingerprint = :fingerprint AND updated_at < :stale_before
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

    def database_now(self) -> int:
        """The database server's clock in ms since the epoch (one round trip)."""
        return int(self._read(self.dialect.now_sql)[0][0])

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
        """Which of idemctl's tables exist (looked up once, again after init)."""
        if self._tables is None:
            self._tables = frozenset(self.engine.table_names(TABLES))
        return self._tables

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
        rows = read(f"SELECT max(version) FROM {VERSION_TABLE}")
        return int(rows[0][0]) if rows and rows[0][0] is not None else 0

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
    def claim(self, principal: str, key: str, fingerprint: str, token: int, now: int) -> int | None:
        self._guard()
        limit = self.dialect.max_principal_bytes
        if limit is not None and len(principal.encode("utf-8")) > limit:
            # Refused before any statement, as for the principals no engine can store.
            raise InvalidPrincipalError(
                f"principal is {len(principal.encode('utf-8'))} bytes in UTF-8; "
                f"a {self.dialect.name} ledger stores principals of up to {limit} bytes"
            )
        params = {"principal": principal, "key": key, "fingerprint": fingerprint, "token": token, "now": now}
        rows = self._write(CLAIM, params)
        return int(rows[0][0]) if rows else None

    def lookup(self, principal: str, key: str) -> StoredRow | None:
        rows = self._read(LOOKUP, {"principal": principal, "key": key})
        return self.decode_row(rows[0]) if rows else None

    def takeover(
        self, principal: str, key: str, fingerprint: str, token: int, now: int, stale_before: int
    ) -> int | None:
        self._guard()
        params = {
            "principal": principal,
            "key": key,
            "fingerprint": fingerprint,
            "token": token,
            "now": now,
            "stale_before": stale_before,
        }
        rows = self._write(TAKEOVER, params)
        return int(rows[0][0]) if rows else None

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
        self._guard()
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
        return bool(self._write(COMPLETE, params))

    def release(self, principal: str, key: str, generation: int, token: int | None) -> bool:
        self._guard()
        params = {"principal": principal, "key": key, "generation": generation, "token": token}
        return bool(self._write(RELEASE, params))

    def record_fenced(
        self, principal: str, key: str, generation: int, computed_status: int, now: int
    ) -> FencedEvent | None:
        if not self.has_fenced_log():
            return None
        params = {"principal": principal, "key": key, "generation": generation, "status": computed_status, "now": now}
        rows = self._write(RECORD_FENCED, params)
        if rows and not self.dialect.returning:
            rows = self._read(FENCED_EVENT, {"id": rows[0][0]})
        return self._event(rows[0]) if rows else None

    def _event(self, values: tuple[Any, ...]) -> FencedEvent:
        decoded = list(values)
        decoded[1:3] = [self.dialect.read_text(v) for v in values[1:3]]
        return FencedEvent(*decoded)

    # -- sweep ------------------------------------------------------------------------------
    def sweep(self, now: int, cutoff: int, fenced_cutoff: int, limit: int) -> SweepResult:
        """At most `limit` expired rows and `limit` expired fenced-out events,
        in one turn of the engine's writer queue. First one indexed read of
        the oldest timestamps: when nothing is past retention it deletes
        nothing, takes no write lock, and says in `quiet_for_ms` how long
        nothing can be (rows only get newer). While a backlog drains (the
        last batch was full) the read is skipped. Not check-then-act: each
        DELETE decides on its own."""
        self._guard()
        if self._draining:
            self._draining = False
            keys, _ = self._delete_batch(cutoff, limit, self._sweep_from, None)
            if keys:
                return SweepResult(keys, 0, cutoff, fenced_cutoff)
        fenced_log = self.has_fenced_log()
        probe = self.sql(OLDEST_WITH_FENCED if fenced_log else OLDEST)
        after = self._sweep_from
        while True:
            oldest = self.engine.read(probe, {"after": after})[0]
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
            (events,) = self.engine.write_turn([self._fenced_batch(fenced_cutoff, limit)])
            return SweepResult(0, len(events), cutoff, fenced_cutoff)
        keys, fenced = self._delete_batch(cutoff, limit, int(oldest_row), fenced_cutoff_due)
        return SweepResult(keys, fenced, cutoff, fenced_cutoff)

    def _fenced_batch(self, cutoff: int, limit: int) -> tuple[str, Mapping[str, Any]]:
        return self.sql(SWEEP_FENCED), {"cutoff": cutoff, "limit": limit}

    def _delete_batch(self, cutoff: int, limit: int, after: int, fenced_cutoff: int | None) -> tuple[int, int]:
        """One batch of expired rows from `after` on, and one of the
        fenced-out log's when `fenced_cutoff` is given, in one turn; it
        remembers where the rows' batch ended."""
        batch = {"after": after, "cutoff": cutoff, "limit": limit}
        statements: list[tuple[str, Mapping[str, Any]]] = [(self.sql(self.dialect.sweep_keys), batch)]
        if fenced_cutoff is not None:
            statements.append(self._fenced_batch(fenced_cutoff, limit))
        results = self.engine.write_turn(statements)
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
