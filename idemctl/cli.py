"""`idemctl`: the operator's CLI. Each command calls one library function and
renders what it returns; every error the library raises on purpose becomes one
line on stderr and a documented exit code."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Generic, NoReturn, Optional, TypeVar

import typer
from rich import box
from rich.console import Console
from rich.highlighter import JSONHighlighter
from rich.padding import Padding
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup

from . import __version__
from .durations import ago, human_duration, iso, parse_duration
from .errors import (
    IdemctlError,
    InvalidKeyError,
    LedgerNotFoundError,
    MalformedRowError,
    SchemaMissingError,
    SchemaOutdatedError,
)
from .fingerprint import fingerprint as compute_fingerprint
from .fingerprint import header_values, is_valid_key
from .ledger import Ledger
from .outcomes import InitAction, PurgeOutcome, RowView, State, Status
from .policy import Policy
from .render import (
    body_kind,
    event_json,
    state_words,
    stats_json,
    takeovers_words,
    terminal_safe_json,
    view_json,
    visible,
)
from .responses import header_problem, stored_header_pairs
from .schema import SCHEMA_VERSION
from .simulate import BUILTIN_NAMES, Event, Op, Timeline, builtin, load_scenario_file, run_scenario

# Exit codes: part of the interface, documented in `idemctl --help` and the README.
EXIT_OK = 0
EXIT_NO = 1  # the answer is "no": not found, refused, declined, mismatch, check or expectation failed
EXIT_USAGE = 2  # usage or database problem: bad option or key, no/unreadable/too-new ledger, locked, read-only
EXIT_INTERRUPTED = 130  # Ctrl-C (sweep reports what it deleted first)

DEFAULT_DB = "idempotency.db"
MAX_SWEEP_BATCH = 100_000
DEFAULT_LIST_LIMIT = 50

EXIT_CODES_HELP = (
    "[b]Exit codes[/b]: 0 done · 1 the answer is no (row not found, purge refused or declined, "
    "fingerprint differs, a stats threshold or a simulation expectation failed) · "
    "2 usage or database problem (bad option or key, no ledger, not a database, schema missing or newer, "
    "database locked or read-only, bad scenario) · 130 interrupted."
)
# Human output's one escaping scheme (render.visible); documented next to the exit codes.
ESCAPING_HELP = (
    "[b]Escaped text[/b]: what clients sent and what the database holds (principals, keys, headers, bodies) "
    "is printed with control and invisible characters escaped as in a Python string literal "
    "(\\t \\n \\r, else \\xNN or \\uNNNN: ESC shows as \\x1b, a bidi override as \\u202e) and "
    "never as rich markup; a body keeps its line breaks and tabs. A backslash is printed as is, so "
    "--json, which is exact, is the way to tell an escape from a literal backslash."
)


class UserError(Exception):
    """A problem with what the operator asked for that the library cannot see
    (an unreadable --body-file, --key without --principal)."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


def _one_line(message: object) -> str:
    # Messages can quote stored values (a foreign row's principal): escaped.
    return visible(" ".join(str(message).split()))


def _say_error(message: object) -> None:
    # typer.echo, not rich: rich would wrap a long message onto several lines.
    typer.echo(f"{typer.style('error:', fg='red', bold=True)} {_one_line(message)}", err=True)


def _say_no(message: object) -> None:
    typer.echo(_one_line(message), err=True)


# Typer may run on its own vendored copy of click, so the base class of its
# usage errors is taken from the one it exports rather than imported from click.
_CLICK_EXCEPTION: type[Exception] = next(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException"
)


class IdemctlGroup(TyperGroup):
    """Maps every deliberate error to one stderr line and an exit code, for
    every command at once, so no command can forget to."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        # Usage errors too are one line on stderr (Typer would draw a box of
        # several); the hint says where the full usage is.
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except _CLICK_EXCEPTION as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # bare `idemctl`: the help is the answer
                exc.show()  # type: ignore[attr-defined]
            else:
                ctx = getattr(exc, "ctx", None)
                where = ctx.command_path if ctx is not None else "idemctl"
                _say_error(f"{exc.format_message()} (see '{where} --help')")  # type: ignore[attr-defined]
            sys.exit(getattr(exc, "exit_code", EXIT_USAGE))
        except typer.Abort:
            _say_error("aborted")
            sys.exit(EXIT_NO)
        sys.exit(rv if isinstance(rv, int) else EXIT_OK)

    def invoke(self, ctx: typer.Context) -> Any:
        try:
            return super().invoke(ctx)
        except IdemctlError as exc:
            _say_error(_with_hint(exc))
            raise typer.Exit(EXIT_USAGE) from None
        except UserError as exc:
            _say_error(exc)
            raise typer.Exit(exc.code) from None


def _with_hint(exc: IdemctlError) -> str:
    """The library's message plus what to type about it, in the CLI's words."""
    if isinstance(exc, SchemaOutdatedError):
        return f"{exc} — run `idemctl init` to upgrade it"
    if isinstance(exc, SchemaMissingError):
        return f"{exc} — run `idemctl init`"
    return str(exc)


app = typer.Typer(
    name="idemctl",
    cls=IdemctlGroup,
    help=(
        "Inspect, sweep and repair an Idempotency-Key ledger (SQLite file or postgresql:// URL).\n\n"
        "Example: idemctl inspect order-42 --principal acct_A --db idempotency.db"
    ),
    epilog=EXIT_CODES_HELP + "\n\n" + ESCAPING_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


# -- options shared by commands -----------------------------------------------------------
def _duration_param(value: str) -> int:
    return parse_duration(value)


@dataclass(frozen=True)
class Settings:
    db: str
    db_on_command_line: bool
    ttl_ms: int | None
    retention_ms: int | None
    busy_timeout_ms: int


DbOpt = Annotated[
    Optional[str],
    typer.Option("--db", metavar="PATH|URL", help="Ledger to use; overrides the global --db.", show_default=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON document on stdout (stable field names), nothing else.")]
TtlOpt = Annotated[
    Optional[int],
    typer.Option("--ttl", metavar="DURATION", parser=_duration_param, help="Pending TTL (e.g. 30s); overrides the global --ttl.", show_default=False),
]
RetentionOpt = Annotated[
    Optional[int],
    typer.Option("--retention", metavar="DURATION", parser=_duration_param, help="Retention (e.g. 24h); overrides the global --retention.", show_default=False),
]
PrincipalOpt = Annotated[str, typer.Option("--principal", "-p", help="The principal (account) the key belongs to.")]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"idemctl {__version__}")
        raise typer.Exit()


@app.callback()
def _global(
    ctx: typer.Context,
    db: Annotated[
        str,
        typer.Option("--db", envvar="IDEMCTL_DB", metavar="PATH|URL", help="Ledger: a SQLite file or a postgresql:// URL."),
    ] = DEFAULT_DB,
    ttl: Annotated[
        Optional[int],
        typer.Option(
            "--ttl", envvar="IDEMCTL_PENDING_TTL", metavar="DURATION", parser=_duration_param,
            help="Pending TTL the application uses, e.g. 30s (default: the Policy's 30 s).", show_default=False,
        ),
    ] = None,
    retention: Annotated[
        Optional[int],
        typer.Option(
            "--retention", envvar="IDEMCTL_RETENTION", metavar="DURATION", parser=_duration_param,
            help="Retention the application uses, e.g. 24h (default: the Policy's 24 h).", show_default=False,
        ),
    ] = None,
    busy_timeout: Annotated[
        int,
        typer.Option(
            "--busy-timeout", envvar="IDEMCTL_BUSY_TIMEOUT", metavar="DURATION", parser=_duration_param,
            help="How long to wait for a locked database before giving up.",
        ),
    ] = "5s",  # type: ignore[assignment]
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    ctx.obj = Settings(
        db=db,
        db_on_command_line=_from_command_line(ctx, "db"),
        ttl_ms=ttl,
        retention_ms=retention,
        busy_timeout_ms=busy_timeout,
    )


def _from_command_line(ctx: typer.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def _settings(ctx: typer.Context) -> Settings:
    obj = ctx.find_object(Settings)
    if obj is None:  # a command invoked without the group (never from the console script)
        return Settings(DEFAULT_DB, False, None, None, 5000)
    return obj


def _policy(s: Settings, ttl: int | None = None, retention: int | None = None, fenced_retention: int | None = None) -> Policy:
    kw: dict[str, int] = {}
    ttl = ttl if ttl is not None else s.ttl_ms
    retention = retention if retention is not None else s.retention_ms
    if ttl is not None:
        kw["pending_ttl_ms"] = ttl
    if retention is not None:
        kw["retention_ms"] = retention
    if fenced_retention is not None:
        kw["fenced_retention_ms"] = fenced_retention
    return Policy(**kw)


@contextmanager
def _ledger(
    ctx: typer.Context,
    db: str | None,
    *,
    write: bool = False,
    ttl: int | None = None,
    retention: int | None = None,
    fenced_retention: int | None = None,
) -> Iterator[Ledger]:
    """Open an existing ledger; never creates one (only `init` does)."""
    s = _settings(ctx)
    policy = _policy(s, ttl, retention, fenced_retention)
    target = db or s.db
    ledger = Ledger.open(target, policy=policy, create=False, readonly=not write, busy_timeout_ms=s.busy_timeout_ms)
    try:
        if ledger.schema_version() is None:
            raise SchemaMissingError(ledger.describe())
        yield ledger
    finally:
        ledger.close()


def _check_key(key: str) -> None:
    if not is_valid_key(key):
        raise InvalidKeyError(f"invalid Idempotency-Key {key!r}: must be 1-255 printable ASCII characters")


def _console() -> Console:
    # Made per command so it writes to whatever sys.stdout is now (CliRunner swaps it).
    return Console(highlight=False)


def _shown(value: object) -> Text:
    """A value from a client or the database as a rich cell: escaped (see
    `render.visible`), and a Text so that rich never reads it as markup."""
    return Text(visible(value))


def _emit_json(doc: object) -> None:
    typer.echo(terminal_safe_json(json.dumps(doc, indent=2, ensure_ascii=False)))


def _limit(value: int) -> int | None:
    return None if value == 0 else value


T = TypeVar("T")

# A long listing is printed as a run of tables of this many rows (the header
# on the first only): a rich Table holds all its rows until it is printed.
PENDING_TABLE_CHUNK = 500


class _Capped(Generic[T]):
    """At most `cap` items of a stream, noting whether more were there. The
    stream is asked for cap + 1 so that one extra item reveals truncation."""

    def __init__(self, items: Iterable[T], cap: int | None) -> None:
        self._items = items
        self._cap = cap
        self.truncated = False

    def __iter__(self) -> Iterator[T]:
        for count, item in enumerate(self._items):
            if self._cap is not None and count >= self._cap:
                self.truncated = True
                return
            yield item


def _chunks(items: Iterable[T], size: int) -> Iterator[list[T]]:
    chunk: list[T] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _emit_json_listing(
    head: dict[str, Any], name: str, items: Iterable[object], tail: Callable[[], dict[str, Any]]
) -> None:
    """Write {**head, name: [items...], **tail()} exactly as _emit_json would,
    item by item, so a long listing is never built in memory. `tail` is
    called after the items, when it can say whether the listing was cut."""
    out = sys.stdout
    out.write("{\n")
    for k, v in head.items():
        out.write(f"  {json.dumps(k)}: {terminal_safe_json(json.dumps(v, ensure_ascii=False))},\n")
    out.write(f"  {json.dumps(name)}: [")
    first = True
    for item in items:
        text = terminal_safe_json(json.dumps(item, indent=2, ensure_ascii=False)).replace("\n", "\n    ")
        out.write(("\n    " if first else ",\n    ") + text)
        first = False
    out.write("]" if first else "\n  ]")
    for k, v in tail().items():
        out.write(f",\n  {json.dumps(k)}: {terminal_safe_json(json.dumps(v, ensure_ascii=False))}")
    out.write("\n}\n")
    out.flush()


def _grid() -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    return grid


# -- init ----------------------------------------------------------------------------------
@app.command(epilog="Example: idemctl init --db /var/lib/app/idempotency.db")
def init(
    ctx: typer.Context,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would be done; write nothing.")] = False,
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
    s = _settings(ctx)
    target = db or s.db
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
        if result.action is InitAction.UP_TO_DATE:
            typer.echo(f"{where}: {result.describe()}; nothing to do")
        elif result.action is InitAction.CREATED:
            typer.echo(f"{where}: would create the ledger tables (schema version {SCHEMA_VERSION}); nothing written")
        else:
            typer.echo(
                f"{where}: would upgrade from {result.from_version} to {result.to_version} "
                f"(adds idemctl tables and columns, no row touched); nothing written"
            )
        return
    with Ledger.open(target, create=True, busy_timeout_ms=s.busy_timeout_ms, file_mode=mode) as ledger:
        result = ledger.init()
        typer.echo(f"{ledger.describe()}: {result.describe()}")


def _file_mode(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        raise UserError(f"--file-mode {text!r} is not octal permission bits such as 600 or 660") from None
    if not 0 <= mode <= 0o777 or mode & 0o600 != 0o600:
        raise UserError(f"--file-mode {text} must let the owner read and write, e.g. 600 or 660")
    return mode


# -- inspect -------------------------------------------------------------------------------
def _not_found(principal: str, key: str) -> NoReturn:
    _say_no(f"no row for principal {principal!r} key {key!r}: the next request with this key runs the mutation")
    raise typer.Exit(EXIT_NO)


def _response_rows(grid: Table, view: RowView) -> None:
    row = view.row
    if row.status is not Status.COMPLETED:
        grid.add_row("response", "none yet: the row is pending")
        return
    kind = body_kind(row)
    raw = row.body_bytes
    size = 0 if raw is None else len(raw)
    describe = {
        "json": f"{size} bytes, JSON",
        "text": f"{size} bytes, text",
        "empty": "no body",
        "blob": f"{size} bytes, BLOB (not UTF-8): replayed byte for byte",
        "oversize": "no body: the real answer was over the body cap, so the ledger stored this 500 sentinel "
        "and every replay fails loudly (purge the key to let the client run it again)",
    }.get(kind, "no body")
    grid.add_row("response", Text(f"{visible(row.response_status)} · {describe}"))
    grid.add_row("headers", _headers_text(row.response_headers))


def _headers_text(headers_json: str | None) -> Text:
    # Listed from the stored JSON itself, so a header that a replay leaves out
    # (a foreign row's CR/LF value, a number) is shown with the reason.
    pairs = stored_header_pairs(headers_json)
    if not pairs:
        return Text("(none stored)")
    lines = []
    for name, value in pairs:
        shown = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        line = f"{visible(name)}: {visible(shown)}"
        problem = header_problem(name, value)
        if problem is not None:
            line += f"  (not replayed: {problem})"
        lines.append(line)
    return Text("\n".join(lines))


def _render_body(console: Console, view: RowView) -> None:
    row = view.row
    kind = body_kind(row) if row.status is Status.COMPLETED else "none"
    raw = row.body_bytes
    if kind == "json":
        console.print(Text("body", style="bold"))
        # As rich's JSON renderable draws it, but escaped: JSON strings may hold
        # DEL, C1 and bidi characters unescaped.
        pretty = Text(visible(json.dumps(json.loads(str(row.response_body)), indent=2, ensure_ascii=False), multiline=True))
        if console.is_terminal:
            pretty = JSONHighlighter()(pretty)
        pretty.no_wrap = True
        console.print(pretty)
    elif kind == "text":
        console.print(Text("body", style="bold"))
        console.print(Text(visible(str(row.response_body), multiline=True)))
    elif kind == "blob" and raw is not None:
        console.print(Text("body (hex, first 32 bytes)", style="bold"))
        console.print(Text(raw[:32].hex(" ") + (" …" if len(raw) > 32 else "")))


def _events_table(events: list[Any], now: int, show_key: bool) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("fenced at (UTC)", no_wrap=True)
    table.add_column("age", no_wrap=True)
    if show_key:
        table.add_column("principal", overflow="fold", min_width=10, ratio=1)
        table.add_column("key", overflow="fold", min_width=10, ratio=1)
    table.add_column("late", justify="right", no_wrap=True)
    table.add_column("row", justify="right", no_wrap=True)
    table.add_column("status", justify="right", no_wrap=True)
    for e in events:
        cells = [iso(e.fenced_at, millis=False), ago(e.fenced_at, now)]
        if show_key:
            cells += [e.principal, e.key]
        cells += [
            str(e.superseded_generation),
            "gone" if e.current_generation is None else str(e.current_generation),
            str(e.computed_status),
        ]
        table.add_row(*[_shown(c) for c in cells])
    return table


@app.command(epilog="Example: idemctl inspect order-42 --principal acct_A")
def inspect(
    ctx: typer.Context,
    key: Annotated[str, typer.Argument(metavar="KEY", help="The Idempotency-Key.", show_default=False)],
    principal: PrincipalOpt,
    json_out: JsonOpt = False,
    db: DbOpt = None,
    ttl: TtlOpt = None,
    retention: RetentionOpt = None,
) -> None:
    """Everything about one reservation: state in words, generation, stored response, fenced-out events."""
    _check_key(key)
    with _ledger(ctx, db, ttl=ttl, retention=retention) as ledger:
        view = ledger.get(principal, key)
        if view is None:
            _not_found(principal, key)
        events = list(ledger.fenced(principal=principal, key=key))
        has_log = ledger.has_fenced_log()
    if json_out:
        doc = view_json(view)
        doc["fenced_out"] = [event_json(e) for e in events]
        _emit_json(doc)
        return
    console = _console()
    row, now = view.row, view.now
    console.print(Text(f"{visible(row.principal)} / {visible(row.key)}", style="bold"))
    grid = _grid()
    grid.add_row("state", Text(state_words(view)))
    grid.add_row("status", _shown(row.status.value))
    grid.add_row("generation", Text(takeovers_words(row.generation)))
    grid.add_row("fingerprint", _shown(row.fingerprint))
    grid.add_row("created", f"{iso(row.created_at)} ({ago(row.created_at, now)})")
    grid.add_row("updated", f"{iso(row.updated_at)} ({ago(row.updated_at, now)})")
    _response_rows(grid, view)
    console.print(grid)
    _render_body(console, view)
    console.print()
    if events:
        console.print(
            Text(f"fenced-out events ({len(events)}): a late owner's answer was not stored; the mutation may have run twice", style="bold")
        )
        console.print(_events_table(events, now, show_key=False))
    elif not has_log:
        console.print(Text("fenced-out events: not recorded (this ledger has only the recipe's table; `idemctl init` adds the log)"))
    else:
        console.print(Text("fenced-out events: none", style="bold"))


# -- pending -------------------------------------------------------------------------------
@app.command(epilog="Example: idemctl pending --stale --principal acct_A --limit 20")
def pending(
    ctx: typer.Context,
    stale: Annotated[bool, typer.Option("--stale", help="Only rows past the TTL (the next retry takes them over).")] = False,
    principal: Annotated[Optional[str], typer.Option("--principal", "-p", help="Only this principal.")] = None,
    limit: Annotated[int, typer.Option("--limit", "-n", min=0, help="At most N rows (0: all).")] = DEFAULT_LIST_LIMIT,
    json_out: JsonOpt = False,
    db: DbOpt = None,
    ttl: TtlOpt = None,
) -> None:
    """Pending reservations, oldest first, with age and whether a retry would take over now."""
    # Streamed from the ledger to stdout, so `--limit 0` on a million pending
    # rows never holds them all in memory; hence the ledger stays open while rendering.
    malformed: list[MalformedRowError] = []

    def skip(exc: MalformedRowError) -> None:
        # Another program's row that cannot be read: say which, keep listing.
        malformed.append(exc)
        _say_error(f"{exc}; skipped")

    with _ledger(ctx, db, ttl=ttl) as ledger:
        cap = _limit(limit)
        now = ledger.now()
        ttl_ms = ledger.policy.pending_ttl_ms
        views = _Capped(
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
            _emit_json_listing(
                {"now": now, "pending_ttl_ms": ttl_ms, "stale_only": stale},
                "rows",
                (view_json(v) for v in views),
                lambda: {"truncated": views.truncated},
            )
            if malformed:
                raise typer.Exit(EXIT_USAGE)
            return
        console = _console()
        shown = 0
        for chunk in _chunks(views, PENDING_TABLE_CHUNK):
            table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_header=shown == 0)
            for name in ("principal", "key", "gen", "age", "a retry now"):
                table.add_column(name, overflow="fold", no_wrap=name in ("gen", "age"))
            for v in chunk:
                if v.state is State.PENDING_FRESH:
                    verdict = Text(f"409 in progress for {human_duration(v.takeover_in_ms or 0)} more")
                else:
                    verdict = Text(f"takes over as generation {v.row.generation + 1}", style="yellow")
                table.add_row(
                    _shown(v.row.principal), _shown(v.row.key), _shown(v.row.generation), human_duration(v.age_ms), verdict
                )
            console.print(table)
            shown += len(chunk)
    if not shown:
        console.print("no stale pending rows" if stale else "no pending rows")
    else:
        more = f"; more exist (--limit {cap * 2 if cap else 0} or 0 for all)" if views.truncated else ""
        console.print(f"{shown} pending row(s), oldest first; TTL {human_duration(ttl_ms)}{more}")
    if malformed:
        raise typer.Exit(EXIT_USAGE)


# -- fenced --------------------------------------------------------------------------------
@app.command(epilog="Example: idemctl fenced --since 24h --principal acct_A")
def fenced(
    ctx: typer.Context,
    principal: Annotated[Optional[str], typer.Option("--principal", "-p", help="Only this principal.")] = None,
    key: Annotated[Optional[str], typer.Option("--key", "-k", help="Only this key.")] = None,
    since: Annotated[
        Optional[int],
        typer.Option("--since", metavar="DURATION", parser=_duration_param, help="Only events newer than this (e.g. 24h).", show_default=False),
    ] = None,
    limit: Annotated[int, typer.Option("--limit", "-n", min=0, help="At most N events (0: all).")] = DEFAULT_LIST_LIMIT,
    json_out: JsonOpt = False,
    db: DbOpt = None,
) -> None:
    """Fenced-out events, newest first: late completions whose answer was not stored."""
    if key is not None:
        _check_key(key)
    with _ledger(ctx, db) as ledger:
        now = ledger.now()
        cap = _limit(limit)
        events = list(
            ledger.fenced(
                principal=principal,
                key=key,
                since=None if since is None else now - since,
                limit=None if cap is None else cap + 1,
            )
        )
        has_log = ledger.has_fenced_log()
    truncated = cap is not None and len(events) > cap
    events = events[:cap] if cap is not None else events
    if json_out:
        _emit_json({"now": now, "truncated": truncated, "fenced_log": has_log, "events": [event_json(e) for e in events]})
        return
    console = _console()
    if not has_log:
        console.print("no fenced-out log: this ledger has only the recipe's table; `idemctl init` adds it")
        return
    if not events:
        console.print("no fenced-out events" + (f" in the last {human_duration(since)}" if since is not None else ""))
        return
    console.print(_events_table(events, now, show_key=True))
    more = "; more exist (raise --limit, 0 for all)" if truncated else ""
    console.print(
        f"{len(events)} event(s), newest first; late: the superseded owner's generation, row: the generation "
        f"holding the row, status: what the late owner computed (not stored). Each means a mutation may have run "
        f"twice{more}"
    )


# -- stats ---------------------------------------------------------------------------------
@app.command(epilog="Example (cron): idemctl stats --max-backlog 10000 --max-fenced 0 || page-oncall")
def stats(
    ctx: typer.Context,
    json_out: JsonOpt = False,
    max_backlog: Annotated[Optional[int], typer.Option("--max-backlog", min=0, help="Exit 1 if more rows than this are past retention.")] = None,
    max_stale: Annotated[Optional[int], typer.Option("--max-stale", min=0, help="Exit 1 if more pending rows than this are past the TTL.")] = None,
    max_fenced: Annotated[Optional[int], typer.Option("--max-fenced", min=0, help="Exit 1 if more fenced-out events than this are recorded.")] = None,
    db: DbOpt = None,
    ttl: TtlOpt = None,
    retention: RetentionOpt = None,
) -> None:
    """Rows by state, takeovers, fenced-out events, sweep backlog, oldest rows, size."""
    with _ledger(ctx, db, ttl=ttl, retention=retention) as ledger:
        st = ledger.stats()
        policy = ledger.policy
        where = ledger.describe()
    breaches = [
        f"{value} {what} (max {limit})"
        for value, limit, what in (
            (st.expired, max_backlog, "rows past retention"),
            (st.pending_stale, max_stale, "stale pending rows"),
            (st.fenced_out_events, max_fenced, "fenced-out events"),
        )
        if limit is not None and value > limit
    ]
    if json_out:
        doc = {"database": where, "pending_ttl_ms": policy.pending_ttl_ms, "retention_ms": policy.retention_ms}
        doc.update(stats_json(st))
        doc["check_failed"] = breaches
        _emit_json(doc)
    else:
        console = _console()
        grid = _grid()
        grid.add_row("ledger", Text(f"{where} (schema version {st.schema_version})"))
        grid.add_row("rows", str(st.total))
        grid.add_row("  pending, fresh", f"{st.pending_fresh}  (retries get 409 in progress)")
        grid.add_row("  pending, stale", f"{st.pending_stale}  (the next retry takes over)")
        grid.add_row("  completed", f"{st.completed}  (retries are replayed)")
        grid.add_row("  past retention", f"{st.expired}  (sweep backlog)")
        grid.add_row("taken over", f"{st.taken_over}  (rows with generation > 1)")
        grid.add_row("fenced-out events", str(st.fenced_out_events))
        for label, at in (
            ("oldest pending", st.oldest_pending_at),
            ("oldest completed", st.oldest_completed_at),
        ):
            grid.add_row(label, "-" if at is None else f"{iso(at)} ({ago(at, st.now)})")
        grid.add_row("size", "-" if st.storage_bytes is None else f"{st.storage_bytes:,} bytes")
        grid.add_row("policy", f"TTL {human_duration(policy.pending_ttl_ms)}, retention {human_duration(policy.retention_ms)}")
        console.print(grid)
    if breaches:
        _say_no("check failed: " + "; ".join(breaches))
        raise typer.Exit(EXIT_NO)


# -- sweep ---------------------------------------------------------------------------------
class _StopFlag:
    """Set by SIGINT during a sweep: the loop stops between batches, never inside one."""

    def __init__(self) -> None:
        self.stopped = False

    def __call__(self, signum: int, frame: object) -> None:
        self.stopped = True


@contextmanager
def _stop_on_sigint() -> Iterator[_StopFlag]:
    flag = _StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.signal(signal.SIGINT, flag)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def _pause(ms: int, flag: _StopFlag) -> None:
    deadline = time.monotonic() + ms / 1000
    while not flag.stopped and time.monotonic() < deadline:
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


@dataclass
class _SweepTally:
    keys: int = 0
    fenced: int = 0
    batches: int = 0


def _sweep_batches(
    ledger: Ledger,
    *,
    batch: int,
    max_batches: int | None,
    retention_ms: int | None,
    fenced_retention_ms: int | None,
    pause_ms: int,
    stop: _StopFlag,
    on_batch: Callable[[_SweepTally], None] = lambda tally: None,
) -> tuple[_SweepTally, str]:
    """Run `Ledger.sweep` batch after batch. Returns the tally and why it
    stopped: "drained", "max_batches" or "interrupted"."""
    tally = _SweepTally()
    while True:
        if stop.stopped:
            return tally, "interrupted"
        if max_batches is not None and tally.batches >= max_batches:
            return tally, "max_batches"
        result = ledger.sweep(batch=batch, retention_ms=retention_ms, fenced_retention_ms=fenced_retention_ms)
        tally.batches += 1
        tally.keys += result.keys_deleted
        tally.fenced += result.fenced_deleted
        on_batch(tally)
        if result.deleted == 0:
            return tally, "drained"
        if pause_ms:
            _pause(pause_ms, stop)


@app.command(epilog="Example: idemctl sweep --batch-size 500 --pause-ms 50 --max-batches 200")
def sweep(
    ctx: typer.Context,
    batch_size: Annotated[
        Optional[int],
        typer.Option(
            "--batch-size",
            min=1,
            max=MAX_SWEEP_BATCH,
            help="Rows per DELETE statement (default: 250 on SQLite, 1000 on PostgreSQL).",
            show_default=False,
        ),
    ] = None,
    max_batches: Annotated[Optional[int], typer.Option("--max-batches", min=1, help="Stop after N batches.", show_default=False)] = None,
    retention: RetentionOpt = None,
    fenced_retention: Annotated[
        Optional[int],
        typer.Option(
            "--fenced-retention",
            metavar="DURATION",
            parser=_duration_param,
            help="How long fenced-out events are kept: the record that a mutation may have run twice (default 30d).",
            show_default=False,
        ),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Count what would be deleted; delete nothing.")] = False,
    pause_ms: Annotated[int, typer.Option("--pause-ms", min=0, help="Sleep between batches, to leave the lock to the request path.")] = 0,
    json_out: JsonOpt = False,
    db: DbOpt = None,
    ttl: TtlOpt = None,
) -> None:
    """Delete rows past retention, and fenced-out events past theirs, in bounded batches until none is left (Ctrl-C stops between batches)."""
    with _ledger(ctx, db, write=not dry_run, ttl=ttl, retention=retention, fenced_retention=fenced_retention) as ledger:
        retention_ms = ledger.policy.retention_ms
        fenced_retention_ms = ledger.policy.fenced_retention_ms
        batch_size = batch_size or ledger.drain_batch
        started_at = ledger.now()
        backlog = ledger.count_expired()
        if dry_run:
            cutoff = started_at - retention_ms
            fenced_cutoff = started_at - fenced_retention_ms
            fenced_backlog = ledger.count_fenced_expired()
            if json_out:
                _emit_json(
                    {
                        "dry_run": True,
                        "would_delete": backlog,
                        "would_delete_fenced": fenced_backlog,
                        "cutoff": cutoff,
                        "fenced_cutoff": fenced_cutoff,
                        "retention_ms": retention_ms,
                        "fenced_retention_ms": fenced_retention_ms,
                    }
                )
            else:
                typer.echo(
                    f"would delete {backlog} row(s) not written since {iso(cutoff, millis=False)} (retention "
                    f"{human_duration(retention_ms)}) and {fenced_backlog} fenced-out event(s) older than "
                    f"{iso(fenced_cutoff, millis=False)} (retention {human_duration(fenced_retention_ms)}); nothing deleted"
                )
            return
        err = Console(stderr=True)
        clock = time.monotonic()
        with _stop_on_sigint() as stop, Progress(
            TextColumn("sweeping"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=err,
            transient=True,
            disable=not err.is_terminal,
        ) as progress:
            task = progress.add_task("sweep", total=backlog or None)
            tally, why = _sweep_batches(
                ledger,
                batch=batch_size,
                max_batches=max_batches,
                retention_ms=retention_ms,
                fenced_retention_ms=fenced_retention_ms,
                pause_ms=pause_ms,
                stop=stop,
                on_batch=lambda t: progress.update(task, completed=t.keys),
            )
        elapsed_ms = int((time.monotonic() - clock) * 1000)
        remaining = ledger.count_expired() if why != "drained" else 0
    if json_out:
        _emit_json(
            {
                "dry_run": False,
                "deleted": tally.keys,
                "fenced_deleted": tally.fenced,
                "batches": tally.batches,
                "batch_size": batch_size,
                "elapsed_ms": elapsed_ms,
                "stopped": why,
                "remaining": remaining,
                "retention_ms": retention_ms,
                "fenced_retention_ms": fenced_retention_ms,
            }
        )
    else:
        done = (
            f"deleted {tally.keys} row(s) in {tally.batches} batch(es) of at most {batch_size}, "
            f"{human_duration(elapsed_ms)}"
        )
        # The fenced-out log is the incident record: say what happened to it
        # every time, so a sweep can never empty it unnoticed.
        log_note = (
            f"fenced-out log: {tally.fenced} event(s) older than {human_duration(fenced_retention_ms)} deleted"
        )
        if why == "drained":
            typer.echo(f"{done}; nothing left past the {human_duration(retention_ms)} retention; {log_note}")
        elif why == "max_batches":
            typer.echo(f"{done}; stopped at --max-batches with {remaining} row(s) past retention left; {log_note}")
        else:
            typer.echo(f"interrupted: {done}; {remaining} row(s) past retention left; {log_note}")
    if why == "interrupted":
        raise typer.Exit(EXIT_INTERRUPTED)


# -- purge ---------------------------------------------------------------------------------
@app.command(epilog="Example: idemctl purge order-42 --principal acct_A --yes")
def purge(
    ctx: typer.Context,
    key: Annotated[str, typer.Argument(metavar="KEY", help="The Idempotency-Key.", show_default=False)],
    principal: PrincipalOpt,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Also delete a fresh pending row (its owner may still be running).")] = False,
    db: DbOpt = None,
    ttl: TtlOpt = None,
) -> None:
    """Delete one reservation so that the client's next retry runs the mutation again."""
    _check_key(key)
    with _ledger(ctx, db, write=True, ttl=ttl) as ledger:
        view = ledger.get(principal, key)
        if view is None:
            _not_found(principal, key)
        typer.echo(f"{visible(principal)} / {key} (generation {view.row.generation}): {state_words(view)}")
        refusal = (
            f"refused: {visible(principal)}/{key} is pending and only {human_duration(view.age_ms)} old — its owner may still be "
            f"running, and purging would let a retry run the mutation twice; wait "
            f"{human_duration(view.takeover_in_ms or 0)} for the TTL, or pass --force"
        )
        if view.state is State.PENDING_FRESH and not force:
            _say_no(refusal)
            raise typer.Exit(EXIT_NO)
        if not yes:
            try:
                confirmed = typer.confirm(
                    f"Purge {visible(principal)}/{key}? The client's next retry will run the mutation again", err=True
                )
            except typer.Abort:
                typer.echo(err=True)  # end the prompt's line
                _say_no("not purged: no confirmation (pass --yes to skip the prompt)")
                raise typer.Exit(EXIT_NO) from None
            if not confirmed:
                if not sys.stdin.isatty():
                    typer.echo(err=True)  # a piped answer is not echoed: end the prompt's line
                _say_no("not purged")
                raise typer.Exit(EXIT_NO)
        result = ledger.purge(principal, key, force=force)
    if result.outcome is PurgeOutcome.PURGED and result.row is not None:
        typer.echo(
            f"purged {visible(principal)}/{key} ({result.row.status.value}, generation {result.row.generation}): "
            f"the client's next retry runs the mutation again"
        )
        return
    if result.outcome is PurgeOutcome.NOT_FOUND:
        _not_found(principal, key)
    _say_no(refusal)
    raise typer.Exit(EXIT_NO)


# -- fingerprint -----------------------------------------------------------------------------
def _read_body(body: str | None, body_file: str | None) -> bytes:
    if body is not None and body_file is not None:
        raise UserError("give --body or --body-file, not both")
    if body is not None:
        return body.encode("utf-8")
    if body_file is None:
        return b""
    if body_file == "-":
        return typer.get_binary_stream("stdin").read()
    try:
        return Path(body_file).read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read --body-file {body_file}: {exc.strerror or exc}") from None


def _parse_headers(values: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for value in values:
        name, sep, rest = value.partition(":")
        if not sep or not name.strip():
            raise UserError(f"--header {value!r} is not 'Name: value'")
        pairs.append((name.strip(), rest))
    return pairs


def _verdict(view: RowView | None, matches: bool | None) -> tuple[str, str]:
    if view is None:
        return "new", "no row for this key: this request would be claimed and run"
    if not matches:
        return "reused", "does NOT match the stored fingerprint: this request gets 409 idempotency_key_reused"
    row = view.row
    if row.status is Status.COMPLETED:
        return "replay", f"matches the stored fingerprint: this request is replayed ({visible(row.response_status)}, generation {row.generation})"
    if view.state is State.PENDING_FRESH:
        return (
            "in_progress",
            f"matches the stored fingerprint: this request gets 409 in progress for "
            f"{human_duration(view.takeover_in_ms or 0)} more, then takes over as generation {row.generation + 1}",
        )
    return "takeover", f"matches the stored fingerprint: this request takes over as generation {row.generation + 1}"


@app.command(
    name="fingerprint",
    epilog="Example: idemctl fingerprint -X POST --path /orders -H 'Content-Type: application/json' --body '{\"sku\":\"x\"}' --key order-42 -p acct_A",
)
def fingerprint_cmd(
    ctx: typer.Context,
    method: Annotated[str, typer.Option("--method", "-X", help="HTTP method.")],
    path: Annotated[str, typer.Option("--path", help="Path and query exactly as received, e.g. /orders?x=1.")],
    header: Annotated[list[str], typer.Option("--header", "-H", help="'Name: value'; repeat for several.")] = [],  # noqa: B006
    body_file: Annotated[Optional[str], typer.Option("--body-file", metavar="FILE|-", help="Raw body bytes from a file, or - for stdin.")] = None,
    body: Annotated[Optional[str], typer.Option("--body", help="Body as UTF-8 text (instead of --body-file).")] = None,
    key: Annotated[Optional[str], typer.Option("--key", "-k", help="Compare with this key's stored row.")] = None,
    principal: Annotated[Optional[str], typer.Option("--principal", "-p", help="Principal of --key.")] = None,
    json_out: JsonOpt = False,
    db: DbOpt = None,
    ttl: TtlOpt = None,
) -> None:
    """Print a request's fingerprint; with --key, whether it would replay or get 409 reused."""
    if (key is None) != (principal is None):
        raise UserError("--key and --principal go together")
    if key is not None:
        _check_key(key)
    raw = _read_body(body, body_file)
    pairs = _parse_headers(header)
    s = _settings(ctx)
    policy = _policy(s, ttl)
    fp = compute_fingerprint(method, path, pairs, raw, policy.fingerprint_headers)
    view: RowView | None = None
    matches: bool | None = None
    verdict: tuple[str, str] | None = None
    if key is not None and principal is not None:
        with _ledger(ctx, db, ttl=ttl) as ledger:
            view = ledger.get(principal, key)
        matches = None if view is None else view.row.fingerprint == fp
        verdict = _verdict(view, matches)
    if json_out:
        _emit_json(
            {
                "fingerprint": fp,
                "method": method.upper(),
                "path_and_query": path,
                "headers": header_values(pairs, policy.fingerprint_headers),
                "body_bytes": len(raw),
                "row": None if view is None else view_json(view),
                "matches": matches,
                "verdict": None if verdict is None else verdict[0],
            }
        )
    else:
        typer.echo(fp)
        if verdict is not None:
            typer.echo(verdict[1])
            if view is not None and not matches:
                typer.echo(f"stored: {visible(view.row.fingerprint)}")
    if verdict is not None and verdict[0] in ("new", "reused"):
        raise typer.Exit(EXIT_NO)


# -- simulate --------------------------------------------------------------------------------
_OUTCOME_STYLE = {
    "executed": "green",
    "taken_over": "yellow",
    "fenced_out": "red",
    "replayed": "cyan",
    "in_progress": "magenta",
    "reused": "magenta",
    "race_failed": "bold red",
    "error": "bold red",
}


def _clock(ms: int) -> str:
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    return f"+{hours}:{minutes:02d}:{rest / 1000:06.3f}"


def _step_words(e: Event, timeline: Timeline) -> str:
    step = timeline.scenario.steps[e.step - 1]
    if e.op in (Op.REQUEST, Op.RACE):
        return f"{step.method} {step.path}"
    if e.op in (Op.COMPLETE, Op.RELEASE) and e.generation is not None:
        return f"{e.op.value} gen {e.generation}"
    if e.op is Op.ADVANCE:
        return f"advance {human_duration(step.by_ms)}"
    if e.op is Op.SWEEP:
        return f"sweep ≤{step.batch or timeline.policy.sweep_batch}"
    if e.op is Op.FILL:
        return f"fill {step.count}"
    return e.op.value


def _row_words(e: Event) -> str:
    if not e.row_known:
        return ""
    if e.row is None:
        return "no row"
    return f"{e.row.status.value} · gen {e.row.generation}"


def _event_json(e: Event, start: int) -> dict[str, Any]:
    return {
        "step": e.step,
        "t_ms": e.at - start,
        "at": e.at,
        "actor": e.actor,
        "op": e.op.value,
        "principal": e.principal,
        "key": e.key,
        "outcome": e.outcome.value,
        "http_status": e.http_status,
        "generation": e.generation,
        "detail": e.detail,
        "row": None if e.row is None else {"status": e.row.status.value, "generation": e.row.generation},
        "deleted": e.deleted,
        "pid": e.pid,
        "expected": e.expected,
        "ok": e.ok,
        "logs": list(e.logs),
    }


def _render_timeline(timeline: Timeline) -> None:
    console = _console()
    sc = timeline.scenario
    where = timeline.database or "a temporary ledger (deleted afterwards)"
    console.print(Text(f"scenario {sc.name}", style="bold") + Text(f": {sc.description}" if sc.description else ""))
    console.print(
        Text(
            f"ledger {where}; TTL {human_duration(timeline.policy.pending_ttl_ms)}, retention "
            f"{human_duration(timeline.policy.retention_ms)}; virtual clock from {iso(timeline.start)}"
        )
    )
    if timeline.reset:
        console.print(Text("reset first (left by an earlier run): " + ", ".join(f"{p}/{k}" for p, k in timeline.reset)))
    # One fixed-width grid per event with its detail on the next line: a
    # six-column table would squeeze the detail into a sliver at 80 columns.
    widths = (13, 9, 15, 17, 17)

    def line(cells: list[Text]) -> Table:
        grid = Table.grid(padding=(0, 1))
        for w in widths:
            grid.add_column(width=w, overflow="fold")
        grid.add_row(*cells)
        return grid

    console.print(line([Text(h, style="bold") for h in ("t", "actor", "step", "outcome", "row after")]))
    logs: list[str] = []
    for e in timeline.events:
        outcome = Text(e.outcome.value, style=_OUTCOME_STYLE.get(e.outcome.value, ""))
        if e.http_status is not None and e.op in (Op.REQUEST, Op.RACE):
            outcome.append(f" {e.http_status}")
        console.print(line([Text(_clock(e.at - timeline.start)), Text(e.actor), Text(_step_words(e, timeline)), outcome, Text(_row_words(e))]))
        detail = Text(e.detail, style="dim")
        if not e.ok:
            detail.append(f" — expected {e.expected}" if e.expected else " — failed", style="bold red")
        console.print(Padding(detail, (0, 0, 0, widths[0] + 1)))
        logs.extend(f"{_clock(e.at - timeline.start)} {text}" for text in e.logs)
    for line in logs:
        console.print(Text("log " + line, style="dim"))


@app.command(
    epilog=(
        "Built-in scenarios: " + ", ".join(BUILTIN_NAMES) + ". A scenario file is TOML with [[step]] tables "
        "(see the README).\n\nExample: idemctl simulate takeover --db idempotency.db"
    ),
)
def simulate(
    ctx: typer.Context,
    scenario: Annotated[Optional[str], typer.Argument(metavar="SCENARIO", help="A built-in scenario: " + ", ".join(BUILTIN_NAMES) + ".", show_default=False)] = None,
    file: Annotated[Optional[Path], typer.Option("--file", "-f", help="Run an operator-written scenario.toml instead.", show_default=False)] = None,
    workers: Annotated[int, typer.Option("--workers", "-w", min=2, max=64, help="Processes for `race`.")] = 4,
    json_out: JsonOpt = False,
    db: Annotated[
        Optional[str],
        typer.Option("--db", metavar="PATH|URL", help="Write into this existing ledger (default: a temporary one; IDEMCTL_DB is ignored).", show_default=False),
    ] = None,
    ttl: TtlOpt = None,
    retention: RetentionOpt = None,
) -> None:
    """Replay claim/takeover/complete sequences on a virtual clock and print the timeline."""
    s = _settings(ctx)
    if scenario is not None and file is not None:
        raise UserError("give a scenario name or --file, not both")
    if _from_command_line(ctx, "workers") and scenario != "race":
        raise UserError("--workers only applies to `idemctl simulate race`")
    policy = _policy(s, ttl, retention)
    if file is not None:
        sc = load_scenario_file(file)
    elif scenario is not None:
        sc = builtin(scenario, policy, workers=workers)
    else:
        raise UserError(f"name a scenario ({', '.join(BUILTIN_NAMES)}) or give --file scenario.toml")
    # Only a ledger named on the command line receives simulated rows: a
    # production IDEMCTL_DB in the environment must never get them.
    target = db if db is not None else (s.db if s.db_on_command_line else None)
    timeline = run_scenario(sc, target, policy=policy)
    if json_out:
        _emit_json(
            {
                "scenario": sc.name,
                "description": sc.description,
                "database": timeline.database,
                "pending_ttl_ms": timeline.policy.pending_ttl_ms,
                "retention_ms": timeline.policy.retention_ms,
                "start": timeline.start,
                "end": timeline.end,
                "reset": [{"principal": p, "key": k} for p, k in timeline.reset],
                "ok": timeline.ok,
                "events": [_event_json(e, timeline.start) for e in timeline.events],
            }
        )
    else:
        _render_timeline(timeline)
        if timeline.ok:
            inspected = [e for e in timeline.events if e.op is Op.INSPECT]
            hint = ""
            if timeline.database and inspected:
                last = inspected[-1]
                # A URL is not echoed back: it may carry a password.
                where = "<the same URL>" if target is not None and "://" in target else timeline.database
                hint = f"; see it with: idemctl inspect {last.key} --principal {last.principal} --db {where}"
            typer.echo(f"every step went as expected{hint}")
    failures = timeline.failures()
    if failures:
        first = failures[0]
        what = f"expected {first.expected}, got {first.outcome.value}" if first.expected else first.detail
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        _say_no(f"simulation {sc.name}: step {first.step} ({first.actor} {first.op.value}) {what}{more}")
        raise typer.Exit(EXIT_NO)


def main() -> None:
    """Console-script entry point (`idemctl`)."""
    app(prog_name="idemctl")
