"""`copy`: every row and fenced-out event of the --db ledger into another one."""

from __future__ import annotations

import os
import shlex
from typing import Annotated

import typer
from rich.console import Console

from ..errors import ConnectionFailedError, LedgerNotFoundError, SchemaMissingError
from ..ledger import Ledger
from ..operations.copying import DEFAULT_COPY_BATCH, MAX_COPY_BATCH, CopyProgress
from ..schema import SCHEMA_VERSION
from ..storage import accepted_urls
from .core import EXIT_NO, IdemctlCommand, UserError, app, open_ledger, settings
from .documents import copy_json
from .hints import idemctl_command, same_command
from .options import DbOpt, JsonOpt, in_range
from .output import emit_json, progress_bar, say_no
from .schema import create_database, database_missing
from .words import copy_words


def _open_destination(url: str, busy_timeout_ms: int, *, init: bool, dry_run: bool) -> Ledger:
    if not url.strip():
        raise UserError(f"--to is empty: give a ledger file path, {accepted_urls()}")
    # Hints name the destination: the source is what --db names.
    init_destination = idemctl_command("init", url, True)
    how = (
        f"run `{init_destination}` first (a dry run writes nothing, not even a schema)"
        if dry_run
        else "pass --init to create or upgrade it"
    )
    writes = init and not dry_run
    try:
        return _opened(url, busy_timeout_ms, writes=writes, how=how)
    except (LedgerNotFoundError, ConnectionFailedError) as exc:
        if not database_missing(url, exc):
            raise
        reason = exc.reason if isinstance(exc, LedgerNotFoundError) else str(exc)
        if not writes:
            raise UserError(f"the destination: {reason}: {how}") from None
        # --init creates a missing server database, as `init` does.
        again = same_command()
        if not create_database(url, busy_timeout_ms, again, err=True):
            parent = os.path.dirname(os.path.abspath(os.path.expanduser(url)))
            raise UserError(f"the destination: {reason}: run `mkdir -p {shlex.quote(parent)} && {again}`") from None
        return _opened(url, busy_timeout_ms, writes=writes, how=how)


def _opened(url: str, busy_timeout_ms: int, *, writes: bool, how: str) -> Ledger:
    try:
        destination = Ledger.open(url, create=writes, busy_timeout_ms=busy_timeout_ms)
    except LedgerNotFoundError:
        raise
    except SchemaMissingError as exc:
        raise UserError(f"the destination: {exc.reason}: {how}") from None
    try:
        if writes:
            destination.init()
        version = destination.schema_version()
        if version is None or version < SCHEMA_VERSION:
            what = "has no idemctl ledger" if version is None else "has an older ledger schema"
            raise UserError(f"the destination {destination.describe()} {what}: {how}")
    except BaseException:
        destination.close()
        raise
    return destination


@app.command(
    cls=IdemctlCommand,
    epilog="Example: idemctl --db idempotency.db copy --to postgresql://app@db:5432/payments --init",
)
def copy(
    ctx: typer.Context,
    to: Annotated[
        str,
        typer.Option(
            "--to",
            metavar="PATH|URL",
            help=f"The ledger to copy into (a file, or {accepted_urls()}).",
            show_default=False,
        ),
    ],
    init: Annotated[
        bool,
        typer.Option("--init", metavar="", help="Create (or upgrade) the destination's schema first, as `init` does."),
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", metavar="", help="Count what would be copied; write nothing.")
    ] = False,
    batch: Annotated[
        int,
        typer.Option(
            "--batch",
            metavar="N",
            callback=in_range(1, MAX_COPY_BATCH),
            help=f"Rows read, compared and written per statement, 1 to {MAX_COPY_BATCH}.",
        ),
    ] = DEFAULT_COPY_BATCH,
    json_out: JsonOpt = False,
    db: DbOpt = None,
) -> None:
    # One line: a line break would show in the command list of the plain-text help.
    """Copy every row (pending and completed, with generation and token) and the fenced-out log into another ledger; again, only what changed. Never overwrites a newer or conflicting row."""  # noqa: E501
    busy_timeout_ms = settings(ctx, db=db).busy_timeout_ms
    # The source is opened read-only: a copy cannot write to it.
    with (
        open_ledger(ctx, db) as source,
        _open_destination(to, busy_timeout_ms, init=init, dry_run=dry_run) as destination,
    ):
        err = Console(stderr=True)
        # Counted only for a progress bar someone sees.
        total = source.count_rows() if err.is_terminal else 0
        read = [0]
        try:
            with progress_bar(err, "copying") as progress:
                task = progress.add_task("copy", total=total or None)

                def advance(done: CopyProgress) -> None:
                    read[0] = done.rows_read
                    progress.update(task, completed=done.rows_read)

                result = source.copy_to(destination, batch=batch, dry_run=dry_run, on_progress=advance)
        except KeyboardInterrupt:
            # The one line Ctrl-C gets (then exit 130): how far it got, and
            # that running it again is safe.
            say_no(
                f"interrupted after {read[0]} row(s) read; run the same copy again: "
                "it writes only what is missing or older in the destination"
            )
            raise
    if json_out:
        emit_json(copy_json(result))
    else:
        typer.echo(copy_words(result))
    if not result.complete:
        say_no(
            f"{len(result.conflicts)} key(s) hold another request in the destination and were not copied: "
            "inspect both rows before moving"
        )
        raise typer.Exit(EXIT_NO)
