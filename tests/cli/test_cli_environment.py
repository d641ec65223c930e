"""The CLI reads its defaults from the same IDEMCTL_* variables as the
applications, through `idemctl.config`, so a value means the same thing
everywhere; its options override them. Run through the installed `idemctl`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from idemctl import Ledger, config
from idemctl.cli import app
from tests.helpers import IDEMCTL_ENV, clean_env

IDEMCTL = Path(sys.executable).with_name("idemctl")


def idemctl(*args: str, cwd: Path | None = None, **variables: str) -> subprocess.CompletedProcess[str]:
    """The installed command with only these IDEMCTL_* variables set."""
    env = {k: v for k, v in os.environ.items() if k not in IDEMCTL_ENV}
    return subprocess.run(
        [str(IDEMCTL), *args],
        capture_output=True,
        text=True,
        env={**env, "COLUMNS": "100", **variables},
        cwd=cwd,
        timeout=60,
    )


def refused(*args: str, **variables: str) -> str:
    """One line on stderr, nothing on stdout, exit 2; the line."""
    done = idemctl(*args, **variables)
    assert (done.returncode, done.stdout) == (2, ""), done
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.mark.slow
def test_the_retired_IDEMCTL_PENDING_TTL_MS_is_an_error_that_names_its_replacement(db):
    assert refused("stats", "--db", db, IDEMCTL_PENDING_TTL_MS="10000") == (
        "error: IDEMCTL_PENDING_TTL_MS is not read: set IDEMCTL_PENDING_TTL with a unit instead, "
        "e.g. IDEMCTL_PENDING_TTL=10000ms"
    )


@pytest.mark.slow
def test_a_duration_variable_without_a_unit_is_an_error_suggesting_milliseconds_or_seconds(db):
    assert refused("stats", "--db", db, IDEMCTL_PENDING_TTL="10000") == (
        "error: IDEMCTL_PENDING_TTL=10000 needs a unit (ms, s, m, h or d): 10000ms is 10 s, 10000s is 2 h 47 min"
    )
    assert refused("stats", "--db", db, IDEMCTL_BUSY_TIMEOUT="5") == (
        "error: IDEMCTL_BUSY_TIMEOUT=5 needs a unit (ms, s, m, h or d): 5ms is 5 ms, 5s is 5 s"
    )


@pytest.mark.slow
def test_policy_mistakes_in_variables_are_told_with_the_variables_names(db):
    assert (
        refused("stats", "--db", db, IDEMCTL_PENDING_TTL="0s")
        == "error: IDEMCTL_PENDING_TTL must be longer than 0 s, got 0s"
    )
    assert refused("stats", "--db", db, IDEMCTL_RETENTION="10s") == (
        "error: IDEMCTL_RETENTION (10 s) must be longer than --ttl (30 s)"
    )
    assert refused("stats", "--db", db, IDEMCTL_RETENTION="1h", IDEMCTL_PENDING_TTL="2h") == (
        "error: IDEMCTL_RETENTION (1 h) must be longer than IDEMCTL_PENDING_TTL (2 h)"
    )
    assert refused("--retention", "1m", "stats", "--db", db, IDEMCTL_PENDING_TTL="2m") == (
        "error: --retention (1 min) must be longer than IDEMCTL_PENDING_TTL (2 min)"
    )
    assert refused("sweep", "--db", db, IDEMCTL_FENCED_RETENTION="0d") == (
        "error: IDEMCTL_FENCED_RETENTION must be longer than 0 s, got 0d"
    )


@pytest.mark.slow
def test_every_setting_is_read_from_its_variable(db, tmp_path):
    variables = {
        "IDEMCTL_DB": db,
        "IDEMCTL_PENDING_TTL": "45s",
        "IDEMCTL_RETENTION": "2d",
        "IDEMCTL_FENCED_RETENTION": "90d",
        "IDEMCTL_BUSY_TIMEOUT": "250ms",
    }
    stats = idemctl("stats", "--json", cwd=tmp_path, **variables)
    assert stats.returncode == 0, stats.stderr
    doc = json.loads(stats.stdout)
    assert (doc["database"], doc["pending_ttl_ms"], doc["retention_ms"]) == (db, 45_000, 2 * 86_400_000)
    dry = json.loads(idemctl("sweep", "--dry-run", "--json", cwd=tmp_path, **variables).stdout)
    assert (dry["retention_ms"], dry["fenced_retention_ms"]) == (2 * 86_400_000, 90 * 86_400_000)


@pytest.mark.slow
def test_options_override_their_variables_even_ones_that_cannot_be_used(db, tmp_path):
    broken = {"IDEMCTL_PENDING_TTL": "10000", "IDEMCTL_RETENTION": "soon", "IDEMCTL_FENCED_RETENTION": "0s"}
    done = idemctl(
        "--ttl",
        "10s",
        "sweep",
        "--dry-run",
        "--json",
        "--retention",
        "1h",
        "--fenced-retention",
        "7d",
        "--db",
        db,
        **broken,
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert (doc["retention_ms"], doc["fenced_retention_ms"]) == (3_600_000, 7 * 86_400_000)
    # A command's own option overrides the global one, which overrides the variable.
    other = str(tmp_path / "other.db")
    Ledger.open(other).init()
    ttl = idemctl(
        "--ttl", "1m", "stats", "--json", "--ttl", "2m", "--db", other, IDEMCTL_DB=db, IDEMCTL_PENDING_TTL="30s"
    )
    assert (json.loads(ttl.stdout)["pending_ttl_ms"], json.loads(ttl.stdout)["database"]) == (120_000, other)
    retired = idemctl("--ttl", "10s", "stats", "--json", "--db", db, IDEMCTL_PENDING_TTL_MS="10000")
    assert json.loads(retired.stdout)["pending_ttl_ms"] == 10_000


@pytest.mark.slow
def test_help_works_whatever_the_environment_holds_and_names_each_options_variable():
    done = idemctl("--help", IDEMCTL_PENDING_TTL="10000", IDEMCTL_PENDING_TTL_MS="1")
    assert done.returncode == 0, done.stderr
    for name in ("IDEMCTL_DB", "IDEMCTL_PENDING_TTL", "IDEMCTL_RETENTION", "IDEMCTL_BUSY_TIMEOUT"):
        assert f"[env var: {name}]" in done.stdout, name
    assert "[default: idempotency.db]" in done.stdout and "[default: 5s]" in done.stdout
    sweep = idemctl("sweep", "--help", IDEMCTL_PENDING_TTL="10000")
    assert sweep.returncode == 0 and "[env var: IDEMCTL_FENCED_RETENTION]" in sweep.stdout


def test_the_cli_reads_the_environment_through_idemctl_config(db, monkeypatch, tmp_path):
    clean_env(monkeypatch, tmp_path)
    read: list[dict[str, str]] = []
    real = config.Settings.from_env.__func__  # type: ignore[attr-defined]

    def spy(cls, environ=None):
        read.append(dict(environ or {}))
        return real(cls, environ)

    monkeypatch.setattr(config.Settings, "from_env", classmethod(spy))
    result = CliRunner().invoke(app, ["stats", "--json"], env={"IDEMCTL_DB": db, "IDEMCTL_RETENTION": "3d"})
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["retention_ms"] == 3 * 86_400_000
    assert [(r["IDEMCTL_DB"], r["IDEMCTL_RETENTION"]) for r in read] == [(db, "3d")]


@pytest.mark.parametrize(
    "command",
    [["stats", "--json"], ["pending", "--json"], ["pending", "--stale", "--json"], ["sweep", "--dry-run", "--json"]],
)
def test_a_pending_ttl_of_twenty_minutes_works_on_every_command(db, command):
    # Lease renewal is off in the CLI's policy: a TTL above ten minutes
    # (the default lease_max) is the operator's to choose.
    result = CliRunner().invoke(app, ["--ttl", "20m", *command, "--db", db])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    if "pending_ttl_ms" in doc:
        assert doc["pending_ttl_ms"] == 1_200_000
    # And as the command's own option.
    own = CliRunner().invoke(app, [*command, "--ttl", "20m", "--db", db])
    assert own.exit_code == 0, own.stderr


def test_a_fifteen_minute_IDEMCTL_PENDING_TTL_is_read_by_the_cli(db):
    result = CliRunner().invoke(app, ["stats", "--json"], env={"IDEMCTL_DB": db, "IDEMCTL_PENDING_TTL": "15m"})
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["pending_ttl_ms"] == 900_000
    inspect = CliRunner().invoke(
        app, ["inspect", "k", "-p", "acct_A"], env={"IDEMCTL_DB": db, "IDEMCTL_PENDING_TTL": "15m"}
    )
    assert (inspect.exit_code, inspect.stderr) == (
        1,
        "no row for principal 'acct_A' key 'k': the next request with this key runs the mutation\n",
    )
