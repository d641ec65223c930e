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


# Each count option with a value past every engine's integers (and the largest
# 64-bit integer, which a query asking for N + 1 rows overflows).
HUGE_COUNTS = [
    ["pending", "--limit", "99999999999999999999"],
    ["pending", "--limit", "9223372036854775807"],
    ["fenced", "--limit", "99999999999999999999"],
    ["fenced", "-n", "9223372036854775807"],
    ["stats", "--max-expired", "99999999999999999999"],
    ["stats", "--max-stale", "99999999999999999999"],
    ["stats", "--max-fenced", "99999999999999999999"],
    ["stats", "--watch", "--count", "99999999999999999999"],
    ["sweep", "--max-batches", "99999999999999999999"],
]


@pytest.mark.parametrize("argv", HUGE_COUNTS, ids=lambda a: " ".join(a))
def test_a_huge_count_is_a_usage_error_like_a_negative_one(argv, tmp_path):
    assert CliRunner().invoke(app, ["--db", str(tmp_path / "l.db"), "init"]).exit_code == 0
    option = next(a for a in argv if a.startswith("-") and a != "--watch")
    named = {"-n": "'--limit' / '-n'", "--limit": "'--limit' / '-n'"}.get(option, f"'{option}'")
    result = CliRunner().invoke(app, ["--db", str(tmp_path / "l.db"), *argv], prog_name="idemctl")
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"error: Invalid value for {named}: must be 1000000000 or less, got {argv[-1]} (see 'idemctl {argv[0]} --help')"
    ]
