"""Copying a ledger to another, statement by statement: every statement
reads one page or writes one batch, and decides row by row in its own WHERE
(or conflict clause), so a live destination is never overwritten with an
older version of a row. copying.py drives it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..outcomes import FencedEvent
from .rows import LedgerRow, as_stored, decode_full_row
from .statements import EVENT_COLUMNS, without_returning
from .store_base import StoreBase

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
# destination since it was read is left alone (and looked at again). No
# conflict target: a row whose key the destination holds in its other form
# ("k" there, k here: one key_id) is left alone too, never an error.
_COPY_INSERT = """
INSERT INTO idempotency_keys ({columns})
VALUES {values}
ON CONFLICT DO NOTHING
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
ON CONFLICT DO NOTHING
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
MYSQL_COPY_UPDATE = without_returning(COPY_UPDATE)
_MYSQL_SAME_EVENT = """principal = :principal AND key = :key AND superseded_generation = :superseded
  AND current_generation <=> :current AND computed_status = :status AND fenced_at = :fenced_at"""
MYSQL_COPY_FENCED = f"""
INSERT INTO idemctl_fenced_out
  (principal, key, superseded_generation, current_generation, computed_status, fenced_at)
SELECT :principal, :key, :superseded, :current, :status, :fenced_at FROM DUAL
WHERE NOT EXISTS (SELECT 1 FROM idemctl_fenced_out WHERE {_MYSQL_SAME_EVENT})
"""

COUNT_ROWS = "SELECT count(*) FROM idempotency_keys"

# The oversize sentinel's status (responses.OVERSIZE_STATUS, a layer above).
_SENTINEL_STATUS = 500


class CopyStatements(StoreBase):
    """The statements `idemctl copy` runs on either ledger."""

    def count_rows(self) -> int:
        return int(self._read(COUNT_ROWS)[0][0])

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
        return [decode_full_row(self.dialect, values) for values in rows]

    def rows_at(self, keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], LedgerRow]:
        """The rows of these (principal, key) pairs that exist, in one statement
        (an OR of primary-key lookups: every engine answers it from the index)."""
        if not keys:
            return {}
        if self.dialect.batch_arrays:
            principals, names = zip(*keys, strict=True)
            rows = self._read(_ROWS_AT_ARRAYS, {"principals": list(principals), "keys": list(names)})
        else:
            per = len(keys) if self.dialect.max_params is None else self.dialect.max_params // 2
            rows = []
            for start in range(0, len(keys), per):
                params: dict[str, Any] = {}
                tests = []
                for i, (principal, key) in enumerate(keys[start : start + per]):
                    params[f"p{i}"], params[f"k{i}"] = principal, key
                    tests.append(f"(principal = :p{i} AND key = :k{i})")
                sql = f"SELECT {', '.join(COPY_COLUMNS)} FROM idempotency_keys WHERE {' OR '.join(tests)}"
                # Spelled without the cache: the text differs with the number of keys.
                rows.extend(self.engine.read(self._spell(sql), params))
        found = (decode_full_row(self.dialect, values) for values in rows)
        return {row.where: row for row in found}

    def _bind_row(self, row: LedgerRow, suffix: str = "") -> dict[str, Any]:
        params: dict[str, Any] = {f"{name}{suffix}": value for name, value in zip(COPY_COLUMNS, row, strict=True)}
        body = as_stored(row.response_body)
        if type(body) is bytes and not self.dialect.binary_bodies:
            # A ledger that cannot hold bytes keeps the key with the sentinel
            # an answer it cannot hold gets (ledger/steps.py): replays fail
            # loudly, and the mutation never runs again.
            params[f"response_status{suffix}"], body = _SENTINEL_STATUS, None
        params[f"response_body{suffix}"] = self.dialect.body.bind(body)
        return params

    def _columns(self, rows: Sequence[LedgerRow]) -> dict[str, Any]:
        """The rows as one list per column (Dialect.batch_arrays)."""
        by_column = zip(*rows, strict=True)
        columns: dict[str, Any] = {name: list(c) for name, c in zip(COPY_COLUMNS, by_column, strict=True)}
        bind = self.dialect.body.bind
        columns["response_body"] = [bind(as_stored(body)) for body in columns["response_body"]]
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
        per = len(rows) if self.dialect.max_params is None else self.dialect.max_params // len(COPY_COLUMNS)
        statements = [self._insert_values(rows[i : i + per]) for i in range(0, len(rows), per)]
        # An engine that binds few parameters a statement: several, in one turn.
        done = [self.engine.write(*statements[0])] if len(statements) == 1 else self.engine.write_turn(statements)
        return {(str(p), str(k)) for rows_back in done for p, k in rows_back}

    def _insert_values(self, rows: Sequence[LedgerRow]) -> tuple[str, dict[str, Any]]:
        params: dict[str, Any] = {}
        values = []
        for i, row in enumerate(rows):
            params.update(self._bind_row(row, f"_{i}"))
            values.append("(" + ", ".join(f":{name}_{i}" for name in COPY_COLUMNS) + ")")
        return self._spell(_COPY_INSERT.format(columns=", ".join(COPY_COLUMNS), values=", ".join(values))), params

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


def _event_params(event: FencedEvent) -> dict[str, Any]:
    return {
        "principal": event.principal,
        "key": event.key,
        "superseded": event.superseded_generation,
        "current": event.current_generation,
        "status": event.computed_status,
        "fenced_at": event.fenced_at,
    }
