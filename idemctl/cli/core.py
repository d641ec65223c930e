"""The `idemctl` application: the Typer app every command registers on, the
options and settings the commands share, how a command opens the ledger, and
the mapping of every deliberate error to one line on stderr and an exit code."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, NoReturn, Protocol, TypedDict, cast

import typer
from typer.core import TyperGroup

from .. import __version__
from ..durations import parse_duration
from ..errors import IdemctlError, SchemaMissingError, SchemaOutdatedError
from ..ledger import Ledger
from ..policy import Policy
from .output import say_error, say_no

# Exit codes: part of the interface, documented in `idemctl --help` and the README.
EXIT_OK = 0
EXIT_NO = 1  # the answer is "no": not found, refused, declined, mismatch, check or expectation failed
EXIT_USAGE = 2  # usage or database problem: bad option or key, no/unreadable/too-new ledger, locked, read-only
EXIT_INTERRUPTED = 130  # Ctrl-C (sweep reports what it deleted first)

DEFAULT_DB = "idempotency.db"
DEFAULT_BUSY_TIMEOUT_MS = 5000

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


def with_hint(exc: IdemctlError) -> str:
    """The library's message plus what to type about it, in the CLI's words.

    >>> with_hint(SchemaMissingError("ledger.db"))
    'ledger.db has no idempotency ledger — run `idemctl init`'
    """
    if isinstance(exc, SchemaOutdatedError):
        return f"{exc} — run `idemctl init` to upgrade it"
    if isinstance(exc, SchemaMissingError):
        return f"{exc} — run `idemctl init`"
    return str(exc)


# Typer may run on its own vendored copy of click, so the base class of its
# usage errors is taken from the one it exports rather than imported from click.
_CLICK_EXCEPTION: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


class _ClickError(Protocol):
    """What is used here of a _CLICK_EXCEPTION."""

    exit_code: int

    def show(self) -> None: ...

    def format_message(self) -> str: ...


class IdemctlGroup(TyperGroup):
    """Maps every deliberate error to one stderr line and an exit code, for
    every command at once, so no command can forget to."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        try:
            rv = super().main(args, prog_name, complete_var, False, windows_expand_args, **extra)
        except IdemctlError as exc:
            return _fail(with_hint(exc), EXIT_USAGE, standalone_mode)
        except UserError as exc:
            return _fail(exc, exc.code, standalone_mode)
        except _CLICK_EXCEPTION as exc:
            if not standalone_mode:
                raise
            usage = cast(_ClickError, exc)
            # Usage errors too are one line on stderr (Typer would draw a box
            # of several); the hint says where the full usage is.
            if type(exc).__name__ == "NoArgsIsHelpError":  # bare `idemctl`: the help is the answer
                usage.show()
            else:
                ctx = getattr(exc, "ctx", None)
                where = ctx.command_path if ctx is not None else "idemctl"
                say_error(f"{usage.format_message()} (see '{where} --help')")
            sys.exit(usage.exit_code)
        except typer.Abort:
            if not standalone_mode:
                raise
            say_error("aborted")
            sys.exit(EXIT_NO)
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else EXIT_OK)


def _fail(message: object, code: int, standalone_mode: bool) -> int:
    say_error(message)
    if standalone_mode:
        sys.exit(code)
    return code  # as click returns the code of an Exit outside standalone mode


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


def main() -> None:
    """Console-script entry point (`idemctl`)."""
    app(prog_name="idemctl")


# -- options shared by commands -----------------------------------------------------------
def duration_param(value: str) -> int:
    """Typer parser of a DURATION option; its ValueError becomes a usage error."""
    return parse_duration(value)


@dataclass(frozen=True)
class Settings:
    """The global options, as every command sees them."""

    db: str
    db_on_command_line: bool
    ttl_ms: int | None
    retention_ms: int | None
    busy_timeout_ms: int


DbOpt = Annotated[
    str | None,
    typer.Option("--db", metavar="PATH|URL", help="Ledger to use; overrides the global --db.", show_default=False),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="One JSON document on stdout (stable field names), nothing else.")
]
TtlOpt = Annotated[
    int | None,
    typer.Option(
        "--ttl",
        metavar="DURATION",
        parser=duration_param,
        help="Pending TTL (e.g. 30s); overrides the global --ttl.",
        show_default=False,
    ),
]
RetentionOpt = Annotated[
    int | None,
    typer.Option(
        "--retention",
        metavar="DURATION",
        parser=duration_param,
        help="Retention (e.g. 24h); overrides the global --retention.",
        show_default=False,
    ),
]
PrincipalOpt = Annotated[str, typer.Option("--principal", "-p", help="The principal (account) the key belongs to.")]
KeyArg = Annotated[str, typer.Argument(metavar="KEY", help="The Idempotency-Key.", show_default=False)]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"idemctl {__version__}")
        raise typer.Exit()


@app.callback()
def _global(
    ctx: typer.Context,
    db: Annotated[
        str,
        typer.Option(
            "--db", envvar="IDEMCTL_DB", metavar="PATH|URL", help="Ledger: a SQLite file or a postgresql:// URL."
        ),
    ] = DEFAULT_DB,
    ttl: Annotated[
        int | None,
        typer.Option(
            "--ttl",
            envvar="IDEMCTL_PENDING_TTL",
            metavar="DURATION",
            parser=duration_param,
            help="Pending TTL the application uses, e.g. 30s (default: the Policy's 30 s).",
            show_default=False,
        ),
    ] = None,
    retention: Annotated[
        int | None,
        typer.Option(
            "--retention",
            envvar="IDEMCTL_RETENTION",
            metavar="DURATION",
            parser=duration_param,
            help="Retention the application uses, e.g. 24h (default: the Policy's 24 h).",
            show_default=False,
        ),
    ] = None,
    # Declared the older way: the default is the text "5s", which the parser
    # turns into the int the function receives (help shows "default: 5s").
    busy_timeout: int = typer.Option(
        "5s",
        "--busy-timeout",
        envvar="IDEMCTL_BUSY_TIMEOUT",
        metavar="DURATION",
        parser=duration_param,
        help="How long to wait for a locked database before giving up.",
    ),
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    ctx.obj = Settings(
        db=db,
        db_on_command_line=from_command_line(ctx, "db"),
        ttl_ms=ttl,
        retention_ms=retention,
        busy_timeout_ms=busy_timeout,
    )


def from_command_line(ctx: typer.Context, name: str) -> bool:
    """Whether the parameter `name` was given on the command line (not by an
    environment variable or its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def settings(ctx: typer.Context) -> Settings:
    obj = ctx.find_object(Settings)
    if obj is None:  # a command invoked without the group (never from the console script)
        return Settings(DEFAULT_DB, False, None, None, DEFAULT_BUSY_TIMEOUT_MS)
    return obj


class _PolicyKnobs(TypedDict, total=False):
    pending_ttl_ms: int
    retention_ms: int
    fenced_retention_ms: int


def command_policy(
    s: Settings, ttl: int | None = None, retention: int | None = None, fenced_retention: int | None = None
) -> Policy:
    """The Policy a command works under: its own options, else the global
    ones, else the Policy's defaults."""
    knobs: _PolicyKnobs = {}
    ttl = ttl if ttl is not None else s.ttl_ms
    retention = retention if retention is not None else s.retention_ms
    if ttl is not None:
        knobs["pending_ttl_ms"] = ttl
    if retention is not None:
        knobs["retention_ms"] = retention
    if fenced_retention is not None:
        knobs["fenced_retention_ms"] = fenced_retention
    return Policy(**knobs)


@contextmanager
def open_ledger(
    ctx: typer.Context,
    db: str | None,
    *,
    write: bool = False,
    ttl: int | None = None,
    retention: int | None = None,
    fenced_retention: int | None = None,
) -> Iterator[Ledger]:
    """Open an existing ledger; never creates one (only `init` does)."""
    s = settings(ctx)
    policy = command_policy(s, ttl, retention, fenced_retention)
    with Ledger.open(
        db or s.db, policy=policy, create=False, readonly=not write, busy_timeout_ms=s.busy_timeout_ms
    ) as ledger:
        ledger.require_schema()
        yield ledger


def list_cap(limit: int) -> int | None:
    """How many items a --limit option lets through: 0 means all (None)."""
    return None if limit == 0 else limit


def not_found(principal: str, key: str) -> NoReturn:
    say_no(f"no row for principal {principal!r} key {key!r}: the next request with this key runs the mutation")
    raise typer.Exit(EXIT_NO)
