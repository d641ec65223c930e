"""`idemctl init`: create or upgrade a ledger's schema."""

from __future__ import annotations

from typing import Annotated

import typer

from ..errors import LedgerNotFoundError
from ..ledger import Ledger
from ..outcomes import InitAction, InitResult
from ..schema import SCHEMA_VERSION
from .core import DbOpt, IdemctlCommand, UserError, app, settings


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
    dry_run: Annotated[
        bool, typer.Option("--dry-run", metavar="", help="Say what would be done; write nothing.")
    ] = False,
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
            typer.echo(f"{target}: would create a new ledger (schema version {SCHEMA_VERSION}); nothing written")
            return
        with ledger:
            result = ledger.init(dry_run=True)
            where = ledger.describe()
        typer.echo(_would(where, result))
        return
    with Ledger.open(target, create=True, busy_timeout_ms=s.busy_timeout_ms, file_mode=mode) as ledger:
        result = ledger.init()
        typer.echo(f"{ledger.describe()}: {result.describe()}")
