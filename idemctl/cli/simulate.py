"""`idemctl simulate`: run a scenario on a virtual clock and show its timeline."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import TaskID

from ..storage import is_file_location, keyword_dsn
from .core import EXIT_NO, IdemctlCommand, UserError, app, command_policy, settings
from .hints import shown_db
from .options import JsonOpt, RetentionOpt, TtlOpt, complete_from, count_option, from_command_line
from .output import CliConsole, console, emit_json, progress_bar, say_no
from .scenario import BUILTIN_NAMES, Op, builtin, load_scenario_file
from .simulation import run_scenario
from .timeline import Timeline, print_timeline, timeline_json


@contextmanager
def fill_progress() -> Iterator[Callable[[str, int, int], None] | None]:
    """A progress bar on stderr for the long steps (a big `fill`), when
    stderr is a terminal; nothing otherwise, so that pipes and logs stay clean."""
    err = CliConsole(stderr=True)
    if not err.is_terminal:
        yield None
        return
    with progress_bar(err, "{task.description}") as bar:
        tasks: dict[str, TaskID] = {}

        def update(what: str, done: int, total: int) -> None:
            if what not in tasks:
                tasks[what] = bar.add_task(what, total=total)
            bar.update(tasks[what], completed=done)

        yield update


def _inspect_hint(timeline: Timeline, target: str | None) -> str:
    """The command that shows the last inspected row, when it is in a real ledger."""
    inspected = [e for e in timeline.events if e.op is Op.INSPECT]
    if not timeline.database or not inspected:
        return ""
    last = inspected[-1]
    # A URL that carries a password is not echoed back (a connection string
    # is shown as the URL the ledger describes, which carries none).
    url = target is not None and not is_file_location(target) and keyword_dsn(target) is None
    where = shlex.quote(shown_db(target) if target is not None and url else timeline.database)
    key, principal = shlex.quote(last.key or ""), shlex.quote(last.principal or "")
    return f"; see it with: idemctl inspect {key} --principal {principal} --db {where}"


@app.command(
    cls=IdemctlCommand,
    epilog=(
        "Built-in scenarios: " + ", ".join(BUILTIN_NAMES) + ". A scenario file is TOML with \\[\\[step]] tables "
        "(see docs/cli.md).\n\nExample: idemctl simulate takeover --db idempotency.db"
    ),
)
def simulate(
    ctx: typer.Context,
    scenario: Annotated[
        str | None,
        typer.Argument(
            metavar="SCENARIO",
            help="A built-in scenario: " + ", ".join(BUILTIN_NAMES) + ".",
            show_default=False,
            autocompletion=complete_from(BUILTIN_NAMES),
        ),
    ] = None,
    file: Annotated[
        Path | None,
        typer.Option(
            "--file", "-f", metavar="FILE", help="Run an operator-written scenario.toml instead.", show_default=False
        ),
    ] = None,
    workers: Annotated[int, count_option("--workers", "-w", help="Processes for `race`, 2 to 64.", low=2, high=64)] = 4,
    json_out: JsonOpt = False,
    db: Annotated[
        str | None,
        typer.Option(
            "--db",
            metavar="PATH|URL",
            help="Write into this existing ledger (default: a temporary one; IDEMCTL_DB is ignored).",
            show_default=False,
        ),
    ] = None,
    ttl: TtlOpt = None,
    retention: RetentionOpt = None,
) -> None:
    """Replay claim/takeover/complete sequences on a virtual clock and print the timeline."""
    if scenario is not None and file is not None:
        raise UserError("give a scenario name or --file, not both")
    if from_command_line(ctx, "workers") and scenario != "race":
        raise UserError("--workers only applies to `idemctl simulate race`")
    s = settings(ctx, db=db, ttl=ttl, retention=retention)
    policy = command_policy(s)
    if file is not None:
        sc = load_scenario_file(file)
    elif scenario is not None:
        sc = builtin(scenario, policy, workers=workers)
    else:
        raise UserError(f"name a scenario ({', '.join(BUILTIN_NAMES)}) or give --file scenario.toml")
    # Only a ledger named on the command line receives simulated rows: a
    # production IDEMCTL_DB in the environment must never get them.
    target = db if db is not None else (s.db if s.db_on_command_line else None)
    with fill_progress() as progress:
        timeline = run_scenario(sc, target, policy=policy, progress=progress)
    if json_out:
        emit_json(timeline_json(timeline))
    else:
        print_timeline(console(), timeline)
        if timeline.ok:
            typer.echo(f"every step went as expected{_inspect_hint(timeline, target)}")
    failures = timeline.failures()
    if failures:
        first = failures[0]
        what = f"expected {first.expected}, got {first.outcome.value}" if first.expected else first.detail
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        say_no(f"simulation {sc.name}: step {first.step} ({first.actor} {first.op.value}) {what}{more}")
        raise typer.Exit(EXIT_NO)
