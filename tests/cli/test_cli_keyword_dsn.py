"""`--db` as a libpq keyword/value connection string (``host=… dbname=…``):
a PostgreSQL ledger, as libpq reads it, and its password never printed; a
SQLite path that merely holds ``=`` stays a file."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from idemctl import Ledger
from idemctl.cli import app

psycopg = pytest.importorskip("psycopg")
from psycopg.conninfo import conninfo_to_dict  # noqa: E402

SECRET = "s3cr3t"


def keyword_dsn(url: str, **extra: str) -> str:
    """The test ledger's URL (host, port, user, dbname, the options that pick
    its schema) as a keyword/value connection string."""
    params = {k: str(v) for k, v in conninfo_to_dict(url).items()} | extra
    quoted = {k: "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'" for k, v in params.items()}
    return " ".join(f"{k}={v}" for k, v in quoted.items())


def run(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(app, list(args))


@pytest.mark.engines("postgres")
def test_a_keyword_connection_string_is_a_postgres_ledger(ledger_target: str) -> None:
    dsn = keyword_dsn(ledger_target)
    init = run("--db", dsn, "init")
    assert (init.exit_code, init.output) == (
        0,
        "postgresql://postgres@127.0.0.1:5432/test: created (schema version 3)\n",
    )
    with Ledger.open(ledger_target) as ledger:  # the same schema, reached by URL
        assert ledger.schema_version() == 3
        ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b"made"))
    shown = run("--db", dsn, "inspect", "k1", "--principal", "acct_1", "--json")
    assert shown.exit_code == 0, shown.output
    assert (json.loads(shown.stdout)["key"], json.loads(shown.stdout)["status"]) == ("k1", "completed")


@pytest.mark.engines("postgres")
def test_a_keyword_connection_string_with_a_password_never_shows_it(ledger_target: str, tmp_path) -> None:
    dsn = keyword_dsn(ledger_target, password=SECRET)
    missing = keyword_dsn(ledger_target, password=SECRET, dbname="idemctl_no_such_db")
    unreachable = keyword_dsn(ledger_target, password=SECRET, port="1")
    source = str(tmp_path / "src.db")
    outputs = []
    for args, code in [
        (("--db", dsn, "init"), 0),
        (("--db", dsn, "stats"), 0),
        (("--db", dsn, "doctor"), None),
        (("--db", dsn, "inspect", "nothing", "--principal", "acct_1"), None),
        (("--db", missing, "stats"), 2),
        (("--db", unreachable, "stats"), 2),
        (("--db", source, "init"), 0),
        (("--db", source, "copy", "--to", dsn), 0),
        (("--db", source, "copy", "--to", unreachable), 2),
    ]:
        done = run(*args)
        if code is not None:
            assert done.exit_code == code, (args, done.output)
        outputs.append(done.output)
    assert all(SECRET not in out for out in outputs), [o for o in outputs if SECRET in o]
    # The hint names the ledger without repeating the string that holds the password.
    assert "`idemctl --db '<the same connection string>' init`" in outputs[4]
    assert outputs[4].startswith(
        "error: cannot open the ledger at postgresql://postgres@127.0.0.1:5432/idemctl_no_such_db"
    )
    assert outputs[5].startswith("error: cannot reach PostgreSQL at postgresql://postgres@127.0.0.1:1/test")


def test_a_sqlite_path_that_holds_an_equals_sign_is_a_file(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for path in ("ledger=1.db", str(tmp_path / "a=b" / "l.db"), "./host=x.db"):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        done = run("--db", path, "init")
        assert (done.exit_code, done.output) == (0, f"{path.removeprefix('./')}: created (schema version 3)\n")
        assert os.path.isfile(path)
    missing = run("--db", "other=2.db", "stats")
    assert (missing.exit_code, missing.output) == (
        2,
        "error: no ledger at other=2.db — run `idemctl --db other=2.db init`\n",
    )
    # A file named like a connection string is reached with a directory in front; the hint keeps it.
    named = run("--db", "./host=y.db", "stats")
    assert named.output == "error: no ledger at host=y.db — run `idemctl --db ./host=y.db init`\n"


@pytest.mark.engines("postgres")
def test_init_through_a_keyword_connection_string_creates_its_database(postgres_server: str) -> None:
    import secrets

    name = f"idemctl_dsn_{secrets.token_hex(4)}"
    dsn = keyword_dsn(postgres_server, dbname=name, password=SECRET)
    try:
        done = run("--db", dsn, "init")
        assert (done.exit_code, done.output) == (
            0,
            f"postgresql://postgres@127.0.0.1:5432/{name}: created the database (owner postgres)\n"
            f"postgresql://postgres@127.0.0.1:5432/{name}: created (schema version 3)\n",
        )
    finally:
        with psycopg.connect(postgres_server, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
            admin.execute(f"DROP DATABASE IF EXISTS {name}")
