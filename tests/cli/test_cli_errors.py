"""Every user error the CLI can meet prints exactly one line on stderr, nothing
on stdout, no traceback, and exits with the documented code."""

from __future__ import annotations

import sqlite3

import pytest
from typer.testing import CliRunner

from idemctl import Ledger, fingerprint, wall_clock_ms
from idemctl.cli import EXIT_USAGE, app
from tests.helpers import read_only_file, sqlite_ledger_of_version

READ_COMMANDS = [
    ["inspect", "order-42", "--principal", "acct_A"],
    ["pending"],
    ["fenced"],
    ["stats"],
    ["sweep", "--dry-run"],
]
WRITE_COMMANDS = [["sweep"], ["purge", "order-42", "--principal", "acct_A", "--yes"]]


def fails(args: list[str], code: int = EXIT_USAGE, input: str | None = None) -> str:
    """Run, check the one-line contract, return the line."""
    result = CliRunner().invoke(app, args, input=input)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("args", READ_COMMANDS + WRITE_COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_a_missing_ledger_file_is_one_line_and_is_never_created(args, tmp_path):
    db = tmp_path / "nowhere.db"
    line = fails(["--db", str(db), *args])
    assert line == f"error: no ledger at {db} — run `idemctl --db {db} init`"
    assert list(tmp_path.iterdir()) == []


def test_the_default_ledger_path_is_idempotency_db_in_the_current_directory(tmp_path):
    assert fails(["stats"]) == "error: no ledger at idempotency.db — run `idemctl init`"
    assert not (tmp_path / "idempotency.db").exists()


def test_the_init_hint_names_the_ledger_given_in_idemctl_db_or_on_the_command_line(tmp_path, monkeypatch):
    assert (
        fails(["stats", "--db", "missing.db"]) == "error: no ledger at missing.db — run `idemctl --db missing.db init`"
    )
    assert fails(["--db", "my ledger.db", "pending"]) == (
        "error: no ledger at my ledger.db — run `idemctl --db 'my ledger.db' init`"
    )
    monkeypatch.setenv("IDEMCTL_DB", "from-env.db")
    assert fails(["stats"]) == "error: no ledger at from-env.db — run `idemctl --db from-env.db init`"
    # Typed as printed, the hint creates the ledger the command was looking for.
    init = CliRunner().invoke(app, ["--db", "missing.db", "init"])
    assert init.exit_code == 0 and (tmp_path / "missing.db").exists()
    assert not (tmp_path / "idempotency.db").exists()


@pytest.mark.parametrize("args", READ_COMMANDS + WRITE_COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_a_text_file_is_not_a_database(args, tmp_path):
    db = tmp_path / "notes.txt"
    db.write_text("hello, I am not SQLite\n" * 100)
    assert fails(["--db", str(db), *args]) == f"error: {db} is not an SQLite database, or it is corrupt"
    assert db.read_text() == "hello, I am not SQLite\n" * 100


def test_a_directory_is_not_a_ledger(tmp_path):
    assert fails(["--db", str(tmp_path), "stats"]) == f"error: {tmp_path} is a directory, not a ledger file"


@pytest.mark.parametrize("args", READ_COMMANDS + WRITE_COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_a_database_without_the_ledger_table_says_run_init(args, tmp_path):
    db = tmp_path / "other.db"
    sqlite3.connect(db).execute("CREATE TABLE unrelated (x)").connection.close()
    assert fails(["--db", str(db), *args]) == f"error: {db} has no idempotency ledger — run `idemctl --db {db} init`"


def test_a_schema_newer_than_this_idemctl_is_refused(tmp_path):
    db = tmp_path / "future.db"
    sqlite_ledger_of_version(db, 7)
    for args in (["stats"], ["init"], ["sweep"]):
        line = fails(["--db", str(db), *args])
        assert line.startswith(f"error: {db} has ledger schema version 7; this idemctl knows up to 3"), line


def test_a_ledger_locked_past_the_busy_timeout_is_one_line(tmp_path):
    db = tmp_path / "busy.db"
    fp = fingerprint("POST", "/x", [], b"")
    with Ledger.open(db, clock=lambda: wall_clock_ms() - 30 * 3_600_000) as old:
        old.init()
        old.complete(old.claim("acct_A", "expired", fp), 201, {}, b"{}")  # the sweep has work: it needs the lock
    with Ledger.open(db) as ledger:
        ledger.claim("acct_A", "k", fp)
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another writer holds the write lock
    try:
        line = fails(["--db", str(db), "--busy-timeout", "100ms", "sweep"])
        assert line == f"error: database {db} is locked: another writer held it past the 100 ms busy timeout"
        result = CliRunner().invoke(
            app, ["--db", str(db), "--busy-timeout", "100ms", "purge", "k", "-p", "acct_A", "--yes", "--force"]
        )
        # Reads go on under WAL (the row is shown); the delete cannot get the lock.
        assert result.exit_code == EXIT_USAGE and result.stdout.startswith("acct_A / k (generation 1): pending")
        assert result.stderr == f"error: database {db} is locked: another writer held it past the 100 ms busy timeout\n"
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    with Ledger.open(db, create=False) as ledger:
        assert ledger.lookup("acct_A", "k") is not None
        assert ledger.lookup("acct_A", "expired") is not None


def test_a_write_command_on_a_read_only_ledger_is_one_line_and_changes_nothing(tmp_path):
    db = tmp_path / "ro.db"
    with Ledger.open(db, clock=lambda: wall_clock_ms() - 30 * 3_600_000) as ledger:
        ledger.init()
        ledger.complete(ledger.claim("acct_A", "old", fingerprint("POST", "/x", [], b"")), 201, {}, b"{}")
    with read_only_file(db):
        assert fails(["--db", str(db), "sweep"]) == (
            f"error: database {db} is read-only — {db} is marked immutable: `chattr -i {db}` (as root) lets writes through"
        )
        ok = CliRunner().invoke(app, ["--db", str(db), "stats", "--json"])
        assert ok.exit_code == 0 and '"expired": 1' in ok.stdout
    with Ledger.open(db, create=False) as ledger:
        assert ledger.lookup("acct_A", "old") is not None


@pytest.mark.parametrize(
    "args",
    [
        ["inspect", "abc\n", "-p", "acct_A"],
        ["purge", "abc\n", "-p", "acct_A", "--yes"],
        ["fenced", "--key", "abc\n"],
        ["fingerprint", "-X", "POST", "--path", "/", "--key", "abc\n", "-p", "acct_A"],
    ],
    ids=lambda a: a[0],
)
def test_an_invalid_key_is_one_line(args, tmp_path):
    Ledger.open(tmp_path / "idempotency.db").init()
    assert fails(args) == "error: invalid Idempotency-Key 'abc\\n': must be 1-255 printable ASCII characters"


def test_an_unknown_scenario_names_the_built_in_ones():
    assert fails(["simulate", "nope"]) == (
        "error: unknown scenario 'nope': built-in ones are happy, reuse, in-progress, takeover, race, sweep "
        "(or use --file scenario.toml)"
    )


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["simulate"],
            "error: name a scenario (happy, reuse, in-progress, takeover, race, sweep) or give --file scenario.toml",
        ),
        (["simulate", "happy", "--workers", "3"], "error: --workers only applies to `idemctl simulate race`"),
        (["simulate", "happy", "--file", "x.toml"], "error: give a scenario name or --file, not both"),
        (["fingerprint", "-X", "POST", "--path", "/", "--key", "k"], "error: --key and --principal go together"),
        (
            ["fingerprint", "-X", "POST", "--path", "/", "-H", "no colon"],
            "error: --header 'no colon' is not 'Name: value'",
        ),
        (
            ["fingerprint", "-X", "POST", "--path", "/", "--body", "a", "--body-file", "-"],
            "error: give --body or --body-file, not both",
        ),
        (
            ["fingerprint", "-X", "POST", "--path", "/", "--body-file", "missing.bin"],
            "error: cannot read --body-file missing.bin: No such file or directory",
        ),
        (["--ttl", "2d", "stats"], "error: --retention (1 d) must be longer than --ttl (2 d)"),
        (["--ttl", "0s", "stats"], "error: --ttl must be longer than 0 s, got 0s"),
        (["stats", "--ttl", "0ms"], "error: --ttl must be longer than 0 s, got 0ms"),
        (["--retention", "10ms", "stats"], "error: --retention (10 ms) must be longer than --ttl (30 s)"),
        (["sweep", "--fenced-retention", "0s"], "error: --fenced-retention must be longer than 0 s, got 0s"),
        (
            ["--db", "", "stats"],
            "error: --db is empty: give a ledger file path, a postgresql://, a mysql://, a d1:// or a redis:// URL",
        ),
        (
            ["stats", "--db", " "],
            "error: --db is empty: give a ledger file path, a postgresql://, a mysql://, a d1:// or a redis:// URL",
        ),
        (
            ["init", "--db", ""],
            "error: --db is empty: give a ledger file path, a postgresql://, a mysql://, a d1:// or a redis:// URL",
        ),
        (
            ["simulate", "happy", "--db", ""],
            "error: --db is empty: give a ledger file path, a postgresql://, a mysql://, a d1:// or a redis:// URL",
        ),
        (
            ["--db", "oracle://x/y", "stats"],
            "error: unsupported ledger URL oracle://…: use a file path, postgresql://, mysql://, d1:// or redis://",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else " ".join(v[:2]),
)
def test_operator_mistakes_are_one_line(args, line):
    assert fails(args) == line


def test_an_unreachable_mysql_server_is_one_line_without_the_password():
    pytest.importorskip("pymysql")
    line = fails(["--db", "mysql://app:s3cret@127.0.0.1:1/test?connect_timeout=2", "stats"])
    assert line.startswith("error: cannot reach MySQL at mysql://app@127.0.0.1:1/test: ") and "s3cret" not in line


def test_sweep_retention_not_longer_than_the_ttl_is_refused(tmp_path):
    Ledger.open(tmp_path / "idempotency.db").init()
    assert fails(["sweep", "--retention", "10s"]) == "error: --retention (10 s) must be longer than --ttl (30 s)"


def test_an_unreachable_postgres_server_is_one_line_without_the_password():
    pytest.importorskip("psycopg")
    line = fails(["--db", "postgresql://postgres:s3cret@127.0.0.1:1/test?connect_timeout=2", "stats"])
    assert line.startswith("error: ") and "s3cret" not in line


@pytest.mark.parametrize("value", ["30", "ten seconds", "5x"])
def test_a_duration_without_a_unit_is_a_usage_error_exit_2(value):
    result = CliRunner().invoke(app, ["--ttl", value, "stats"])
    assert result.exit_code == 2 and result.stdout == ""
    assert "Traceback" not in result.stderr
    assert "--ttl" in result.stderr and "e.g." in result.stderr


def test_a_missing_required_option_is_a_usage_error_exit_2():
    result = CliRunner().invoke(app, ["inspect", "order-42"])
    assert result.exit_code == 2 and result.stdout == ""
    assert "--principal" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("db", "line"),
    [
        (
            "postgresql:/postgres@127.0.0.1:5432/x",
            "error: bad ledger URL: it begins with 'postgresql:/', and a PostgreSQL URL begins with 'postgresql://'",
        ),
        (
            "postgres:/app:s3cret@db/payments",
            "error: bad ledger URL: it begins with 'postgres:/', and a PostgreSQL URL begins with 'postgres://'",
        ),
        (
            "mariadb:root@127.0.0.1/test",
            "error: bad ledger URL: it begins with 'mariadb:', and a MariaDB/MySQL URL begins with 'mariadb://'",
        ),
    ],
)
@pytest.mark.parametrize("command", [["init"], ["stats"], ["init", "--dry-run"]], ids=" ".join)
def test_a_server_url_with_a_mistyped_scheme_is_a_bad_url_not_a_file_path(db, line, command, tmp_path):
    # As a file path, `init` would create a SQLite ledger inside a directory named after the scheme.
    assert fails(["--db", db, *command]) == line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [["init"], ["stats"], ["init", "--dry-run"]], ids=" ".join)
@pytest.mark.parametrize(
    ("db", "example"),
    [
        ("postgresql://postgres@127.0.0.1:5432", "postgresql://postgres@127.0.0.1:5432/idempotency"),
        ("postgresql://app:s3cret@db.internal/", "postgresql://app@db.internal/idempotency"),
        ("host=db.internal user=app", "postgresql://app@db.internal/idempotency"),
    ],
)
def test_a_postgresql_url_without_a_database_is_refused_before_anything_is_created(db, example, command, monkeypatch):
    # libpq would fall back to the role's name: for postgres, the maintenance database.
    monkeypatch.delenv("PGDATABASE", raising=False)
    monkeypatch.delenv("PGSERVICE", raising=False)
    role = "postgres" if "postgres@" in db else "app"
    assert fails(["--db", db, *command]) == (
        f"error: bad PostgreSQL URL: it names no database (libpq would use the role's name, {role}); "
        f"name the ledger's own, e.g. {example}"
    )


@pytest.mark.parametrize(
    "args",
    [["inspect", "K", "-p", "acct_A"], ["fingerprint", "-X", "POST", "--path", "/", "-k", "K", "-p", "acct_A"]],
    ids=["inspect", "fingerprint"],
)
@pytest.mark.parametrize(
    ("key", "shown", "why"),
    [
        (
            "k" * 300,
            "'" + "k" * 40 + "'… (260 more)",
            "it is 300 characters long, over the limit of 255 (printable ASCII)",
        ),
        (
            "é" * 300,
            "'" + "\\xe9" * 40 + "'… (260 more)",
            "it is 300 characters long, over the limit of 255 (printable ASCII)",
        ),
        ("\x1b[31mred", "'\\x1b[31mred'", "must be 1-255 printable ASCII characters"),
    ],
    ids=["long", "long-non-ascii", "escape"],
)
def test_a_refused_key_is_shown_short_and_escaped_and_a_long_one_is_told_its_length(args, key, shown, why, tmp_path):
    db = tmp_path / "l.db"
    with Ledger.open(db) as ledger:
        ledger.init()
    line = fails(["--db", str(db), *[key if a == "K" else a for a in args]])
    assert line == f"error: invalid Idempotency-Key {shown}: {why}"
