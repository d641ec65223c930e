"""The settings that only a SQLite ledger file has."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import StorageError
from .files import DEFAULT_FILE_MODE, check_file_mode

SYNCHRONOUS_LEVELS = ("OFF", "NORMAL", "FULL", "EXTRA")


@dataclass(frozen=True)
class SqliteOptions:
    """How a SQLite ledger file is opened and written (a server URL has
    none of these). `create=False` refuses a missing file at once;
    `synchronous` is the PRAGMA of that name; `write_queue` the fair flock
    queue of writers; `file_mode` the permission bits of a new ledger file
    and its companions; `group_commit` lets threads of one process share a
    commit.

    >>> SqliteOptions(group_commit=True).synchronous
    'FULL'
    """

    create: bool = True
    synchronous: str = "FULL"
    write_queue: bool = True
    file_mode: int = DEFAULT_FILE_MODE
    group_commit: bool = False

    def check(self) -> None:
        """Refuse a `synchronous` level SQLite does not have, or bad permission bits."""
        if not isinstance(self.synchronous, str) or self.synchronous.upper() not in SYNCHRONOUS_LEVELS:
            raise StorageError(f"synchronous must be OFF, NORMAL, FULL or EXTRA, got {self.synchronous!r}")
        check_file_mode(self.file_mode)


# Every setting at its default (a frozen value, safe as a default argument).
SQLITE_DEFAULTS = SqliteOptions()
