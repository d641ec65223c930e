"""`idemctl --help` pages say what to type: every option that takes a value
names it (KEY, N, DURATION), flags show none, and no text is eaten as rich
markup. Read from the installed command, as an operator sees it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer

from idemctl.cli import app

IDEMCTL = Path(sys.executable).with_name("idemctl")
COMMANDS = ["init", "inspect", "pending", "fenced", "stats", "sweep", "purge", "fingerprint", "simulate", "monitoring"]
FLAGS = {
    "--json",
    "--nl",
    "--dry-run",
    "--yes",
    "--force",
    "--stale",
    "--help",
    "--version",
    "--watch",
    "--json-body",
    "--where",
    "--install-completion",
    "--show-completion",
}


def help_page(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    done = subprocess.run(
        [str(IDEMCTL), *args, "--help"], capture_output=True, text=True, env={**env, "COLUMNS": "200"}, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.slow
def test_simulate_help_shows_the_step_tables_of_a_scenario_file():
    page = help_page("simulate")
    assert "A scenario file is TOML with [[step]] tables (see docs/cli.md)." in page


@pytest.mark.slow
@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_no_help_page_shows_a_python_type_or_a_range_for_a_metavar(command):
    page = help_page(*([command] if command else []))
    assert not re.search(r"<(bool|str|int|path|list\[str\]|int range)>", page), page
    assert not re.search(r"\[\d*<?=?x[<>]=?\d*\]", page), page


def all_params() -> list[tuple[str, Any]]:
    """Every parameter of every command, the help option included."""
    group = typer.main.get_command(app)
    ctx = typer.Context(group)
    found = [("idemctl", p) for p in group.get_params(ctx)]
    for name in COMMANDS:
        command = group.get_command(ctx, name)  # type: ignore[attr-defined]
        found += [(name, p) for p in command.get_params(ctx)]
    return found


def test_every_option_names_its_value_and_flags_show_none():
    for where, param in all_params():
        name = max(param.opts, key=len)
        if name in FLAGS:
            assert param.metavar == "", (where, name, param.metavar)
        else:
            assert param.metavar and re.fullmatch(r"'?[A-Z][A-Z|'\-: ]*", param.metavar), (where, name, param.metavar)


def test_the_metavars_are_the_documented_words():
    metavars = {(where, max(p.opts, key=len)): p.metavar for where, p in all_params() if p.metavar}
    assert metavars[("inspect", "key")] == "KEY"
    assert metavars[("inspect", "--principal")] == "PRINCIPAL"
    assert metavars[("pending", "--limit")] == "N"
    assert metavars[("fenced", "--since")] == "DURATION"
    assert metavars[("idemctl", "--busy-timeout")] == "DURATION"
    assert metavars[("fingerprint", "--header")] == "'NAME: VALUE'"
    assert metavars[("simulate", "--file")] == "FILE"
    assert metavars[("simulate", "scenario")] == "SCENARIO"


def test_the_help_for_a_ledger_names_every_kind_the_storage_registers():
    from idemctl.storage.registry import kinds

    schemes = [k.locations.schemes[0] for k in kinds() if k.capabilities.server and k.locations.schemes]
    assert {"postgresql", "mysql", "d1", "redis"} <= set(schemes)
    pages = {"idemctl": help_page(), "copy": help_page("copy")}
    for name, page in pages.items():
        flat = " ".join(page.split())  # the help wraps at any space
        for scheme in schemes:
            assert f"a {scheme}://" in flat, (name, scheme)
