"""SQLite's errors as idemctl's typed errors, each naming the ledger file."""

from __future__ import annotations

import os
import sqlite3

from ...errors import (
    DatabaseLockedError,
    LedgerNotFoundError,
    NotADatabaseError,
    ReadOnlyDatabaseError,
    SchemaMissingError,
    SchemaOutdatedError,
    StorageError,
)
from .files import directory_of, wal_holds_commits

# What a reader of a WAL ledger gets when the -shm file beside it cannot be
# created or written: the directory, not the database, is the problem.
_SHM_UNUSABLE = frozenset(
    {"SQLITE_READONLY_CANTINIT", "SQLITE_READONLY_CANTLOCK", "SQLITE_READONLY_RECOVERY", "SQLITE_READONLY_DIRECTORY"}
)


def translate(exc: sqlite3.Error, path: str, busy_timeout_ms: int, memory: bool) -> StorageError:
    """The idemctl error for `exc`, raised on the ledger at `path`."""
    name = getattr(exc, "sqlite_errorname", "") or ""
    msg = str(exc)
    low = msg.lower()
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "database is locked" in low:
        return DatabaseLockedError(
            f"database {path} is locked: another writer held it past the {busy_timeout_ms} ms busy timeout"
        )
    if name.startswith("SQLITE_READONLY") or "readonly" in low:
        if name in _SHM_UNUSABLE:  # a reader whose -shm file could not be made or used
            return cannot_open(path, memory)
        return ReadOnlyDatabaseError(f"database {path} is read-only")
    if name.startswith(("SQLITE_NOTADB", "SQLITE_CORRUPT")) or "not a database" in low or "malformed" in low:
        return NotADatabaseError(f"{path} is not an SQLite database, or it is corrupt")
    if "no such table: idempotency_keys" in low:
        return SchemaMissingError(path)
    if (
        "no such column: token" in low
        or "has no column named token" in low
        or "no such column: key_id" in low
        or "no such table: idemctl_" in low
    ):
        return SchemaOutdatedError(path)
    if name.startswith("SQLITE_CANTOPEN") or "unable to open" in low:
        return cannot_open(path, memory)
    if name.startswith("SQLITE_FULL"):
        return StorageError(f"disk full while writing {path}")
    return StorageError(f"database error on {path}: {msg}")


def cannot_open(path: str, memory: bool) -> StorageError:
    """Say why an existing ledger cannot be opened, when we can tell."""
    if memory or not os.path.exists(path):
        return LedgerNotFoundError(path, f"cannot open the ledger at {path}")
    if not os.access(path, os.R_OK):
        return StorageError(f"cannot open the ledger at {path}: the file is not readable by this user")
    directory = directory_of(path)
    if not os.access(directory, os.W_OK):
        # Even a reader of a WAL database needs the -shm index beside it;
        # the 3 a.m. case is an operator who is not the app's user.
        return StorageError(
            f"cannot open the ledger at {path}: SQLite must create its -shm file beside it in {directory}, "
            "which this user cannot write to"
            + (f" (and {path}-wal holds commits not yet in the file)" if wal_holds_commits(path) else "")
            + "; run idemctl as a user who may write there (the application's), or make the directory "
            "writable for this user"
        )
    return StorageError(f"cannot open the ledger at {path}")
