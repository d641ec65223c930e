"""The `idemctl` application: the Typer app every command registers on, its
global options, the settings a command works with, how a command opens the
ledger, and the mapping of every deliberate error to one line on stderr and
an exit code. The options the commands share are declared in `options`."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, NoReturn, Protocol, cast

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup

from .. import __version__, config
from ..durations import human_duration
from ..errors import (
    IdemctlError,
)
from ..ledger import Ledger, Operator
from ..outcomes import RowView
from ..policy import Policy
from ..storage import accepted_urls
from .documents import inspect_not_found_json
from .hints import (
    ARGS_IN_FORCE,
    LEDGER_IN_FORCE,
    with_hint,
)
from .options import Given, app_policy_option, env_help, given_option
from .output import emit_json, say_error, say_no

# Exit codes: part of the interface, documented in `idemctl --help` and docs/cli.md.
EXIT_OK = 0
EXIT_NO = 1  # the answer is "no": not found, refused, declined, mismatch, check or expectation failed
EXIT_USAGE = 2  # usage or database problem: bad option or key, no/unreadable/too-new ledger, locked, read-only
EXIT_INTERRUPTED = 130  # Ctrl-C, in every command (sweep reports what it deleted first)
EXIT_PIPE_CLOSED = 141  # stdout's reader went away (`idemctl pending | head -1`): 128 + SIGPIPE, as shells report

EXIT_CODES_HELP = (
    "[b]Exit codes[/b]: 0 done · 1 the answer is no (row not found, purge refused or declined, "
    "fingerprint differs, a stats threshold or a simulation expectation failed, doctor found a warning, "
    "copy found conflicting keys) · "
    "2 usage or database problem (bad option or key, no ledger, not a database, schema missing or newer, "
    "database locked or read-only, bad scenario) · 130 interrupted (Ctrl-C) · "
    "141 the reader of stdout went away (a closed pipe)."
)
# Human output's one escaping scheme (escaping.visible); documented next to the exit codes.
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


# Typer may run on its own vendored copy of click, so the base class of its
# usage errors is taken from the one it exports rather than imported from click.
_CLICK_EXCEPTION: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


class _ClickError(Protocol):
    """What is used here of a _CLICK_EXCEPTION."""

    exit_code: int

    def show(self) -> None: ...

    def format_message(self) -> str: ...


# (ctx: Any below: Typer's context class lives in its private copy of click.)
class _NamedArgument(TyperArgument):
    """An argument whose metavar already names it (KEY): Typer would print
    its Python type (<str>) beside it in the help."""

    def display_type_rich(self, ctx: Any) -> str | None:
        return None


def _plain_help_option(option: Any) -> Any:
    # A flag takes no value: no metavar (Typer would show <bool>).
    if option is not None:
        option.metavar = ""
    return option


class IdemctlCommand(TyperCommand):
    """Every command's class: its help shows real metavars (KEY, N,
    DURATION) and none for flags."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if type(param) is TyperArgument:
                param.__class__ = _NamedArgument

    def get_help_option(self, ctx: Any) -> Any:
        return _plain_help_option(super().get_help_option(ctx))

    def format_help(self, ctx: Any, formatter: Any) -> None:
        _help_into_a_pipe(lambda: _help_that_fits(self, super(IdemctlCommand, self).format_help, ctx, formatter))


class IdemctlGroup(TyperGroup):
    """Maps every deliberate error to one stderr line and an exit code, for
    every command at once, so no command can forget to."""

    def get_params(self, ctx: Any) -> Any:
        params = super().get_params(ctx)
        for param in params:
            if param.name in ("install_completion", "show_completion"):
                # Flags (the shell is detected): Typer would show <bool>.
                param.metavar = ""
        return params

    def get_help_option(self, ctx: Any) -> Any:
        return _plain_help_option(super().get_help_option(ctx))

    def format_help(self, ctx: Any, formatter: Any) -> None:
        _help_into_a_pipe(lambda: _help_that_fits(self, super(IdemctlGroup, self).format_help, ctx, formatter))

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        token = LEDGER_IN_FORCE.set(None)
        words = ARGS_IN_FORCE.set(tuple(sys.argv[1:] if args is None else args))
        try:
            rv = super().main(args, prog_name, complete_var, False, windows_expand_args, **extra)
        except IdemctlError as exc:
            in_force = LEDGER_IN_FORCE.get()
            return _fail(with_hint(exc, *in_force) if in_force else with_hint(exc), EXIT_USAGE, standalone_mode)
        except UserError as exc:
            return _fail(exc, exc.code, standalone_mode)
        except PipeClosed:
            if not standalone_mode:
                raise
            _quiet_stdout()
            sys.exit(EXIT_PIPE_CLOSED)
        except Interrupted:
            if not standalone_mode:
                raise
            sys.exit(EXIT_INTERRUPTED)
        except _CLICK_EXCEPTION as exc:
            if not standalone_mode:
                raise
            usage = cast(_ClickError, exc)
            # Usage errors too are one line on stderr (Typer would draw a box
            # of several); the hint says where the full usage is.
            if type(exc).__name__ == "NoArgsIsHelpError":  # bare `idemctl`: the help is the answer, on stdout
                # Typer's rich help is already printed (its message is then empty).
                if usage.format_message():
                    typer.echo(usage.format_message())
                sys.exit(EXIT_OK)
            ctx = getattr(exc, "ctx", None)
            where = ctx.command_path if ctx is not None else "idemctl"
            say_error(f"{usage.format_message()} (see '{where} --help')")
            sys.exit(usage.exit_code)
        except typer.Abort as exc:
            if not standalone_mode:
                raise
            if isinstance(exc.__cause__ or exc.__context__, KeyboardInterrupt):  # Ctrl-C at a prompt or parsing
                sys.exit(EXIT_INTERRUPTED)
            say_error("aborted")
            sys.exit(EXIT_NO)
        finally:
            LEDGER_IN_FORCE.reset(token)
            ARGS_IN_FORCE.reset(words)
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else EXIT_OK)

    def invoke(self, ctx: Any) -> Any:
        # Click turns a closed pipe into exit 1 ("no") and Ctrl-C into an
        # Abort with a blank line; both are caught first and told apart here.
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise Interrupted() from None
        except OSError as exc:
            if exc.errno != errno.EPIPE:
                raise
            raise PipeClosed() from None


# Below this width rich's help boxes cut option names and metavars short
# ("--prin…", "PRINCIP/AL"): click's plain layout is used instead, which
# puts a long option's help under it.
RICH_HELP_MIN_COLUMNS = 80


def _help_that_fits(command: Any, show: Callable[[Any, Any], None], ctx: Any, formatter: Any) -> None:
    columns = shutil.get_terminal_size().columns
    if columns >= RICH_HELP_MIN_COLUMNS:
        show(ctx, formatter)
        return
    formatter.width = max(columns - 2, 20)  # click's own layout never goes below 50 by itself
    mode, command.rich_markup_mode = command.rich_markup_mode, None
    try:
        show(ctx, formatter)
    finally:
        command.rich_markup_mode = mode
    # Written for rich, the help escapes its brackets ("\\[env var: …]").
    formatter.buffer[:] = [part.replace("\\[", "[") for part in formatter.buffer]


def _help_into_a_pipe(show: Callable[[], None]) -> None:
    # Typer prints the help with a console of its own, which exits 1 on a
    # closed pipe (`idemctl --help | head -1`); that exit is the closed pipe.
    try:
        show()
    except SystemExit as exc:
        if exc.code == 1:
            raise PipeClosed() from None
        raise


class PipeClosed(Exception):
    """stdout's reader went away: nothing more to say, to anyone."""


class Interrupted(Exception):
    """Ctrl-C: the command stops where it is and exits 130."""


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of
    what is still buffered does not fail with a second broken pipe."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _fail(message: object, code: int, standalone_mode: bool) -> int:
    say_error(message)
    if standalone_mode:
        sys.exit(code)
    return code  # as click returns the code of an Exit outside standalone mode


app = typer.Typer(
    name="idemctl",
    cls=IdemctlGroup,
    help=(
        f"Inspect, sweep and repair an Idempotency-Key ledger (a file, or {accepted_urls()}).\n\n"
        "Example: idemctl inspect order-42 --principal acct_A --db idempotency.db"
    ),
    epilog=EXIT_CODES_HELP + "\n\n" + ESCAPING_HELP,
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def main() -> None:
    """Console-script entry point (`idemctl`)."""
    try:
        if os.environ.get("NO_COLOR"):
            _no_styles()
        app(prog_name="idemctl")
    except KeyboardInterrupt:  # Ctrl-C before a command runs (Typer still building the app)
        sys.exit(EXIT_INTERRUPTED)


def _no_styles() -> None:
    """NO_COLOR: no colour and no bold, underline or dim either, in the help
    too (rich alone would keep the bold)."""
    import typer.rich_utils

    typer.rich_utils.COLOR_SYSTEM = None


@dataclass(frozen=True)
class GlobalOptions:
    """The global options as given on the command line (None: not given)."""

    db: str | None = None
    ttl: Given | None = None
    retention: Given | None = None
    busy_timeout: Given | None = None


@dataclass(frozen=True)
class CommandSettings:
    """What a command works with: its own options, else the global ones,
    else the environment (read by `idemctl.config`), else the defaults."""

    db: str
    db_on_command_line: bool
    ttl: Given | None
    retention: Given | None
    fenced_retention: Given | None
    busy_timeout_ms: int


def _version(value: bool) -> None:
    if value:
        typer.echo(f"idemctl {__version__}")
        raise typer.Exit()


@app.callback()
def _global(
    ctx: typer.Context,
    db: Annotated[
        str | None,
        typer.Option(
            "--db",
            metavar="PATH|URL",
            help=f"Ledger: a file, {accepted_urls()}, or a libpq connection string (host=… dbname=…)."
            + env_help(config.ENV_DB, config.DEFAULT_DB),
            show_default=False,
        ),
    ] = None,
    ttl: Annotated[Given | None, app_policy_option("--ttl", "Pending TTL", "30 s", config.ENV_PENDING_TTL)] = None,
    retention: Annotated[
        Given | None, app_policy_option("--retention", "Retention", "24 h", config.ENV_RETENTION)
    ] = None,
    busy_timeout: Annotated[
        Given | None,
        given_option(
            "--busy-timeout",
            help="How long to wait for a locked database before giving up.",
            env=config.ENV_BUSY_TIMEOUT,
            env_default=human_duration(config.DEFAULT_BUSY_TIMEOUT_MS).replace(" ", ""),
        ),
    ] = None,
    version: Annotated[
        bool,
        typer.Option(
            "--version", "-V", metavar="", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    # Only what the command line says: the environment is read when a
    # command needs its settings, so that `--help` works whatever it holds.
    ctx.obj = GlobalOptions(db, ttl, retention, busy_timeout)
    _quiet_driver_logs()


def _quiet_driver_logs() -> None:
    """The database drivers' own log lines (psycopg_pool's "discarding
    closed connection: <… at 0x…>") are not for an operator: the command's
    error says what went wrong, in one line. With a handler of their own,
    logging's last resort (WARNING and up on stderr) stays quiet for them."""
    driver = logging.getLogger("psycopg")
    if not driver.handlers:
        driver.addHandler(logging.NullHandler())


def _db(value: str | None) -> str | None:
    if value is not None and not value.strip():
        raise UserError(f"--db is empty: give a ledger file path, {accepted_urls()}")
    return value


def _named(value: Given | None, option: str) -> Given | None:
    return None if value is None else Given(value.ms, value.text, option)


def _from_env(value: int | None, name: str, environ: Mapping[str, str]) -> Given | None:
    return None if value is None else Given(value, environ[name].strip(), name)


def settings(
    ctx: typer.Context,
    *,
    db: str | None = None,
    ttl: Given | None = None,
    retention: Given | None = None,
    fenced_retention: Given | None = None,
) -> CommandSettings:
    """The settings of a command, given its own options: each is taken from
    the command's option, else the global one, else its environment variable
    (through `idemctl.config`, as applications read them), else the default.
    A variable whose option was given is not read at all, so an option can
    stand in for a variable that cannot be used."""
    g = ctx.find_object(GlobalOptions) or GlobalOptions()
    db = _db(db) or _db(g.db)
    ttl = _named(ttl, "--ttl") or _named(g.ttl, "--ttl")
    retention = _named(retention, "--retention") or _named(g.retention, "--retention")
    fenced_retention = _named(fenced_retention, "--fenced-retention")
    busy = _named(g.busy_timeout, "--busy-timeout")
    overridden = {
        name
        for name, value in (
            (config.ENV_DB, db),
            (config.ENV_PENDING_TTL, ttl),
            (config.ENV_RETENTION, retention),
            (config.ENV_FENCED_RETENTION, fenced_retention),
            (config.ENV_BUSY_TIMEOUT, busy),
        )
        if value is not None
    }
    environ = {k: v for k, v in os.environ.items() if k not in overridden and config.RETIRED.get(k) not in overridden}
    env = config.Settings.from_env(environ)
    given = db is not None or bool(environ.get(config.ENV_DB, "").strip())
    LEDGER_IN_FORCE.set((db or env.db, given))
    return CommandSettings(
        db=db or env.db,
        db_on_command_line=g.db is not None,
        ttl=ttl or _from_env(env.pending_ttl_ms, config.ENV_PENDING_TTL, environ),
        retention=retention or _from_env(env.retention_ms, config.ENV_RETENTION, environ),
        fenced_retention=fenced_retention or _from_env(env.fenced_retention_ms, config.ENV_FENCED_RETENTION, environ),
        busy_timeout_ms=env.busy_timeout_ms if busy is None else busy.ms,
    )


_DEFAULT_POLICY = Policy()


def command_policy(s: CommandSettings) -> Policy:
    """The Policy a command works under, its durations checked first so that
    a mistake is told in the CLI's words (`--ttl`, `IDEMCTL_RETENTION`, with
    units) rather than in the Policy's field names."""
    for value in (s.ttl, s.fenced_retention):
        if value is not None and value.ms <= 0:
            raise UserError(f"{value.source} must be longer than 0 s, got {value.text}")
    ttl = s.ttl or Given(_DEFAULT_POLICY.pending_ttl_ms, "", "--ttl")
    retention = s.retention or Given(_DEFAULT_POLICY.retention_ms, "", "--retention")
    if retention.ms <= ttl.ms:
        long, short = human_duration(retention.ms), human_duration(ttl.ms)
        if long == short and retention.ms != ttl.ms:  # 30 s against 30.4 s: the readings must differ too
            long, short = f"{retention.ms} ms", f"{ttl.ms} ms"
        raise UserError(f"{retention.source} ({long}) must be longer than {ttl.source} ({short})")
    fenced = _DEFAULT_POLICY.fenced_retention_ms if s.fenced_retention is None else s.fenced_retention.ms
    return Policy(pending_ttl_ms=ttl.ms, retention_ms=retention.ms, fenced_retention_ms=fenced)


@contextmanager
def open_ledger(
    ctx: typer.Context,
    db: str | None,
    *,
    write: bool = False,
    ttl: Given | None = None,
    retention: Given | None = None,
    fenced_retention: Given | None = None,
) -> Iterator[Operator]:
    """Open an existing ledger for an operator's command (its
    `Ledger.operator`, closed with it); never creates one (only `init` does)."""
    s = settings(ctx, db=db, ttl=ttl, retention=retention, fenced_retention=fenced_retention)
    policy = command_policy(s)
    with Ledger.open(
        s.db, policy=policy, create=False, readonly=not write, busy_timeout_ms=s.busy_timeout_ms
    ) as ledger:
        ledger.require_schema()
        yield ledger.operator


def list_cap(limit: int) -> int | None:
    """How many items a --limit option lets through: 0 means all (None)."""
    return None if limit == 0 else limit


def not_found(principal: str, key: str) -> NoReturn:
    say_no(f"no row for principal {principal!r} key {key!r}: the next request with this key runs the mutation")
    raise typer.Exit(EXIT_NO)


def existing_row(ledger: Operator, principal: str, key: str, *, json_out: bool = False) -> RowView:
    """The row of `principal`/`key`; without one, exit 1 saying so (with
    `json_out`, after a not-found document on stdout: scripts read an answer)."""
    view = ledger.get(principal, key)
    if view is None:
        if json_out:
            emit_json(inspect_not_found_json(principal, key))
        not_found(principal, key)
    return view
