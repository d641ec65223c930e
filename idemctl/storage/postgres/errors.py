"""PostgreSQL's errors (SQLSTATEs, libpq's connection failures, the pool's
timeouts) as idemctl's typed errors, never showing the URL's password."""

from __future__ import annotations

import re
from collections.abc import Callable

import psycopg
from psycopg import errors as pgerrors
from psycopg_pool import PoolClosed, PoolTimeout

from ...errors import (
    DatabaseLockedError,
    LedgerUnavailableError,
    SchemaOutdatedError,
    StorageError,
)
from ...text import single_line
from .. import server
from ..server import missing_table

# SQLSTATEs that mean "waited on another session past a timeout".
_LOCKED_STATES = {"55P03", "57014", "40P01", "40001"}
# Server going away, refusing, or out of connection slots.
_GONE_STATES = {"57P01", "57P02", "57P03", "53300", "53400"}
# Errors that mean two inits raced to create the same catalog objects.
INIT_RACE = (pgerrors.UniqueViolation, pgerrors.DuplicateTable, pgerrors.DuplicateObject)

_SERVER_PREFIX = re.compile(r'^connection to server (?:at|on socket) "[^"]*"(?: \([^)]*\))?(?:, port \d+)? failed: ')


class PoolerError(StorageError):
    """A connection pooler between idemctl and PostgreSQL (PgBouncer) refused
    what idemctl asked, or the server saw the pooler mix two clients'
    protocol state (prepared statements across server sessions): not an
    unreachable server, and retrying the same way may not help."""


# PgBouncer's own refusals, and what the server says when a pooler moved a
# client to another server session between a statement's messages.
_POOLER_STATES = {"08P01", "42P05", "26000"}
_STATEMENT_POOLING = "transaction blocks not allowed in statement pooling mode"
_POOLER_BUSY = ("query_wait_timeout", "no more connections allowed")
_POOLER_SERVER_DOWN = ("pgbouncer cannot connect to server", "server login has been failing", "server conn crashed")


def pooler_mode_refused(where: str) -> PoolerError:
    """Statement pooling, where a transaction of several statements is refused."""
    return PoolerError(
        f"{where} is pooled in statement mode ({_STATEMENT_POOLING}): init (migrations) and the pending "
        "listing need a transaction; run them against a session or transaction pool or against the server itself"
    )


def _pooler_error(where: str, state: str | None, msg: str) -> StorageError | None:
    """What a pooler's refusal (or its trace on the server) means, if `msg` is one."""
    lowered = msg.lower()
    if _STATEMENT_POOLING in lowered:
        return pooler_mode_refused(where)
    if "unsupported startup parameter" in lowered:
        return PoolerError(
            f"{where} refuses idemctl's startup options ({msg}): it is a connection pooler; let idemctl detect "
            "it (pooler=auto, the default) or name its pool mode (pooler=transaction, session or statement)"
        )
    if lowered.startswith("no such database"):
        return server.no_such_database(where, f"the pooler has {msg}")
    if any(word in lowered for word in _POOLER_SERVER_DOWN):
        return server.unreachable("PostgreSQL", where, f"the pooler cannot reach the server: {msg}")
    if any(word in lowered for word in _POOLER_BUSY):
        return LedgerUnavailableError(f"the connection pooler in front of {where} is busy: {msg}")
    if state in ("42P05", "26000") or (state == "08P01" and "prepared statement" in lowered):
        return PoolerError(
            f"{where}: a prepared statement did not survive the connection pooler ({msg}): behind transaction "
            "or statement pooling set pooler=transaction (or statement) in the URL, or prepare_threshold=none"
        )
    if state == "08P01":
        return PoolerError(f"protocol error on {where} (a connection pooler in between?): {msg}")
    return None


def libpq_reason(text: str) -> str:
    """The reason inside libpq's connection error, without the parts the
    caller already shows (which server) or that add nothing (hint lines).
    With several hosts in the URL, one `host:port: reason` per host."""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("\t")]
    if "All failures were:" in text:
        per_host = []
        for line in lines:
            m = re.match(r"- host: '([^']*)', port: '([^']*)'(?:, hostaddr: '[^']*')?: (.*)", line)
            if m:
                per_host.append(f"{m.group(1)}:{m.group(2)}: {libpq_reason(m.group(3))}")
        if per_host:
            return "; ".join(per_host)
    reasons: list[str] = []
    for line in lines:
        line = line.strip().removeprefix("connection failed: ")
        line = _SERVER_PREFIX.sub("", line)
        line = re.sub(r"^FATAL:\s+", "", line)
        if line not in reasons:
            reasons.append(line)
    return single_line("; ".join(reasons)) or "connection failed"


class Translator:
    """Turns what psycopg and its pool raise into idemctl's errors for one
    ledger: `where` names it, `scrub` takes the password out of any text."""

    __slots__ = ("busy_timeout_ms", "pool_max_size", "pool_timeout_s", "scrub", "where")

    def __init__(
        self, where: str, scrub: Callable[[str], str], busy_timeout_ms: int, pool_timeout_s: float, pool_max_size: int
    ) -> None:
        self.where = where
        self.scrub = scrub
        self.busy_timeout_ms = busy_timeout_ms
        self.pool_timeout_s = pool_timeout_s
        self.pool_max_size = pool_max_size

    def __call__(self, exc: BaseException, *, connecting: bool = False) -> StorageError:
        where = self.where
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
        msg = self.scrub(single_line(primary or str(exc)))
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
            return server.read_only(where, msg)
        if state == "42P01":
            return missing_table(where, msg) or server.database_error(where, msg)
        if state == "42703" and ('"token"' in msg or '"key_id"' in msg):
            return SchemaOutdatedError(where)
        if state == "3F000":
            return StorageError(f"{where}: the search_path names no existing schema to create the ledger in ({msg})")
        if state == "42501":
            return server.permission_denied(where, msg)
        if state in _POOLER_STATES or (state is None and isinstance(exc, psycopg.OperationalError)):
            found = _pooler_error(where, state, self.scrub(libpq_reason(primary or str(exc))))
            if found is not None:
                return found
        if state == "3D000" or (connecting and re.search(r'database "[^"]*" does not exist', msg)):
            reason = self.scrub(libpq_reason(primary or str(exc)))
            return server.no_such_database(where, reason)
        if (
            connecting
            or state in _GONE_STATES
            or (state or "").startswith("08")
            or (isinstance(exc, psycopg.OperationalError) and state is None)
        ):
            detail = self.scrub(libpq_reason(primary or str(exc)))
            return server.unreachable("PostgreSQL", where, detail)
        if isinstance(exc, psycopg.DataError) and "NUL" in msg:
            return StorageError(f"PostgreSQL cannot store a NUL character in a text column ({msg})")
        return server.database_error(where, msg)
