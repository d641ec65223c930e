"""`idemctl init`: create or upgrade a ledger's schema."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from .. import storage
from ..errors import ConnectionFailedError, LedgerNotFoundError
from ..ledger import Ledger
from ..outcomes import InitAction, InitResult
from ..schema import SCHEMA_VERSION
from ..storage import DatabaseNotCreatedError
from .core import IdemctlCommand, UserError, app, settings
from .hints import hint_command, shown_db
from .options import DbOpt, flag


def _file_mode(text: str) -> int:
    """The --file-mode option: octal permission bits that let the owner read and write.

    >>> oct(_file_mode("660"))
    '0o660'
    """
    try:
        mode = int(text, 8)
    except ValueError:
        raise UserError(f"--file-mode {text!r} is not octal permission bits such as 600 or 660") from None
    if not 0 <= mode <= 0o777 or mode & 0o600 != 0o600:
        raise UserError(f"--file-mode {text} must let the owner read and write, e.g. 600 or 660")
    return mode


def _would(where: str, result: InitResult) -> str:
    """What `init --dry-run` would do to an existing database."""
    if result.action is InitAction.UP_TO_DATE:
        return f"{where}: {result.describe()}; nothing to do"
    if result.action is InitAction.CREATED:
        return f"{where}: would create the ledger tables (schema version {SCHEMA_VERSION}); nothing written"
    return (
        f"{where}: would upgrade from {result.from_version} to {result.to_version} "
        f"(adds idemctl tables and columns, no row touched); nothing written"
    )


@app.command(cls=IdemctlCommand, epilog="Example: idemctl init --db /var/lib/app/idempotency.db")
def init(
    ctx: typer.Context,
    dry_run: Annotated[bool, flag("--dry-run", help="Say what would be done; write nothing.")] = False,
    file_mode: Annotated[
        str,
        typer.Option(
            "--file-mode",
            metavar="OCTAL",
            help="Permission bits of a new SQLite ledger and its -wal, -shm and lock files "
            "(600: owner only; 660: also the owner's group). An existing file keeps its own.",
        ),
    ] = "600",
    db: DbOpt = None,
) -> None:
    """Create or upgrade the ledger schema (idempotent; keeps every row)."""
    s = settings(ctx, db=db)
    target = s.db
    mode = _file_mode(file_mode)
    if dry_run:
        try:
            ledger = Ledger.open(target, create=False, readonly=True, busy_timeout_ms=s.busy_timeout_ms)
        except LedgerNotFoundError:
            where = shown_db(target)
            typer.echo(f"{where}: would create a new ledger (schema version {SCHEMA_VERSION}); nothing written")
            return
        with ledger:
            where = ledger.describe()
            try:
                result = ledger.init(dry_run=True)
            except LedgerNotFoundError:
                if not storage.kind_of(target).capabilities.creates_database:
                    raise
                typer.echo(f"{where}: would create the database, then the ledger tables; nothing written")
                return
        typer.echo(_would(where, result))
        return
    try:
        _init(target, s.busy_timeout_ms, mode)
    except (LedgerNotFoundError, ConnectionFailedError) as exc:
        # A database that does not exist on its server: create it when this
        # role may, rather than send the operator to `init`, which they just ran.
        if not database_missing(target, exc) or not create_database(target, s.busy_timeout_ms):
            raise
        _init_new_database(target, s.busy_timeout_ms, mode)


def _init(target: str, busy_timeout_ms: int, mode: int) -> None:
    with Ledger.open(target, create=True, busy_timeout_ms=busy_timeout_ms, file_mode=mode) as ledger:
        result = ledger.init()
        typer.echo(f"{ledger.describe()}: {result.describe()}")


# How long `init` keeps trying a database it has just created. Through
# PgBouncer the first connections to it time out: the pooler failed to log in
# to it before it existed and waits out its server_login_retry (15 s by
# default, measured up to 30 s) before it tries again.
NEW_DATABASE_WAIT_S = 45.0


def _init_new_database(target: str, busy_timeout_ms: int, mode: int, wait_s: float = NEW_DATABASE_WAIT_S) -> None:
    """`_init` on a database this command has just created, tried again while
    it does not answer yet, for at most `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            _init(target, busy_timeout_ms, mode)
            return
        except ConnectionFailedError as exc:
            if time.monotonic() >= deadline:
                raise UserError(
                    f"{exc}; the database was created, but a pooler in front of it (PgBouncer) may still be "
                    f"waiting out its server_login_retry: run `{hint_command('init')}` again in 30 seconds"
                ) from None
            if not told:
                typer.echo(
                    f"{exc}; a pooler such as PgBouncer waits before it logs in again to a database it first "
                    f"found missing: trying again for up to {wait_s:.0f} s",
                    err=True,
                )
                told = True
            time.sleep(1)


def database_missing(target: str, exc: Exception) -> bool:
    """Whether `exc` may mean that the server database `target` names is not
    there (the engine's kind knows how its server says so)."""
    return storage.database_missing(target, exc)


def create_database(target: str, busy_timeout_ms: int, again: str | None = None, *, err: bool = False) -> bool:
    """Create the server database `target` names as its role; False for a
    location whose engine creates no database (a SQLite file). A role that
    may not create it gets the command an administrator runs instead, then
    `again` (by default `init` for this ledger)."""
    again = again or hint_command("init")
    try:
        result = storage.create_database(target, busy_timeout_ms=busy_timeout_ms)
    except DatabaseNotCreatedError as exc:
        raise UserError(f"{exc}; have {exc.who} run `{exc.command}`, then run `{again}` again") from None
    if result is None:
        return False
    if result.created:
        typer.echo(result.describe(), err=err)
    return True
