"""`idemctl init` on a PostgreSQL URL whose database does not exist: it creates
the database when the URL's role may, and otherwise says exactly how; the
read commands send the operator to an `init` that, typed as printed, works."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest
from typer.testing import CliRunner

from idemctl.cli import app


def with_database(url: str, name: str, user: str | None = None) -> str:
    parts = urlsplit(url)
    netloc = parts.netloc if user is None else f"{user}@{parts.netloc.rsplit('@', 1)[-1]}"
    return urlunsplit((parts.scheme, netloc, f"/{name}", "", ""))


def admin(postgres_server: str, sql: str) -> None:
    import psycopg

    with psycopg.connect(postgres_server, autocommit=True) as conn:
        conn.execute(sql)


@pytest.fixture
def missing_database(postgres_server: str) -> Iterator[str]:
    """A database name nobody has created (dropped afterwards if a test made it)."""
    name = f"idemctl_t_{secrets.token_hex(4)}"
    yield name
    # FORCE: a pooler may still hold a connection to it.
    admin(postgres_server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def cli(*args: str):
    result = CliRunner().invoke(app, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def test_stats_on_a_missing_database_hints_an_init_that_creates_it(postgres_server, missing_database):
    url = with_database(postgres_server, missing_database)
    where = url
    stats = cli("--db", url, "stats")
    assert (stats.exit_code, stats.stdout) == (2, "")
    assert stats.stderr == (
        f'error: cannot open the ledger at {where}: database "{missing_database}" does not exist — '
        f"run `idemctl --db {url} init`\n"
    )
    dry = cli("--db", url, "init", "--dry-run")
    assert (dry.exit_code, dry.stdout) == (
        0,
        f"{where}: would create the database, then the ledger tables; nothing written\n",
    )
    init = cli("--db", url, "init")
    assert (init.exit_code, init.stderr) == (0, "")
    owner = urlsplit(url).username
    assert init.stdout == f"{where}: created the database (owner {owner})\n{where}: created (schema version 3)\n"
    again = cli("--db", url, "stats", "--json")
    assert again.exit_code == 0, again.stderr


def test_a_role_that_may_not_create_databases_is_told_the_createdb_to_ask_for(postgres_server, missing_database):
    role = f"idemctl_t_{secrets.token_hex(4)}"
    admin(postgres_server, f'CREATE ROLE "{role}" LOGIN NOCREATEDB')
    try:
        url = with_database(postgres_server, missing_database, user=role)
        host = urlsplit(url).hostname
        port = urlsplit(url).port
        init = cli("--db", url, "init")
    finally:
        admin(postgres_server, f'DROP ROLE "{role}"')
    assert (init.exit_code, init.stdout) == (2, "")
    assert init.stderr == (
        f"error: cannot create the database '{missing_database}' for {url}: permission denied to create database; "
        f"have a role that may create databases run `createdb -h {host} -p {port} -O {role} {missing_database}`, "
        f"then run `idemctl --db {url} init` again\n"
    )


@pytest.mark.slow
def test_init_of_a_new_database_through_pgbouncer_waits_for_the_pooler_and_creates_the_ledger(
    pgbouncers, postgres_server, missing_database
):
    # The pooler first finds the database missing; after `init` creates it, the
    # pooler's next logins to it time out until its server_login_retry has passed.
    url = pgbouncers("transaction", any_database=True).url(missing_database)
    init = cli("--db", url, "init")
    assert init.exit_code == 0, (init.stdout, init.stderr)
    assert init.stdout == f"{url}: created the database (owner postgres)\n{url}: created (schema version 3)\n"
    assert init.stderr == (
        f"cannot reach PostgreSQL at {url}: connection timeout expired; a pooler such as PgBouncer waits "
        "before it logs in again to a database it first found missing: trying again for up to 45 s\n"
    )
    again = cli("--db", url, "init")
    assert (again.exit_code, again.stdout) == (0, f"{url}: already up to date (schema version 3)\n")


def test_a_new_database_that_never_answers_is_one_line_saying_when_to_run_init_again(monkeypatch):
    from idemctl.cli import core, schema
    from idemctl.errors import ConnectionFailedError

    tried: list[str] = []

    def unreachable(target: str, busy_timeout_ms: int, mode: int) -> None:
        tried.append(target)
        raise ConnectionFailedError(f"cannot reach PostgreSQL at {target}: connection timeout expired")

    monkeypatch.setattr(schema, "_init", unreachable)
    monkeypatch.setattr(schema.time, "sleep", lambda s: None)
    url = "postgresql://app@db.internal:6432/payments"
    with pytest.raises(core.UserError) as caught:
        schema._init_new_database(url, 1000, 0o600, wait_s=0)
    assert tried == [url]
    assert str(caught.value) == (
        f"cannot reach PostgreSQL at {url}: connection timeout expired; the database was created, but a pooler in "
        "front of it (PgBouncer) may still be waiting out its server_login_retry: run `idemctl init` again in 30 seconds"
    )
