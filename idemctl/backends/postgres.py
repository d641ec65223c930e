"""PostgreSQL storage: every statement idemctl runs against PostgreSQL lives here.

The statements mirror idemctl/backends/sqlite.py one for one. Each
request-path step is a single statement on an auto-commit connection, so its
atomicity is PostgreSQL's row-level atomicity of one statement under READ
COMMITTED: a concurrent writer of the same row is waited for, and the WHERE
clause is re-checked against the row version that writer committed.

Connections come from a psycopg_pool.ConnectionPool that is opened on first
use and belongs to one process: after a fork the child builds its own pool
and never touches the parent's sockets."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import psycopg
from psycopg import errors as pgerrors
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from ..errors import (
    ConnectionFailedError,
    DatabaseLockedError,
    LedgerNotFoundError,
    LedgerUnavailableError,
    ReadOnlyDatabaseError,
    SchemaMissingError,
    SchemaTooNewError,
    StorageError,
)
from ..outcomes import (
    FencedEvent,
    InitAction,
    InitResult,
    PurgeResult,
    Stats,
    Status,
    StoredRow,
    SweepResult,
)
from ..schema import SCHEMA_VERSION, schema_files
from .steps import SqlSteps, event_from, stats_from

log = logging.getLogger("idemctl")

LEDGER_TABLE = "idempotency_keys"
FENCED_TABLE = "idemctl_fenced_out"
VERSION_TABLE = "idemctl_schema_version"

# URL query parameters that configure the pool. They are idemctl's, not
# libpq's, so they are taken out of the URL before it reaches libpq.
POOL_PARAMS = ("pool_min_size", "pool_max_size", "pool_timeout")
DEFAULT_POOL_MIN_SIZE = 1
DEFAULT_POOL_MAX_SIZE = 10
DEFAULT_CONNECT_TIMEOUT_S = 5

_ROW_COLUMNS = (
    "principal, key, fingerprint, status, generation, response_status, "
    "response_body, response_headers, created_at, updated_at"
)

SQL_CLAIM = """
INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, created_at, updated_at)
VALUES (%s, %s, %s, 'pending', 1, %s, %s)
ON CONFLICT (principal, key) DO NOTHING
RETURNING generation
"""

SQL_LOOKUP = f"SELECT {_ROW_COLUMNS} FROM idempotency_keys WHERE principal = %s AND key = %s"

# Still pending, still stale, still the same request: all in the WHERE. A
# second racer waits for the first one's row lock, then re-evaluates the WHERE
# against the bumped row, finds it fresh, and updates nothing.
SQL_TAKEOVER = """
UPDATE idempotency_keys
SET generation = generation + 1, updated_at = %s
WHERE principal = %s AND key = %s AND status = 'pending' AND fingerprint = %s AND updated_at < %s
RETURNING generation
"""

SQL_COMPLETE = """
UPDATE idempotency_keys
SET status = 'completed', response_status = %s, response_body = %s, response_headers = %s, updated_at = %s
WHERE principal = %s AND key = %s AND generation = %s AND status = 'pending'
RETURNING generation
"""

# One INSERT ... SELECT: the event and the generation that superseded it are
# read and written by the same statement.
SQL_RECORD_FENCED = """
INSERT INTO idemctl_fenced_out
  (principal, key, superseded_generation, current_generation, computed_status, fenced_at)
SELECT %s, %s, %s, (SELECT generation FROM idempotency_keys WHERE principal = %s AND key = %s), %s, %s
RETURNING id, principal, key, superseded_generation, current_generation, computed_status, fenced_at
"""

SQL_RELEASE = """
DELETE FROM idempotency_keys
WHERE principal = %s AND key = %s AND generation = %s AND status = 'pending'
RETURNING generation
"""

# PostgreSQL has no DELETE ... LIMIT. The batch is bounded by an InitPlan that
# walks idx_idempotency_keys_updated_at oldest first and collects at most N
# row addresses (ctid); the delete then visits exactly those by TID Scan.
# If a takeover refreshes a chosen row while this statement waits for its row
# lock, READ COMMITTED re-checks the quals against the version the takeover
# committed. PostgreSQL re-checks the TID condition itself; the outer cutoff
# test is there so that an engine that does not still skips the refreshed
# row. It is written `updated_at + 0` so the planner cannot answer it with a
# second index scan over the whole backlog instead of the TID Scan.
SQL_SWEEP = """
DELETE FROM idempotency_keys
WHERE ctid = ANY(ARRAY(
  SELECT ctid FROM idempotency_keys WHERE updated_at < %(cutoff)s ORDER BY updated_at LIMIT %(limit)s
)) AND updated_at + 0 < %(cutoff)s
"""

SQL_SWEEP_FENCED = """
DELETE FROM idemctl_fenced_out
WHERE id = ANY(ARRAY(
  SELECT id FROM idemctl_fenced_out WHERE fenced_at < %(cutoff)s ORDER BY fenced_at LIMIT %(limit)s
))
"""

SQL_COUNT_EXPIRED = "SELECT count(*) FROM idempotency_keys WHERE updated_at < %s"

SQL_STATS = """
SELECT
  count(*),
  count(*) FILTER (WHERE status = 'pending' AND updated_at >= %(stale)s AND updated_at >= %(expired)s),
  count(*) FILTER (WHERE status = 'pending' AND updated_at < %(stale)s AND updated_at >= %(expired)s),
  count(*) FILTER (WHERE status = 'completed' AND updated_at >= %(expired)s),
  count(*) FILTER (WHERE updated_at < %(expired)s),
  count(*) FILTER (WHERE generation > 1),
  min(created_at) FILTER (WHERE status = 'pending'),
  min(created_at) FILTER (WHERE status = 'completed'),
  min(created_at)
FROM idempotency_keys
"""

SQL_COUNT_FENCED = "SELECT count(*) FROM idemctl_fenced_out"

# to_regclass resolves through the connection's search_path, exactly as the
# unqualified names in every other statement do.
SQL_TABLES = "SELECT to_regclass(%s) IS NOT NULL, to_regclass(%s) IS NOT NULL, to_regclass(%s) IS NOT NULL"

SQL_STORAGE_BYTES = """
SELECT coalesce(sum(pg_total_relation_size(t)), 0)
FROM (SELECT to_regclass(name) AS t FROM unnest(%s::text[]) AS name) AS tables
WHERE t IS NOT NULL
"""

# Purge refuses a fresh pending row inside the statement itself: its owner may
# still be running, and deleting it would let a retry run the mutation twice.
SQL_PURGE = f"""
DELETE FROM idempotency_keys
WHERE principal = %(principal)s AND key = %(key)s
  AND (status <> 'pending' OR %(stale)s::bigint IS NULL OR updated_at < %(stale)s::bigint)
RETURNING {_ROW_COLUMNS}
"""

# SQLSTATEs that mean "waited on another session past a timeout".
_LOCKED_STATES = {"55P03", "57014", "40P01", "40001"}
# Server going away, refusing, or out of connection slots.
_GONE_STATES = {"57P01", "57P02", "57P03", "53300", "53400"}
# Errors that mean two inits raced to create the same catalog objects.
_INIT_RACE = (pgerrors.UniqueViolation, pgerrors.DuplicateTable, pgerrors.DuplicateObject)


def _body_in(body: str | bytes | None) -> bytes | None:
    # Always bytes: a str parameter bound to BYTEA would go through bytea's
    # text input, which reads backslashes as escapes.
    if body is None or isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode("utf-8")
    return bytes(body)


def _body_out(value: bytes | memoryview | None) -> str | bytes | None:
    # The stored-row contract (outcomes.StoredRow): text when the bytes are
    # valid UTF-8, bytes otherwise. The ledger stores str exactly when a body
    # decodes, so this restores what it stored; replays use the bytes anyway.
    if value is None:
        return None
    raw = bytes(value)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def _row(values: tuple) -> StoredRow:
    (principal, key, fp, status, generation, rstatus, rbody, rheaders, created, updated) = values
    return StoredRow(
        principal=principal,
        key=key,
        fingerprint=fp,
        status=Status(status),
        generation=int(generation),
        response_status=None if rstatus is None else int(rstatus),
        response_body=_body_out(rbody),
        response_headers=rheaders,
        created_at=int(created),
        updated_at=int(updated),
    )


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _libpq_reason(text: str) -> str:
    """The reason inside libpq's connection error, without the parts the
    caller already shows (which server) or that add nothing (hint lines).
    With several hosts in the URL, one `host:port: reason` per host."""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("\t")]
    if "All failures were:" in text:
        per_host = []
        for line in lines:
            m = re.match(r"- host: '([^']*)', port: '([^']*)'(?:, hostaddr: '[^']*')?: (.*)", line)
            if m:
                per_host.append(f"{m.group(1)}:{m.group(2)}: {_libpq_reason(m.group(3))}")
        if per_host:
            return "; ".join(per_host)
    reasons: list[str] = []
    for line in lines:
        line = line.strip().removeprefix("connection failed: ")
        line = re.sub(r'^connection to server (?:at|on socket) "[^"]*"(?: \([^)]*\))?(?:, port \d+)? failed: ', "", line)
        line = re.sub(r"^FATAL:\s+", "", line)
        if line not in reasons:
            reasons.append(line)
    return _one_line("; ".join(reasons)) or "connection failed"


def _split_pool_params(url: str) -> tuple[str, dict[str, str]]:
    """Take idemctl's pool_* parameters out of the query string, leaving the
    rest of the URL byte for byte as given."""
    base, sep, query = url.partition("?")
    if not sep:
        return url, {}
    kept: list[str] = []
    pool: dict[str, str] = {}
    for part in query.split("&"):
        name, _, value = part.partition("=")
        if name in POOL_PARAMS:
            pool[name] = unquote(value)
        elif part:
            kept.append(part)
    return (base + "?" + "&".join(kept)) if kept else base, pool


def _secrets_of(url: str) -> list[str]:
    """Every spelling of the password the URL carries, for scrubbing messages."""
    found: list[str] = []
    with contextlib.suppress(ValueError):
        if urlsplit(url).password:
            found.append(urlsplit(url).password or "")
    for match in re.finditer(r"[?&]password=([^&]*)", url):
        found.append(match.group(1))
    out: list[str] = []
    for s in found:
        out.extend(v for v in (s, unquote(s)) if v and v not in out)
    return out


class PostgresBackend(SqlSteps):
    """A ledger in a PostgreSQL database, shared by any number of threads,
    processes and hosts.

    Pool settings ride on the URL as idemctl's own query parameters:
    ``pool_min_size`` (default 1), ``pool_max_size`` (default 10) and
    ``pool_timeout`` (seconds to wait for a free connection; default the busy
    timeout). libpq's own parameters (``connect_timeout``, default 5 s;
    ``options=-csearch_path=…``; ``sslmode``; ...) pass through unchanged.

    >>> PostgresBackend("postgresql://app:secret@db:5432/payments?pool_max_size=20").describe()  # doctest: +SKIP
    'postgresql://app@db:5432/payments'
    """

    dialect = "postgres"
    # Row locks: a batch blocks only claims of the very keys it deletes,
    # which are expired, so larger batches cost the request path nothing
    # and save round trips.
    drain_batch = 1000

    def __init__(
        self,
        url: str,
        *,
        readonly: bool = False,
        busy_timeout_ms: int = 5000,
        pool_min_size: int | None = None,
        pool_max_size: int | None = None,
        pool_timeout_s: float | None = None,
    ) -> None:
        self._secrets = _secrets_of(url)
        self.readonly = readonly
        self.busy_timeout_ms = int(busy_timeout_ms)
        if self.busy_timeout_ms < 0:
            raise StorageError(f"busy timeout must be >= 0 ms, got {busy_timeout_ms}")
        libpq_url, pool_params = _split_pool_params(url)
        try:
            params = conninfo_to_dict(libpq_url)
        except psycopg.Error as exc:
            raise StorageError(f"bad PostgreSQL URL: {self._scrub(_one_line(str(exc)))}") from exc
        self.url_params = {k: str(v) for k, v in params.items() if k != "password"}
        for port in str(params.get("port", "")).split(","):
            if port and not (port.isdigit() and 0 < int(port) < 65536):
                raise StorageError(f"bad PostgreSQL URL: port {port!r} is not a number from 1 to 65535")
        self.pool_min_size = self._pool_int(pool_min_size, pool_params, "pool_min_size", DEFAULT_POOL_MIN_SIZE, 0)
        self.pool_max_size = self._pool_int(pool_max_size, pool_params, "pool_max_size", DEFAULT_POOL_MAX_SIZE, 1)
        if self.pool_max_size < self.pool_min_size:
            raise StorageError(
                f"bad PostgreSQL URL: pool_max_size ({self.pool_max_size}) is below pool_min_size ({self.pool_min_size})"
            )
        if pool_timeout_s is None:
            raw = pool_params.get("pool_timeout")
            try:
                pool_timeout_s = float(raw) if raw is not None else max(self.busy_timeout_ms / 1000, 0.1)
            except ValueError:
                raise StorageError(f"bad PostgreSQL URL: pool_timeout={raw!r} is not a number of seconds") from None
        if pool_timeout_s <= 0:
            raise StorageError(f"bad PostgreSQL URL: pool_timeout must be > 0 seconds, got {pool_timeout_s}")
        self.pool_timeout_s = float(pool_timeout_s)
        # Session settings ride in libpq's `options`, ahead of the URL's own,
        # so an explicit `-c lock_timeout=…` in the URL still wins.
        # lock_timeout=0 would mean "wait forever"; a zero busy timeout means
        # "do not wait", as on SQLite.
        ours = [f"-c lock_timeout={max(1, self.busy_timeout_ms)}"]
        if readonly:
            ours.append("-c default_transaction_read_only=on")
        options = " ".join([*ours, str(params["options"])] if params.get("options") else ours)
        extra: dict[str, Any] = {"options": options}
        if "connect_timeout" not in params:
            extra["connect_timeout"] = DEFAULT_CONNECT_TIMEOUT_S
        self._conninfo = make_conninfo(libpq_url, **extra)
        self._lock = threading.Lock()
        self._pool: ConnectionPool | None = None
        self._pid = os.getpid()
        # Pools inherited across fork stay referenced and untouched: closing
        # one in the child would shut down sockets the parent still uses.
        self._inherited: list[ConnectionPool] = []
        self._has_fenced_log: bool | None = None

    @staticmethod
    def _pool_int(given: int | None, params: dict[str, str], name: str, default: int, floor: int) -> int:
        raw: object = given if given is not None else params.get(name, default)
        try:
            value = int(str(raw))
        except ValueError:
            raise StorageError(f"bad PostgreSQL URL: {name}={raw!r} is not a whole number") from None
        if value < floor:
            raise StorageError(f"bad PostgreSQL URL: {name} must be >= {floor}, got {value}")
        return value

    # -- describing without secrets -------------------------------------------------
    def describe(self) -> str:
        p = self.url_params
        user = f"{quote(p['user'], safe='')}@" if p.get("user") else ""
        hosts = (p.get("host") or p.get("hostaddr") or "").split(",")
        ports = p["port"].split(",") if p.get("port") else []
        # libpq: one port for every host, or one port per host.
        netloc = ",".join(
            quote(h, safe="") + (f":{ports[min(i, len(ports) - 1)]}" if ports else "") for i, h in enumerate(hosts)
        )
        return f"postgresql://{user}{netloc}/{quote(p.get('dbname', ''), safe='')}"

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    # -- connections ---------------------------------------------------------------
    def _new_pool(self) -> ConnectionPool:
        # A direct connection first: if the server is down or refuses us, the
        # caller gets libpq's reason at once instead of a pool timeout, and
        # the schema check needs a connection anyway.
        try:
            conn = psycopg.connect(self._conninfo, autocommit=True)
        except psycopg.Error as exc:
            raise self._translate(exc, connecting=True) from exc
        try:
            with conn:
                self._refresh_schema(conn)
        except psycopg.Error as exc:
            raise self._translate(exc) from exc
        return ConnectionPool(
            self._conninfo,
            kwargs={"autocommit": True},
            min_size=self.pool_min_size,
            max_size=self.pool_max_size,
            timeout=self.pool_timeout_s,
            name=f"idemctl-{os.getpid()}",
            open=True,
        )

    def _current_pool(self) -> ConnectionPool:
        pid = os.getpid()
        pool = self._pool
        if pool is not None and self._pid == pid:
            return pool
        with self._lock:
            if self._pid != pid:
                # First use after a fork: leave the parent's pool alone.
                if self._pool is not None:
                    self._inherited.append(self._pool)
                self._pool, self._pid = None, pid
            if self._pool is None:
                self._pool = self._new_pool()
            return self._pool

    @contextlib.contextmanager
    def _connection(self) -> Iterator[psycopg.Connection]:
        pool = self._current_pool()
        try:
            with pool.connection() as conn:
                try:
                    yield conn
                except psycopg.Error:
                    if conn.broken:
                        self._drop_broken_idle(pool)
                    raise
        except psycopg.Error as exc:
            raise self._translate(exc) from exc

    @staticmethod
    def _drop_broken_idle(pool: ConnectionPool) -> None:
        """The server closed the connection under us. A restart or failover
        closes every connection at once, and each idle one in the pool would
        fail one more request before being replaced; test them now (a round
        trip each, or an immediate error) so that only this request fails.
        The pool takes them out of rotation while it tests them."""
        try:
            pool.check()
        except Exception:  # noqa: BLE001 - best effort: the pool also replaces them one by one
            log.debug("checking the pool's idle connections failed", exc_info=True)

    def close(self) -> None:
        # As on SQLite, a closed backend that is used again reconnects.
        with self._lock:
            pool, self._pool = self._pool, None
            mine = self._pid == os.getpid()
        if pool is not None and mine:
            pool.close()

    # -- errors ----------------------------------------------------------------------
    def _translate(self, exc: BaseException, *, connecting: bool = False) -> StorageError:
        where = self.describe()
        if isinstance(exc, PoolTimeout):
            return LedgerUnavailableError(
                f"no connection to {where} within {self.pool_timeout_s:g} s: "
                f"the server is unreachable or all {self.pool_max_size} pooled connections are busy"
            )
        if isinstance(exc, PoolClosed):
            return StorageError(f"the ledger at {where} is closed")
        state = getattr(exc, "sqlstate", None)
        diag = getattr(exc, "diag", None)
        primary = getattr(diag, "message_primary", None) if diag is not None else None
        msg = self._scrub(_one_line(primary or str(exc)))
        if state == "55P03":
            return DatabaseLockedError(
                f"{where} is locked: another session held the row or table past the lock timeout "
                f"({self.busy_timeout_ms} ms unless the URL sets lock_timeout): {msg}"
            )
        if state == "57014":
            return DatabaseLockedError(f"a statement on {where} was cancelled or ran past statement_timeout: {msg}")
        if state in _LOCKED_STATES:  # deadlock or serialisation failure: the other session won
            return DatabaseLockedError(f"{where} is busy: this statement conflicted with another session: {msg}")
        if state == "25006":
            return ReadOnlyDatabaseError(f"{where} is read-only ({msg})")
        if state == "42P01":
            if LEDGER_TABLE in msg:
                self._has_fenced_log = None  # look again once someone runs init
                return SchemaMissingError(f"{where} has no idempotency ledger — run `idemctl init`")
            return StorageError(f"database error on {where}: {msg}")
        if state == "3F000":
            return StorageError(f"{where}: the search_path names no existing schema to create the ledger in ({msg})")
        if state == "42501":
            return StorageError(f"permission denied on {where}: {msg}")
        if state == "3D000" or (connecting and re.search(r'database "[^"]*" does not exist', msg)):
            return LedgerNotFoundError(f"cannot open the ledger at {where}: {self._scrub(_libpq_reason(primary or str(exc)))}")
        if (
            connecting
            or state in _GONE_STATES
            or (state or "").startswith("08")
            or (isinstance(exc, psycopg.OperationalError) and state is None)
        ):
            detail = self._scrub(_libpq_reason(primary or str(exc)))
            return ConnectionFailedError(f"cannot reach PostgreSQL at {where}: {detail}")
        if isinstance(exc, psycopg.DataError) and "NUL" in msg:
            return StorageError(f"PostgreSQL cannot store a NUL character in a text column ({msg})")
        return StorageError(f"database error on {where}: {msg}")

    def _all(self, sql: str, params: tuple | dict = ()) -> list[tuple]:
        with self._connection() as conn:
            return conn.execute(sql, params).fetchall()

    # -- schema ------------------------------------------------------------------------
    @staticmethod
    def _tables(conn: psycopg.Connection) -> tuple[bool, bool, bool]:
        row = conn.execute(SQL_TABLES, (LEDGER_TABLE, VERSION_TABLE, FENCED_TABLE)).fetchone()
        assert row is not None
        return bool(row[0]), bool(row[1]), bool(row[2])

    @classmethod
    def _version_on(cls, conn: psycopg.Connection) -> int | None:
        ledger, versions, _ = cls._tables(conn)
        if not ledger:
            return None
        if not versions:
            return 0
        row = conn.execute(f"SELECT max(version) FROM {VERSION_TABLE}").fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def _refresh_schema(self, conn: psycopg.Connection) -> None:
        version = self._version_on(conn)
        if version is not None and version > SCHEMA_VERSION:
            raise SchemaTooNewError(
                f"{self.describe()} has ledger schema version {version}; this idemctl knows up to {SCHEMA_VERSION} — upgrade idemctl"
            )
        self._has_fenced_log = self._tables(conn)[2]

    @property
    def has_fenced_log(self) -> bool:
        if self._has_fenced_log is None:
            with self._connection() as conn:
                self._refresh_schema(conn)
        return bool(self._has_fenced_log)

    def schema_version(self) -> int | None:
        with self._connection() as conn:
            return self._version_on(conn)

    def init(self, now: int, dry_run: bool) -> InitResult:
        # Two inits on a fresh database both create the same catalog entries;
        # the loser fails on the catalog's unique index once the winner
        # commits, and its retry finds the version table and waits on its lock.
        for attempt in range(5):
            try:
                return self._init_once(now, dry_run)
            except psycopg.Error as exc:
                if isinstance(exc, _INIT_RACE) and attempt < 4:
                    continue
                raise self._translate(exc) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _check_body_column(self, conn: psycopg.Connection) -> None:
        """A ledger table made by hand from the recipe's DDL has a TEXT body
        column, which cannot hold every response: say how to fix it rather
        than adopting it."""
        row = conn.execute(
            "SELECT format_type(atttypid, atttypmod) FROM pg_attribute"
            " WHERE attrelid = to_regclass(%s) AND attname = 'response_body' AND NOT attisdropped",
            (LEDGER_TABLE,),
        ).fetchone()
        if row is not None and row[0] != "bytea":
            raise StorageError(
                f"{self.describe()}: idempotency_keys.response_body is {row[0]}, and idemctl on PostgreSQL stores "
                "response bodies as bytea; convert it first: ALTER TABLE idempotency_keys ALTER COLUMN response_body "
                "TYPE bytea USING convert_to(response_body, 'UTF8')"
            )

    def _init_once(self, now: int, dry_run: bool) -> InitResult:
        pool = self._current_pool()
        try:
            with pool.connection() as conn:
                with conn.transaction() as tx:
                    if self._tables(conn)[1]:
                        # Schema administration, not the request path: readers
                        # and the request path are unaffected by this lock.
                        conn.execute(f"LOCK TABLE {VERSION_TABLE} IN SHARE ROW EXCLUSIVE MODE")
                    before = self._version_on(conn)
                    if before is not None and before > SCHEMA_VERSION:
                        raise SchemaTooNewError(
                            f"{self.describe()} has ledger schema version {before}; this idemctl knows up to {SCHEMA_VERSION}"
                        )
                    if before == 0:
                        self._check_body_column(conn)
                    if before == SCHEMA_VERSION:
                        action = InitAction.UP_TO_DATE
                    elif before is None:
                        action = InitAction.CREATED
                    else:
                        action = InitAction.UPGRADED
                    if action is InitAction.UP_TO_DATE or dry_run:
                        raise psycopg.Rollback(tx)  # leaves the block, writes nothing
                    else:
                        floor = -1 if before is None else before
                        for f in schema_files(self.dialect):
                            if f.version > floor:
                                conn.execute(f.sql)
                        mine = conn.execute(
                            f"INSERT INTO {VERSION_TABLE} (version, applied_at) VALUES (%s, %s)"
                            " ON CONFLICT DO NOTHING RETURNING version",
                            (SCHEMA_VERSION, now),
                        ).fetchone()
                        if mine is None:
                            # Without a version table there was nothing to lock,
                            # so another init may have decided from the same
                            # state and committed first; our IF NOT EXISTS DDL
                            # then did nothing. Whoever inserted the version row
                            # did the work.
                            action, before = InitAction.UP_TO_DATE, SCHEMA_VERSION
                if not dry_run:
                    self._refresh_schema(conn)
        except PoolTimeout as exc:
            raise self._translate(exc) from exc
        return InitResult(action, before, SCHEMA_VERSION, dry_run)

    # -- request path ------------------------------------------------------------------------
    # claim, lookup, takeover, complete and release come from SqlSteps, each one
    # of the statements above; every statement autocommits on its own pooled
    # connection, reads and writes alike.
    SQL_CLAIM = SQL_CLAIM
    SQL_LOOKUP = SQL_LOOKUP
    SQL_TAKEOVER = SQL_TAKEOVER
    SQL_COMPLETE = SQL_COMPLETE
    SQL_RECORD_FENCED = SQL_RECORD_FENCED
    SQL_RELEASE = SQL_RELEASE
    SQL_COUNT_EXPIRED = SQL_COUNT_EXPIRED
    _row = staticmethod(_row)
    # Always bytes into BYTEA (see _body_in).
    _body_param = staticmethod(_body_in)

    def _write_all(self, sql: str, params: tuple | dict = ()) -> list[tuple]:
        return self._all(sql, params)

    def record_fenced(self, principal: str, key: str, generation: int, computed_status: int, now: int) -> FencedEvent | None:
        if not self._has_fenced_log:
            # Rare path: look again, an init may have run since this process looked.
            self._has_fenced_log = None
        return super().record_fenced(principal, key, generation, computed_status, now)

    def sweep(self, cutoff: int, limit: int) -> SweepResult:
        params = {"cutoff": cutoff, "limit": limit}
        fenced_log = self.has_fenced_log
        with self._connection() as conn:
            keys = conn.execute(SQL_SWEEP, params).rowcount
            fenced = conn.execute(SQL_SWEEP_FENCED, params).rowcount if fenced_log else 0
        return SweepResult(keys, fenced, cutoff)

    # -- operator side -------------------------------------------------------------------------
    def iter_pending(self, stale_before: int | None, principal: str | None, limit: int | None) -> Iterator[StoredRow]:
        sql = f"SELECT {_ROW_COLUMNS} FROM idempotency_keys WHERE status = 'pending'"
        params: list[object] = []
        if stale_before is not None:
            sql += " AND updated_at < %s"
            params.append(stale_before)
        if principal is not None:
            sql += " AND principal = %s"
            params.append(principal)
        sql += " ORDER BY updated_at, principal, key"
        if limit is not None:
            sql += " LIMIT %s"
            params.append(limit)
        # A server-side cursor streams the rows in batches: a million pending
        # rows never sit in memory at once. It needs a transaction (read-only
        # work, so it holds no lock that the request path waits on).
        with self._connection() as conn:
            with conn.transaction():
                with conn.cursor(name="idemctl_pending") as cur:
                    cur.itersize = 500
                    cur.execute(sql, params)
                    for values in cur:
                        yield _row(values)

    def iter_fenced(
        self, principal: str | None, key: str | None, since: int | None, limit: int | None
    ) -> Iterator[FencedEvent]:
        if not self.has_fenced_log:
            return
        sql = (
            "SELECT id, principal, key, superseded_generation, current_generation, computed_status, fenced_at "
            "FROM idemctl_fenced_out WHERE true"
        )
        params: list[object] = []
        for clause, value in (("principal = %s", principal), ("key = %s", key), ("fenced_at >= %s", since)):
            if value is not None:
                sql += f" AND {clause}"
                params.append(value)
        sql += " ORDER BY fenced_at DESC, id DESC"
        if limit is not None:
            sql += " LIMIT %s"
            params.append(limit)
        for values in self._all(sql, tuple(params)):
            yield event_from(values)

    def stats(self, now: int, stale_before: int, expired_before: int) -> Stats:
        fenced_log = self.has_fenced_log
        with self._connection() as conn:
            row = conn.execute(SQL_STATS, {"stale": stale_before, "expired": expired_before}).fetchone()
            assert row is not None
            fenced = int(conn.execute(SQL_COUNT_FENCED).fetchone()[0]) if fenced_log else 0  # type: ignore[index]
            size = conn.execute(SQL_STORAGE_BYTES, ([LEDGER_TABLE, FENCED_TABLE, VERSION_TABLE],)).fetchone()
            version = self._version_on(conn)
        return stats_from(now, tuple(row), fenced, int(size[0]) if size else None, version)

    def storage_bytes(self) -> int | None:
        """On-disk size of the ledger's tables and indexes (pg_total_relation_size)."""
        row = self._all(SQL_STORAGE_BYTES, ([LEDGER_TABLE, FENCED_TABLE, VERSION_TABLE],))
        return int(row[0][0]) if row else None

    def purge(self, principal: str, key: str, stale_before: int | None) -> PurgeResult:
        rows = self._all(SQL_PURGE, {"principal": principal, "key": key, "stale": stale_before})
        return self._purge_result(principal, key, rows)

