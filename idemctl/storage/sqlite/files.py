"""The ledger file and its companions: how the file is made, and with what
permission bits, and what a directory or a -wal file says about who may be
writing it."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading

from ...errors import StorageError

# A new ledger is readable by its owner only: it holds every stored answer.
DEFAULT_FILE_MODE = 0o600


def check_file_mode(file_mode: object) -> None:
    """Refuse permission bits that are not bits, or that lock the owner out."""
    if isinstance(file_mode, bool) or not isinstance(file_mode, int) or not 0 <= file_mode <= 0o777:
        raise StorageError(f"file mode must be permission bits such as 0o600, got {file_mode!r}")
    if file_mode & 0o600 != 0o600:
        raise StorageError(f"file mode {file_mode:#o} must let the owner read and write the ledger")


def wal_holds_commits(path: str) -> bool:
    """Whether the ledger's -wal file holds commits the file itself lacks."""
    wal = path + "-wal"
    return os.path.exists(wal) and os.path.getsize(wal) > 0


def directory_of(path: str) -> str:
    return os.path.dirname(os.path.abspath(path))


def nobody_writes_it(path: str) -> bool:
    """Whether no process can be changing this ledger file: no -wal holds
    commits the file lacks, and its directory takes no new files from
    anyone (a read-only file system, or one that refuses even root), so
    no writer can start either. Only then is `immutable` safe."""
    if wal_holds_commits(path):
        return False
    directory = directory_of(path)
    if os.access(directory, os.W_OK):
        return False
    try:
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return True
    except OSError:
        return False
    return hasattr(os, "geteuid") and os.geteuid() == 0


def companion_mode(path: str, file_mode: int) -> int:
    """The permission bits of a file beside the ledger: the ledger's own, as
    SQLite gives its -wal and -shm files (`file_mode` before it exists)."""
    try:
        return os.stat(path).st_mode & 0o777
    except OSError:
        return file_mode


def create_ledger_file(path: str, file_mode: int) -> None:
    """Create the ledger file, already in WAL mode, under its final name
    in one step: it is prepared under a private name and hard-linked into
    place, which fails if another process got there first. So no process
    ever opens a half-made file, and no two first connections race to
    switch it to WAL (that race can deadlock two inits). Its permission
    bits are exactly `file_mode`, whatever the umask; SQLite gives the
    -wal and -shm files the same bits."""
    staging = os.path.join(directory_of(path), f".{os.path.basename(path)}.{os.getpid()}.{threading.get_ident()}.new")
    try:
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), file_mode)
    except OSError as exc:
        raise StorageError(f"cannot create a ledger at {path}: {exc.strerror}") from exc
    try:
        os.fchmod(fd, file_mode)
        os.close(fd)
        conn = sqlite3.connect(staging, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL").fetchall()
        finally:
            conn.close()
        with contextlib.suppress(FileExistsError):  # another process got there first: theirs is the ledger
            os.link(staging, path)
    except (OSError, sqlite3.Error) as exc:
        raise StorageError(f"cannot create a ledger at {path}: {exc}") from exc
    finally:
        for leftover in (staging, staging + "-wal", staging + "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(leftover)
