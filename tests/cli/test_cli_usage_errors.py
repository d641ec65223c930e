"""Usage errors are user errors too: one line on stderr, exit 2, no box, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from idemctl.cli import app

IDEMCTL = os.path.join(os.path.dirname(sys.executable), "idemctl")


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["inspect"], "error: Missing argument 'KEY'. (see 'idemctl inspect --help')"),
        (["inspect", "k"], "error: Missing option '--principal' / '-p'. (see 'idemctl inspect --help')"),
        (["bogus"], "error: No such command 'bogus'. (see 'idemctl --help')"),
        (["--db"], "error: Option '--db' requires an argument. (see 'idemctl --help')"),
        (
            ["sweep", "--batch-size", "abc"],
            "error: Invalid value for '--batch-size': Input should be a valid integer, unable to parse string as an "
            "integer (see 'idemctl sweep --help')",
        ),
    ],
)
def test_usage_error_is_one_line_on_stderr_with_exit_2(argv, line):
    result = CliRunner().invoke(app, argv, prog_name="idemctl")
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [line]


def test_installed_script_prints_usage_errors_as_one_line(tmp_path):
    done = subprocess.run([IDEMCTL, "purge"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == "error: Missing argument 'KEY'. (see 'idemctl purge --help')\n"


def test_bare_idemctl_prints_the_help_on_stdout_and_exits_0(tmp_path):
    done = subprocess.run([IDEMCTL], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0
    assert "Usage: idemctl" in done.stdout
    assert done.stderr == ""


def test_help_and_version_exit_0(tmp_path):
    assert subprocess.run([IDEMCTL, "--version"], capture_output=True, text=True).returncode == 0
    env = {**os.environ, "COLUMNS": "200"}
    helped = subprocess.run([IDEMCTL, "stats", "--help"], capture_output=True, text=True, env=env)
    assert helped.returncode == 0 and "Example (cron): idemctl stats --max-expired" in helped.stdout
