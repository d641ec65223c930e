"""Every statement of the request path, the sweep, the schema version and
the operator's counts, written once with ``:name`` parameters; an engine's
dialect spells them. For an engine without RETURNING (MariaDB, MySQL) the
forms written for it below decide in the same WHERE clauses (Store.sql picks
them through WITHOUT_RETURNING). The copy's statements are in
copy_statements.py."""

from __future__ import annotations

import random
import re
from collections.abc import Mapping

from ..outcomes import State
from .rows import STALE_PENDING_SQL, STATE_SQL

LEDGER_TABLE = "idempotency_keys"
FENCED_TABLE = "idemctl_fenced_out"
VERSION_TABLE = "idemctl_schema_version"
TABLES = (LEDGER_TABLE, FENCED_TABLE, VERSION_TABLE)

# The schema version whose request path this idemctl runs: the fencing token
# column arrived in version 2, the key_id column (a key's identity) in 3.
REQUEST_PATH_VERSION = 3

ROW_COLUMNS = (
    "principal, key, fingerprint, status, generation, response_status, "
    "response_body, response_headers, created_at, updated_at"
)
EVENT_COLUMNS = "id, principal, key, superseded_generation, current_generation, computed_status, fenced_at"

# -- the request path: one statement each ----------------------------------------
# A row is found by (principal, key_id): key_id is the key its stored value
# names ("k", as an older writer stored the header, and k are one key; see
# schema/*/0004_idemctl_v3.sql), held unique by its own index. So the claim
# names no conflict target: a row in the way under either index means the
# key is taken, and the claim does nothing.

# key_id in RETURNING: on a ledger not yet upgraded to schema 3 the claim
# fails to compile (SchemaOutdatedError), so nothing is ever claimed that
# the key_id index does not guard.
CLAIM = """
INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, token, created_at, updated_at)
VALUES (:principal, :key, :fingerprint, 'pending', 1, :token, :now, :now)
ON CONFLICT DO NOTHING
RETURNING generation, key_id
"""

LOOKUP = f"SELECT {ROW_COLUMNS} FROM idempotency_keys WHERE principal = :principal AND key_id = :key"
# An operator's read of a ledger not yet upgraded to schema 3 (no key_id):
# the row stored under the key, or under the key as an sf-string, as an
# older writer stored the header "k".
LOOKUP_STORED = (
    f"SELECT {ROW_COLUMNS} FROM idempotency_keys WHERE principal = :principal AND (key = :key OR key = :quoted)"
)

# CLAIM, and when the key is taken the row that holds it, in one statement
# (Dialect.claim_reads_row: PostgreSQL). The first column is the claimed
# generation, or NULL on the row that stands in the way. The SELECT reads
# the statement's snapshot: a row committed by another request while this
# one waited for it to commit is taken (the INSERT sees it) but not seen,
# and no row comes back; the caller looks the key up then (decision.decide).
# The decision is still the INSERT's alone: the row read only says what
# stood in the way.
CLAIM_OR_READ = f"""
WITH claimed AS (
  INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, token, created_at, updated_at)
  VALUES (:principal, :key, :fingerprint, 'pending', 1, :token, :now, :now)
  ON CONFLICT DO NOTHING
  RETURNING generation
)
SELECT generation, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM claimed
UNION ALL
SELECT NULL, {ROW_COLUMNS} FROM idempotency_keys
WHERE principal = :principal AND key_id = :key AND NOT EXISTS (SELECT FROM claimed)
"""

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
WHERE principal = :principal AND key_id = :key
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
WHERE principal = :principal AND key_id = :key AND generation = :generation
  AND token = :token AND status = 'pending'
RETURNING generation
"""

# After a connection was lost during COMPLETE, and COMPLETE run again found
# the row no longer pending under our generation and token: did the lost
# try commit (the row holds our answer, under our generation and token) or
# did a takeover fence us out? A read decides nothing that writes: a row
# completed under our token stays so until it expires or is purged. The
# answer is compared too, so a second completion of one reservation with
# another answer is never mistaken for the stored one.
COMPLETED_AS = """
SELECT generation FROM idempotency_keys
WHERE principal = :principal AND key_id = :key AND generation = :generation
  AND token = :token AND status = 'completed' AND response_status = :status
  AND response_headers = :headers
  AND (response_body = :body OR (response_body IS NULL AND :no_body = 1))
"""

RELEASE = """
DELETE FROM idempotency_keys
WHERE principal = :principal AND key_id = :key AND generation = :generation
  AND token = :token AND status = 'pending'
RETURNING generation
"""

# A live owner's reservations, renewed together (see leases.py): each row
# only while it is still pending under the very generation and token it was
# claimed with, so a renewal never revives or steals a row a takeover moved
# on. Each row must be reached through the key's unique index (principal,
# key_id: the key a row is found by, see CLAIM), so that a tick costs
# the same on a ledger of any size (a tick slower than the TTL lets a retry
# take a live owner's key over); how each engine's planner gets there is the
# dialect's `renew_form`:
#  - "values": `(principal, key_id, generation, token) IN (VALUES …)`, which
#    PostgreSQL plans as a nested loop of index scans on that index;
#  - "or" (MariaDB/MySQL): an OR of one equality conjunction per
#    reservation, a `range` on that index (their planners scan the whole
#    index for the VALUES form: a dependent subquery per row). FORCE INDEX
#    keeps it a range on a small table too, whatever the statistics say;
#  - "each": RENEW_ONE per reservation, all in one transaction (SQLite scans
#    the table for both forms above, or plans the OR as a multi-index OR
#    whose preparation alone costs a tick's worth at 512 terms).
# Lists are padded to a power of two (a repeated reservation matches once),
# so an engine sees few distinct texts.
RENEW_MAX = 512

RENEW_ONE = """
UPDATE idempotency_keys SET updated_at = :now
WHERE principal = :p0 AND key_id = :k0 AND generation = :g0 AND token = :t0 AND status = 'pending'
RETURNING generation
"""


def renew_text(size: int, form: str = "values", returning: bool = True) -> str:
    """The renewal of `size` reservations (parameters :p0, :k0, :g0, :t0, …)
    in the form `form` ("values" or "or"; "each" uses RENEW_ONE).

    >>> renew_text(2, "or", returning=False)[-75:]
    'OR (principal = :p1 AND key_id = :k1 AND generation = :g1 AND token = :t1))'
    """
    table = "idempotency_keys"
    if form == "or":
        match = " OR ".join(
            f"(principal = :p{i} AND key_id = :k{i} AND generation = :g{i} AND token = :t{i})" for i in range(size)
        )
        where = f"status = 'pending' AND ({match})"
        table += " FORCE INDEX (idx_idempotency_keys_key_id)"
    elif form == "values":
        values = ", ".join(f"(:p{i}, :k{i}, :g{i}, :t{i})" for i in range(size))
        where = f"status = 'pending' AND (principal, key_id, generation, token) IN (VALUES {values})"
    else:
        raise ValueError(f"no single statement renews in the form {form!r}")
    # Without RETURNING the engine hands back one row per affected row.
    text = f"UPDATE {table} SET updated_at = :now WHERE {where}"
    return text + (" RETURNING generation" if returning else "")


# One statement: the event and the generation the row held then are read and
# written together, so the log never disagrees with the row it describes.
RECORD_FENCED = f"""
INSERT INTO idemctl_fenced_out
  (principal, key, superseded_generation, current_generation, computed_status, fenced_at)
VALUES (:principal, :key, :generation,
        (SELECT generation FROM idempotency_keys WHERE principal = :principal AND key_id = :key),
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

VERSION = f"SELECT max(version) FROM {VERSION_TABLE}"


def new_token() -> int:
    """A fencing token: random, positive, exact in a signed 64-bit column
    and in a JavaScript number (below 2**53), which is how D1 hands integers
    to a Worker and to its HTTP API's callers."""
    # A token tells one owner of a key from the next; nobody outside the
    # ledger sees it, so it needs to be unlikely to repeat, not secret: the
    # random module's generator (seeded from the OS, seeded again in every
    # forked child) draws it in one C call, where os.urandom is a system
    # call on every claim.
    return _draw(53) or 1


_draw = random.getrandbits


def _count(where: str) -> str:
    return f"coalesce(sum(CASE WHEN {where} THEN 1 ELSE 0 END), 0)"


# The counts of `stats`. A stale reservation counts as stale whatever its age
# (STALE_PENDING_SQL); expired is every row past retention, the sweep's
# backlog, so a pending row past retention counts in both, and the count
# after them says how many did.
STATS = f"""
SELECT
  count(*),
  {_count(STATE_SQL[State.PENDING_FRESH])},
  {_count(STALE_PENDING_SQL)},
  {_count(STATE_SQL[State.COMPLETED])},
  {_count(STATE_SQL[State.EXPIRED])},
  {_count("status = 'pending' AND " + STATE_SQL[State.EXPIRED])},
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
WHERE principal = :principal AND key_id = :key
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


def without_returning(sql: str) -> str:
    """A statement whose RETURNING only said "a row matched": its
    affected-row count says the same."""
    return re.sub(r"\s*RETURNING [^;]*\Z", "\n", sql)


# A no-op update of a duplicate affects no row (the driver does not set
# CLIENT_FOUND_ROWS), so exactly the claim that inserted gets a row back.
# A duplicate under either unique index (the primary key or key_id) is one.
# Not INSERT IGNORE: that would also turn a value the column cannot hold
# into a warning. key_id is named, as in CLAIM, so that the claim fails on a
# ledger without it.
MYSQL_CLAIM = """
INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, token, created_at, updated_at)
VALUES (:principal, :key, :fingerprint, 'pending', LAST_INSERT_ID(1), :token, :now, :now)
ON DUPLICATE KEY UPDATE generation = IF(key_id IS NULL, generation, generation)
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
WHERE principal = :principal AND key_id = :key
  AND ((status = 'pending' AND fingerprint = :fingerprint AND updated_at < :stale_before)
       OR updated_at < :expired_before)
"""

# The event's id comes back as LAST_INSERT_ID(); the event is read back by
# it (the log is append-only: the row cannot change in between).
MYSQL_RECORD_FENCED = """
INSERT INTO idemctl_fenced_out
  (principal, key, superseded_generation, current_generation, computed_status, fenced_at)
VALUES (:principal, :key, :generation,
        (SELECT generation FROM idempotency_keys WHERE principal = :principal AND key_id = :key),
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
PURGE_READ = f"SELECT {ROW_COLUMNS}, token FROM idempotency_keys WHERE principal = :principal AND key_id = :key"
PURGE_VERSION = """
DELETE FROM idempotency_keys
WHERE principal = :principal AND key_id = :key AND token <=> :token AND generation = :generation
  AND status = :status AND updated_at = :updated_at
  AND (status <> 'pending' OR :stale_before IS NULL OR updated_at < :stale_before)
"""
PURGE_TRIES = 10

WITHOUT_RETURNING: Mapping[str, str] = {
    CLAIM: MYSQL_CLAIM,
    TAKEOVER: MYSQL_TAKEOVER,
    COMPLETE: without_returning(COMPLETE),
    RELEASE: without_returning(RELEASE),
    RECORD_FENCED: MYSQL_RECORD_FENCED,
    SWEEP_FENCED: MYSQL_SWEEP_FENCED,
    INSERT_VERSION: (
        "INSERT INTO idemctl_schema_version (version, applied_at) VALUES (:version, :now)"
        " ON DUPLICATE KEY UPDATE version = version"
    ),
}
