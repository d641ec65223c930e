"""The commands the CLI's hints print: each names the ledger the running
command works on, as given (a location that carries a password masked), so
that typed as printed it acts on the same ledger; and the advice for a
ledger that cannot be written."""

from __future__ import annotations

import os
import shlex
from contextvars import ContextVar
from urllib.parse import urlsplit

from .. import config
from ..errors import (
    IdemctlError,
    LedgerNotFoundError,
    ReadOnlyDatabaseError,
    SchemaMissingError,
    SchemaOutdatedError,
)
from ..storage import is_file_location, keyword_dsn

# The ledger the running command works on, as given: hints name it, so that
# the command they suggest acts on the same ledger when typed as printed.
LEDGER_IN_FORCE: ContextVar[tuple[str, bool] | None] = ContextVar("ledger_in_force", default=None)
# The running command's words as typed (after `idemctl`), for a hint that
# says "the same command, as another user".
ARGS_IN_FORCE: ContextVar[tuple[str, ...]] = ContextVar("args_in_force", default=())


def idemctl_command(words: str, db: str | None = None, given: bool = False) -> str:
    """`idemctl WORDS` as the operator would type it for ledger `db`: with
    `--db` unless the ledger is the default one nobody named. A URL that
    carries a password is not echoed back.

    >>> idemctl_command("init", "missing.db", True)
    'idemctl --db missing.db init'
    >>> idemctl_command("init", "my ledger.db", True), idemctl_command("init", "idempotency.db", False)
    ("idemctl --db 'my ledger.db' init", 'idemctl init')
    >>> idemctl_command("init", "postgresql://app:s3cret@db/payments", True)
    "idemctl --db '<the same URL>' init"
    >>> idemctl_command("init", "postgresql://app@db/payments", True)
    'idemctl --db postgresql://app@db/payments init'
    >>> idemctl_command("init", "host=db user=app password=s3cret dbname=payments", True)
    "idemctl --db '<the same connection string>' init"
    """
    if db is None or not given:
        return f"idemctl {words}"
    return f"idemctl --db {shlex.quote(shown_db(db))} {words}"


def shown_db(db: str) -> str:
    """The ledger's location as given, unless it carries a password."""
    pairs = keyword_dsn(db)
    if pairs is not None:
        return "<the same connection string>" if any(name == "password" for name, _ in pairs) else db
    if is_file_location(db):
        return db
    try:
        secret = urlsplit(db).password
    except ValueError:
        secret = None
    return "<the same URL>" if secret or "password=" in db else db


def with_hint(exc: IdemctlError, db: str | None = None, given: bool = False) -> str:
    """The library's message plus what to type about it, in the CLI's words,
    for the ledger `db` (`given`: named by --db or IDEMCTL_DB).

    >>> with_hint(SchemaMissingError("ledger.db"))
    'ledger.db has no idempotency ledger — run `idemctl init`'
    >>> with_hint(SchemaMissingError("/srv/ledger.db"), "/srv/ledger.db", True)
    '/srv/ledger.db has no idempotency ledger — run `idemctl --db /srv/ledger.db init`'
    """
    init = idemctl_command("init", db, given)
    if isinstance(exc, SchemaOutdatedError):
        return f"{exc} — run `{init}` to upgrade it"
    if isinstance(exc, ReadOnlyDatabaseError):
        return f"{exc} — {read_only_advice(db or config.DEFAULT_DB)}"
    if isinstance(exc, LedgerNotFoundError) and db is not None and is_file_location(db):
        parent = os.path.dirname(os.path.abspath(os.path.expanduser(db)))
        if not os.path.isdir(parent):
            # `init` would fail the same way: the directory comes first.
            missing = "" if "does not exist" in str(exc) else f"directory {parent} does not exist: "
            return f"{exc} — {missing}run `mkdir -p {shlex.quote(parent)} && {init}`"
    if isinstance(exc, SchemaMissingError):
        return f"{exc} — run `{init}`"
    return str(exc)


def read_only_advice(db: str) -> str:
    """What to check when a ledger refuses a write: for a SQLite file, why
    this user cannot write it or its directory (SQLite writes -wal and -shm
    beside it) and what to run; for a server, that the URL names a writable
    primary."""
    if not is_file_location(db):
        return (
            "point --db at the primary (a standby, a read-only server or a role without write "
            "privileges refuses writes), or grant the role INSERT, UPDATE and DELETE on the ledger's tables"
        )
    path = os.path.abspath(os.path.expanduser(db))
    parent = os.path.dirname(path)
    candidates = [p for p in (path, f"{path}-wal", f"{path}-shm") if os.path.exists(p)]
    blocked = [p for p in candidates if not os.access(p, os.W_OK)]
    if not os.access(parent, os.W_OK):
        blocked.append(parent)
    first = blocked[0] if blocked else path
    if _read_only_mount(first):
        return f"the file system holding {first} is mounted read-only (`findmnt -T {shlex.quote(first)}` shows it)"
    if _immutable(first):
        return f"{first} is marked immutable: `chattr -i {shlex.quote(first)}` (as root) lets writes through"
    if not blocked:
        return "check that the file system is mounted read-write and that the file is not marked immutable"
    st = os.stat(first)
    owner, me = _user_name(st.st_uid), _user_name(os.geteuid())
    what = "its directory" if first == parent else "it"
    return (
        f"{first} belongs to {owner} (mode {st.st_mode & 0o777:o}) and you are {me}: run it as {owner} "
        f"(`{shlex.join(['sudo', '-u', owner, 'idemctl', *_shown_args()])}`), or let {me} write {what}"
    )


def _read_only_mount(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _immutable(path: str) -> bool:
    """Whether the file carries the immutable attribute (`chattr +i`), which
    refuses writes even to root. Linux only; False where it cannot be read."""
    try:
        import array
        import fcntl

        fs_ioc_getflags, fs_immutable_fl = 0x80086601, 0x10
        flags = array.array("l", [0])
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:
            fcntl.ioctl(fd, fs_ioc_getflags, flags, True)
        finally:
            os.close(fd)
        return bool(flags[0] & fs_immutable_fl)
    except (ImportError, OSError):
        return False


def same_command() -> str:
    """The running command as typed, each location that carries a password masked."""
    return shlex.join(["idemctl", *_shown_args()])


def _shown_args() -> list[str]:
    """The running command's words, each location that carries a password masked."""
    return [word if is_file_location(word) else shown_db(word) for word in ARGS_IN_FORCE.get()]


def _user_name(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return f"uid {uid}"


def hint_command(words: str) -> str:
    """`idemctl WORDS` for the ledger the running command works on."""
    in_force = LEDGER_IN_FORCE.get()
    return idemctl_command(words, *in_force) if in_force else idemctl_command(words)
