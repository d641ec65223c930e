"""Read-only commands: `inspect` one reservation, list `pending` rows and
`fenced` events, and count everything for dashboards and cron (`stats`)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from ..durations import human_duration
from ..errors import MalformedRowError
from ..fingerprint import stored_key
from .core import EXIT_NO, EXIT_USAGE, IdemctlCommand, UserError, app, existing_row, list_cap, open_ledger
from .documents import (
    event_json,
    fenced_json,
    inspect_json,
    pending_json,
    stats_prometheus,
    stats_report_json,
    view_json,
)
from .hints import hint_command
from .options import (
    DbOpt,
    JsonOpt,
    KeyArg,
    NlOpt,
    OnlyPrincipalOpt,
    PrincipalOpt,
    RetentionOpt,
    TtlOpt,
    complete_from,
    count_option,
    duration_option,
    flag,
    from_command_line,
)
from .output import Capped, chunks, console, emit_json, emit_json_lines, emit_json_listing, say_error, say_no
from .views import (
    PENDING_COLUMNS,
    PENDING_TABLE_CHUNK,
    Records,
    pending_cells,
    print_events,
    print_row,
    stats_grid,
    watch_stats,
)

DEFAULT_LIST_LIMIT = 50


@app.command(cls=IdemctlCommand, epilog="Example: idemctl inspect order-42 --principal acct_A")
def inspect(
    ctx: typer.Context,
    key: KeyArg,
    principal: PrincipalOpt,
    json_out: JsonOpt = False,
    db: DbOpt = None,
    ttl: TtlOpt = None,
    retention: RetentionOpt = None,
) -> None:
    """Everything about one reservation: state in words, generation, stored response, fenced-out events."""
    key = stored_key(key)
    with open_ledger(ctx, db, ttl=ttl, retention=retention) as ledger:
        view = existing_row(ledger, principal, key, json_out=json_out)
        events = list(ledger.fenced(principal=principal, key=key))
        fenced_log = ledger.has_fenced_log()
    if json_out:
        emit_json(inspect_json(view, events))
    else:
        print_row(console(), view, events, fenced_log)


def _one_json_form(json_out: bool, nl: bool) -> None:
    if json_out and nl:
        raise UserError("give --json (one document) or --nl (one object per line), not both")


def _say_more(truncated: bool, limit: int) -> None:
    # --nl has no document to say it in; stderr keeps stdout pure JSON lines.
    if truncated:
        say_no(f"more exist than --limit {limit} let through (--limit 0 for all)")


@app.command(cls=IdemctlCommand, epilog="Example: idemctl pending --stale --principal acct_A --limit 20")
def pending(
    ctx: typer.Context,
    stale: Annotated[
        bool,
        flag("--stale", help="Only rows past the TTL, whatever their age (the next retry takes them over)."),
    ] = False,
    principal: OnlyPrincipalOpt = None,
    limit: Annotated[int, count_option("--limit", "-n", help="At most N rows (0: all).")] = DEFAULT_LIST_LIMIT,
    json_out: JsonOpt = False,
    nl: NlOpt = False,
    db: DbOpt = None,
    ttl: TtlOpt = None,
) -> None:
    """Pending reservations, oldest first, with age and whether a retry would take over now."""
    _one_json_form(json_out, nl)
    # Streamed from the ledger to stdout, so `--limit 0` on a million pending
    # rows never holds them all in memory; hence the ledger stays open while rendering.
    malformed: list[MalformedRowError] = []

    def skip(exc: MalformedRowError) -> None:
        # Another program's row that cannot be read: say which, keep listing.
        malformed.append(exc)
        say_error(f"{exc}; skipped")

    with open_ledger(ctx, db, ttl=ttl) as ledger:
        cap = list_cap(limit)
        now = ledger.now()
        ttl_ms = ledger.policy.pending_ttl_ms
        views = Capped(
            ledger.pending(
                stale_only=stale,
                principal=principal,
                limit=None if cap is None else cap + 1,
                now=now,
                on_malformed=skip,
            ),
            cap,
        )
        if json_out:
            emit_json_listing(pending_json(now, ttl_ms, stale, views, lambda: views.truncated))
            if malformed:
                raise typer.Exit(EXIT_USAGE)
            return
        if nl:
            emit_json_lines(view_json(v) for v in views)
            _say_more(views.truncated, limit)
            if malformed:
                raise typer.Exit(EXIT_USAGE)
            return
        out = console()
        records = Records(out, PENDING_COLUMNS)
        listed = 0
        for chunk in chunks(views, PENDING_TABLE_CHUNK):
            records.print([pending_cells(v) for v in chunk])
            listed += len(chunk)
    if not listed:
        out.print("no stale pending rows" if stale else "no pending rows")
    else:
        more = f"; more exist (--limit {cap * 2 if cap else 0} or 0 for all)" if views.truncated else ""
        out.print(f"{listed} pending row(s), oldest first; TTL {human_duration(ttl_ms)}{more}")
    if malformed:
        raise typer.Exit(EXIT_USAGE)


@app.command(cls=IdemctlCommand, epilog="Example: idemctl fenced --since 24h --principal acct_A")
def fenced(
    ctx: typer.Context,
    principal: OnlyPrincipalOpt = None,
    key: Annotated[str | None, typer.Option("--key", "-k", metavar="KEY", help="Only this key.")] = None,
    since: Annotated[int | None, duration_option("--since", help="Only events newer than this (e.g. 24h).")] = None,
    limit: Annotated[int, count_option("--limit", "-n", help="At most N events (0: all).")] = DEFAULT_LIST_LIMIT,
    json_out: JsonOpt = False,
    nl: NlOpt = False,
    db: DbOpt = None,
) -> None:
    """Fenced-out events, newest first: late completions whose answer was not stored."""
    _one_json_form(json_out, nl)
    if key is not None:
        key = stored_key(key)
    with open_ledger(ctx, db) as ledger:
        now = ledger.now()
        cap = list_cap(limit)
        found = ledger.fenced(
            principal=principal,
            key=key,
            since=None if since is None else now - since,
            limit=None if cap is None else cap + 1,
        )
        if nl:
            streamed = Capped(found, cap)
            emit_json_lines(event_json(e) for e in streamed)
            _say_more(streamed.truncated, limit)
            if not ledger.has_fenced_log():  # no lines, and why: nothing records them here
                say_no(f"no fenced-out log: this ledger has only the recipe's table; `{hint_command('init')}` adds it")
            return
        events = list(found)
        fenced_log = ledger.has_fenced_log()
    truncated = cap is not None and len(events) > cap
    events = events[:cap] if cap is not None else events
    if json_out:
        emit_json(fenced_json(now, truncated, fenced_log, events))
        return
    out = console()
    if not fenced_log:
        out.print(Text(f"no fenced-out log: this ledger has only the recipe's table; `{hint_command('init')}` adds it"))
        return
    if not events:
        out.print("no fenced-out events" + (f" in the last {human_duration(since)}" if since is not None else ""))
        return
    print_events(out, events, now, show_key=True)
    more = "; more exist (raise --limit, 0 for all)" if truncated else ""
    out.print(
        f"{len(events)} event(s), newest first; late: the superseded owner's generation, row: the generation "
        f"holding the row, status: what the late owner computed (not stored). Each means a mutation may have run "
        f"twice{more}"
    )


def _only_with(ctx: typer.Context, needed: str, *names: str) -> None:
    """Refuse options that mean something only beside another one: ignored,
    they would let an operator believe they had an effect."""
    for name in names:
        if from_command_line(ctx, name):
            raise UserError(f"--{name.replace('_', '-')} only applies with {needed}")


def _write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file beside it and a rename,
    so that a reader (node_exporter's textfile collector) never sees half."""
    directory = path.parent if str(path.parent) else Path(".")
    try:
        fd, staging = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise UserError(f"cannot write --output {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(staging, 0o644)  # a metrics file is for the collector to read
        os.replace(staging, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.remove(staging)
        raise UserError(f"cannot write --output {path}: {exc.strerror or exc}") from None


STATS_FORMATS = ("text", "json", "prometheus")


@app.command(
    cls=IdemctlCommand,
    epilog=(
        "Example (cron): idemctl stats --max-expired 10000 --max-fenced 0 || page-oncall\n\n"
        "Example (textfile collector, with the app's TTL and retention): idemctl stats --format prometheus "
        "--ttl 30s --retention 24h --max-fenced 0 --output /var/lib/node_exporter/idemctl.prom || page-oncall"
    ),
)
def stats(
    ctx: typer.Context,
    json_out: JsonOpt = False,
    max_expired: Annotated[
        int | None,
        count_option(
            "--max-expired", help="Exit 1 if more than N rows are expired (past retention, waiting for the sweep)."
        ),
    ] = None,
    max_backlog: Annotated[int | None, count_option("--max-backlog", help=None, hidden=True)] = None,
    max_stale: Annotated[
        int | None,
        count_option("--max-stale", help="Exit 1 if more than N pending rows are past the TTL, whatever their age."),
    ] = None,
    max_fenced: Annotated[
        int | None, count_option("--max-fenced", help="Exit 1 if more than N fenced-out events are recorded.")
    ] = None,
    output_format: Annotated[
        str,
        typer.Option(
            "--format",
            autocompletion=complete_from(STATS_FORMATS),
            metavar="FORMAT",
            help="text (default), json (as --json) or prometheus (gauges for node_exporter's textfile collector). "
            "The --max-* checks apply to every format.",
        ),
    ] = "text",
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            metavar="FILE",
            help="With --format json or prometheus: write the document to FILE (a temporary file renamed into "
            "place), also when a --max-* check fails.",
            show_default=False,
        ),
    ] = None,
    watch: Annotated[
        bool, flag("--watch", help="Refresh until Ctrl-C: a live view on a terminal, one line per refresh piped.")
    ] = False,
    interval: Annotated[
        int | None, duration_option("--interval", help="With --watch: time between refreshes (default 2s).")
    ] = None,
    count: Annotated[int | None, count_option("--count", help="With --watch: stop after N refreshes.", low=1)] = None,
    db: DbOpt = None,
    ttl: TtlOpt = None,
    retention: RetentionOpt = None,
) -> None:
    """Rows by state (expired: past retention), takeovers, fenced-out events, oldest rows, size."""
    if output_format not in STATS_FORMATS:
        raise UserError(f"--format must be text, json or prometheus, got {output_format!r}")
    if json_out and from_command_line(ctx, "output_format") and output_format != "json":
        raise UserError(f"give --json or --format {output_format}, not both")
    if json_out:
        output_format = "json"
    if max_expired is not None and max_backlog is not None:
        raise UserError("--max-backlog is the old name of --max-expired: give one")
    most_expired = max_expired if max_expired is not None else max_backlog
    if watch:
        if output_format != "text":
            raise UserError("--watch shows the text view; for json or prometheus, run stats on a schedule instead")
        _only_with(ctx, "a single stats run, not --watch", "max_expired", "max_backlog", "max_stale", "max_fenced")
        _only_with(ctx, "--format json or prometheus", "output")
        with open_ledger(ctx, db, ttl=ttl, retention=retention) as ledger:
            watch_stats(ledger, interval_ms=max(2000 if interval is None else interval, 100), count=count)
        return
    _only_with(ctx, "--watch", "interval", "count")
    if output is not None and output_format == "text":
        raise UserError("--output only applies with --format json or prometheus")
    with open_ledger(ctx, db, ttl=ttl, retention=retention) as ledger:
        st = ledger.stats()
        policy = ledger.policy
        where = ledger.describe()
    breaches = [
        f"{value} {what} (max {most})"
        for value, most, what in (
            (st.expired, most_expired, "expired rows"),
            (st.pending_stale, max_stale, "stale pending rows"),
            (st.fenced_out_events, max_fenced, "fenced-out events"),
        )
        if most is not None and value > most
    ]
    if output_format == "text":
        console().print(stats_grid(where, st, policy))
    else:
        text = (
            stats_prometheus(where, st, policy)
            if output_format == "prometheus"
            else json.dumps(stats_report_json(where, policy, st, breaches), indent=2, ensure_ascii=False) + "\n"
        )
        if output is not None:
            _write_atomically(output, text)
        elif output_format == "prometheus":
            typer.echo(text, nl=False)
        else:
            emit_json(stats_report_json(where, policy, st, breaches))
    if breaches:
        say_no("check failed: " + "; ".join(breaches))
        raise typer.Exit(EXIT_NO)
