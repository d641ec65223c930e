"""Commands that delete: `sweep` what is expired (past retention), `purge` one reservation."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Annotated

import typer

from ..config import ENV_FENCED_RETENTION
from ..durations import human_duration, iso
from ..fingerprint import stored_key
from ..outcomes import Drained, DrainStop, PurgeOutcome, RowView, State, SweepResult
from ..policy import Policy
from .core import EXIT_INTERRUPTED, EXIT_NO, IdemctlCommand, UserError, app, existing_row, not_found, open_ledger
from .documents import sweep_dry_run_json, sweep_json
from .escaping import visible
from .options import (
    MAX_COUNT,
    DbOpt,
    Given,
    JsonOpt,
    KeyArg,
    PrincipalOpt,
    RetentionOpt,
    TtlOpt,
    count_option,
    duration_option,
    flag,
    from_command_line,
    given_option,
    in_range,
)
from .output import CliConsole, emit_json, progress_bar, say_no
from .words import state_words

MAX_SWEEP_BATCH = 100_000


class StopFlag:
    """Set by SIGINT during a sweep. `Ledger.drain` asks it between batches,
    so Ctrl-C never cuts a batch short and the sweep still reports what it
    deleted."""

    def __init__(self) -> None:
        self.stopped = False

    def __call__(self) -> bool:
        return self.stopped

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopped = True


@contextmanager
def _stop_on_sigint() -> Iterator[StopFlag]:
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag  # only the main thread can take signals
        return
    previous = signal.signal(signal.SIGINT, flag.on_signal)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def _dry_run_words(now: int, policy: Policy, backlog: int, fenced_backlog: int) -> str:
    return (
        f"would delete {backlog} row(s) not written since {iso(now - policy.retention_ms, millis=False)} (retention "
        f"{human_duration(policy.retention_ms)}) and {fenced_backlog} fenced-out event(s) older than "
        f"{iso(now - policy.fenced_retention_ms, millis=False)} (retention "
        f"{human_duration(policy.fenced_retention_ms)}); nothing deleted"
    )


def _sweep_words(drained: Drained, policy: Policy, *, batch_size: int, elapsed_ms: int, remaining: int) -> str:
    done = (
        f"deleted {drained.keys_deleted} row(s) in {drained.batches} batch(es) of at most {batch_size}, "
        f"{human_duration(elapsed_ms)}"
    )
    # The fenced-out log is the incident record: say what happened to it
    # every time, so a sweep can never empty it unnoticed.
    log_note = (
        f"fenced-out log: {drained.fenced_deleted} event(s) older than "
        f"{human_duration(policy.fenced_retention_ms)} deleted"
    )
    if drained.stopped is DrainStop.DRAINED:
        return f"{done}; nothing left past the {human_duration(policy.retention_ms)} retention; {log_note}"
    if drained.stopped is DrainStop.MAX_BATCHES:
        return f"{done}; stopped at --max-batches with {remaining} expired row(s) left; {log_note}"
    return f"interrupted: {done}; {remaining} expired row(s) left; {log_note}"


@app.command(cls=IdemctlCommand, epilog="Example: idemctl sweep --batch-size 500 --pause 50ms --max-batches 200")
def sweep(
    ctx: typer.Context,
    batch_size: Annotated[
        int | None,
        count_option(
            "--batch-size",
            help=f"Rows per DELETE statement, 1 to {MAX_SWEEP_BATCH} (default: 250 on SQLite, 5000 on PostgreSQL).",
            low=1,
            high=MAX_SWEEP_BATCH,
            show_default=False,
        ),
    ] = None,
    max_batches: Annotated[
        int | None, count_option("--max-batches", help="Stop after N batches.", low=1, show_default=False)
    ] = None,
    retention: RetentionOpt = None,
    fenced_retention: Annotated[
        Given | None,
        given_option(
            "--fenced-retention",
            help="How long fenced-out events are kept: the record that a mutation may have run twice (default 30d).",
            env=ENV_FENCED_RETENTION,
        ),
    ] = None,
    dry_run: Annotated[bool, flag("--dry-run", help="Count what would be deleted; delete nothing.")] = False,
    pause: Annotated[
        int | None,
        duration_option(
            "--pause",
            help="Time to sleep between batches, e.g. 50ms, to leave the lock to the request path (default 0s).",
        ),
    ] = None,
    pause_ms: Annotated[
        int | None, typer.Option("--pause-ms", metavar="MS", callback=in_range(0, MAX_COUNT), hidden=True)
    ] = None,
    json_out: JsonOpt = False,
    db: DbOpt = None,
    ttl: TtlOpt = None,
) -> None:
    # One line: a line break would show in the command list of the plain-text help.
    """Delete expired rows (past retention), and fenced-out events past theirs, in bounded batches until none is left (Ctrl-C stops between batches)."""  # noqa: E501
    if pause is not None and pause_ms is not None:
        raise UserError("--pause-ms is the old spelling of --pause: give one (e.g. --pause 50ms)")
    pause_for = pause if pause is not None else pause_ms or 0
    if dry_run:
        for name in ("batch_size", "max_batches", "pause", "pause_ms"):
            if from_command_line(ctx, name):
                raise UserError(f"--{name.replace('_', '-')} does not apply with --dry-run, which deletes nothing")
    with open_ledger(
        ctx, db, write=not dry_run, ttl=ttl, retention=retention, fenced_retention=fenced_retention
    ) as ledger:
        policy = ledger.policy
        batch = batch_size or ledger.drain_batch
        started_at = ledger.now()
        if dry_run:
            backlog, fenced_backlog = ledger.count_expired(), ledger.count_fenced_expired()
            if json_out:
                emit_json(sweep_dry_run_json(started_at, policy, backlog, fenced_backlog))
            else:
                typer.echo(_dry_run_words(started_at, policy, backlog, fenced_backlog))
            return
        err = CliConsole(stderr=True)
        # The count is the progress bar's total: a full index scan of the
        # backlog that nobody sees when stderr is not a terminal.
        backlog = ledger.count_expired() if err.is_terminal else 0
        clock = time.monotonic()
        with (
            _stop_on_sigint() as stop,
            progress_bar(err, "sweeping") as progress,
        ):
            task = progress.add_task("sweep", total=backlog or None)
            deleted = 0

            def advance(result: SweepResult) -> None:
                nonlocal deleted
                deleted += result.keys_deleted
                progress.update(task, completed=deleted)

            drained = ledger.drain(
                batch=batch,
                max_batches=max_batches,
                retention_ms=policy.retention_ms,
                fenced_retention_ms=policy.fenced_retention_ms,
                pause_ms=pause_for,
                should_stop=stop,
                on_batch=advance,
            )
        elapsed_ms = int((time.monotonic() - clock) * 1000)
        remaining = ledger.count_expired() if drained.stopped is not DrainStop.DRAINED else 0
    if json_out:
        emit_json(sweep_json(drained, policy, batch_size=batch, elapsed_ms=elapsed_ms, remaining=remaining))
    else:
        typer.echo(_sweep_words(drained, policy, batch_size=batch, elapsed_ms=elapsed_ms, remaining=remaining))
    if drained.stopped is DrainStop.INTERRUPTED:
        raise typer.Exit(EXIT_INTERRUPTED)


def _refusal(principal: str, key: str, view: RowView) -> str:
    return (
        f"refused: {visible(principal)}/{key} is pending and only {human_duration(view.age_ms)} old — its owner may "
        f"still be running, and purging would let a retry run the mutation twice; wait "
        f"{human_duration(view.takeover_in_ms or 0)} for the TTL, or pass --force"
    )


def _answer() -> str:
    """One line typed (or piped) on stdin; "" at its end."""
    return sys.stdin.readline()


def _confirmed(principal: str, key: str) -> bool:
    # Asked on stderr and read from stdin by hand: click's confirm reads
    # through input(), which writes its prompt's last space to stdout, where
    # it would start the command's result (" purged …") or stand alone.
    sys.stderr.write(f"Purge {visible(principal)}/{key}? The client's next retry will run the mutation again [y/N]: ")
    sys.stderr.flush()
    try:
        answer = _answer()
    except KeyboardInterrupt:  # Ctrl-C at the prompt: as anywhere else
        typer.echo(err=True)  # end the prompt's line
        raise typer.Exit(EXIT_INTERRUPTED) from None
    if not answer:  # end of input: nobody answered
        typer.echo(err=True)
        say_no("not purged: no confirmation (pass --yes to skip the prompt)")
        return False
    if not sys.stdin.isatty():
        typer.echo(err=True)  # a piped answer is not echoed: end the prompt's line
    if answer.strip().lower() not in ("y", "yes"):
        say_no("not purged")
        return False
    return True


@app.command(cls=IdemctlCommand, epilog="Example: idemctl purge order-42 --principal acct_A --yes")
def purge(
    ctx: typer.Context,
    key: KeyArg,
    principal: PrincipalOpt,
    yes: Annotated[bool, typer.Option("--yes", "-y", metavar="", help="Do not ask for confirmation.")] = False,
    force: Annotated[
        bool,
        typer.Option("--force", metavar="", help="Also delete a fresh pending row (its owner may still be running)."),
    ] = False,
    db: DbOpt = None,
    ttl: TtlOpt = None,
) -> None:
    """Delete one reservation so that the client's next retry runs the mutation again."""
    key = stored_key(key)
    with open_ledger(ctx, db, write=True, ttl=ttl) as ledger:
        view = existing_row(ledger, principal, key)
        typer.echo(f"{visible(principal)} / {key} (generation {view.row.generation}): {state_words(view)}")
        if view.state is State.PENDING_FRESH and not force:
            say_no(_refusal(principal, key, view))
            raise typer.Exit(EXIT_NO)
        if not yes and not _confirmed(principal, key):
            raise typer.Exit(EXIT_NO)
        result = ledger.purge(principal, key, force=force)
    if result.outcome is PurgeOutcome.PURGED and result.row is not None:
        typer.echo(
            f"purged {visible(principal)}/{key} ({result.row.status.value}, generation {result.row.generation}): "
            f"the client's next retry runs the mutation again"
        )
        return
    if result.outcome is PurgeOutcome.NOT_FOUND:
        not_found(principal, key)
    say_no(_refusal(principal, key, view))
    raise typer.Exit(EXIT_NO)
