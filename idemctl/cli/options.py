"""The options commands share, and how an option is declared: its metavar
(KEY, N, DURATION, none for a flag), its bounds and its parser, so that every
command's help and every bad value read the same."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, cast

import typer

from ..durations import parse_duration


def in_range(low: int, high: int | None = None) -> Callable[..., int | None]:
    """The callback of an integer option that checks its bounds. (Given as
    min=/max=, the bounds would show in the help as "N [x>=0]"; the help
    text says them instead.)"""

    def check(ctx: typer.Context, param: typer.CallbackParam, value: int | None) -> int | None:
        # The parameter is Typer's own option object, which BadParameter names in its message.
        option = cast(Any, param)
        if value is not None and value < low:
            raise typer.BadParameter(f"must be {low} or more, got {value}", ctx=ctx, param=option)
        if value is not None and high is not None and value > high:
            raise typer.BadParameter(f"must be {high} or less, got {value}", ctx=ctx, param=option)
        return value

    return check


def duration_param(value: str) -> int:
    """Typer parser of a DURATION option: its problem is told in our words
    (a ValueError would reach the operator as "Value error, …")."""
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


@dataclass(frozen=True)
class Given:
    """A duration setting as the operator gave it: milliseconds, the text
    as written and where (an option or an environment variable), so that a
    message can speak of it in the operator's own words."""

    ms: int
    text: str
    source: str


def given_param(value: str) -> Given:
    """Typer parser of a DURATION option that sets the policy or the busy
    timeout; the option's name is filled in by `settings`."""
    return Given(duration_param(value), value.strip(), "")


def env_help(name: str, default: str | None = None) -> str:
    # Written into the help by hand: the environment is read by idemctl.config,
    # not by Typer (whose envvar= would bypass its checks). Escaped: rich markup
    # would take the brackets for a tag; each a paragraph: Typer starts a new
    # line only there.
    return f"\n\n\\[env var: {name}]" + (f"\n\n\\[default: {default}]" if default else "")


def flag(*names: str, help: str) -> Any:
    """A flag's option: it takes no value, so it shows no metavar (Typer would show <bool>)."""
    return typer.Option(*names, metavar="", help=help)


# The largest count any option takes. Without a bound a huge N went on to the
# database (a query asks for N + 1 rows) and came back as an engine's error
# (an overflow, a syntax error) instead of a usage error; a billion is more
# rows than a terminal or a threshold needs and fits every engine's integers.
MAX_COUNT = 1_000_000_000


def count_option(*names: str, help: str | None, low: int = 0, high: int = MAX_COUNT, **extra: Any) -> Any:
    """An integer option N with its bounds checked by `in_range`."""
    return typer.Option(*names, metavar="N", callback=in_range(low, high), help=help, **extra)


def duration_option(*names: str, help: str, **extra: Any) -> Any:
    """A DURATION option read as milliseconds."""
    return typer.Option(*names, metavar="DURATION", parser=duration_param, help=help, show_default=False, **extra)


def given_option(*names: str, help: str, env: str | None = None, env_default: str | None = None) -> Any:
    """A DURATION option that sets the policy or the busy timeout, read as a
    `Given`; its help names the environment variable `env` that stands in for it."""
    if env is not None:
        help += env_help(env, env_default)
    return typer.Option(*names, metavar="DURATION", parser=given_param, help=help, show_default=False)


def app_policy_option(name: str, setting: str, policy_default: str, env: str) -> Any:
    """A global option for one of the application's Policy settings (a
    DURATION), whose help gives `policy_default` ("30 s") as its example
    and its default, and names the environment variable `env`."""
    example = policy_default.replace(" ", "")
    help = f"{setting} the application uses, e.g. {example} (default: the Policy's {policy_default})."
    return given_option(name, help=help, env=env)


def from_command_line(ctx: typer.Context, name: str) -> bool:
    """Whether the parameter `name` was given on the command line (not by its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


DbOpt = Annotated[
    str | None,
    typer.Option("--db", metavar="PATH|URL", help="Ledger to use; overrides the global --db.", show_default=False),
]
JsonOpt = Annotated[bool, flag("--json", help="One JSON document on stdout (stable field names), nothing else.")]
NlOpt = Annotated[
    bool,
    flag(
        "--nl", help="Newline-delimited JSON: one object per line (the --json item), streamed; nothing else on stdout."
    ),
]
TtlOpt = Annotated[Given | None, given_option("--ttl", help="Pending TTL (e.g. 30s); overrides the global --ttl.")]
RetentionOpt = Annotated[
    Given | None, given_option("--retention", help="Retention (e.g. 24h); overrides the global --retention.")
]
OnlyPrincipalOpt = Annotated[
    str | None, typer.Option("--principal", "-p", metavar="PRINCIPAL", help="Only this principal.")
]
PrincipalOpt = Annotated[
    str, typer.Option("--principal", "-p", metavar="PRINCIPAL", help="The principal (account) the key belongs to.")
]
KeyArg = Annotated[str, typer.Argument(metavar="KEY", help="The Idempotency-Key.", show_default=False)]


def complete_from(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """A shell completion of an option or argument: the `choices` that
    begin with what has been typed.

    >>> complete_from(["text", "json"])("j")
    ['json']
    """

    def complete(incomplete: str) -> list[str]:
        return [c for c in choices if c.startswith(incomplete)]

    return complete
