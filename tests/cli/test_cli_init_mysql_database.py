"""`idemctl init` on a MariaDB/MySQL URL whose database does not exist: the
dry run says it would create the database, as it does on PostgreSQL (both
kinds create their database), and `init` then creates it."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest
from typer.testing import CliRunner

from idemctl.cli import app


def _admin(mysql_server: str, sql: str) -> None:
    import pymysql

    parts = urlsplit(mysql_server)
    conn = pymysql.connect(
        host=parts.hostname, port=parts.port or 3306, user=parts.username or "root", password=parts.password or ""
    )
    try:
        with conn.cursor() as cur:
            cur.execute(sql)
    finally:
        conn.close()


@pytest.fixture
def missing_database(mysql_server: str) -> Iterator[str]:
    """A URL naming a database nobody has created (dropped afterwards if a test made it)."""
    name = f"idemctl_t_{secrets.token_hex(4)}"
    parts = urlsplit(mysql_server)
    yield urlunsplit((parts.scheme, parts.netloc, f"/{name}", "", ""))
    _admin(mysql_server, f"DROP DATABASE IF EXISTS `{name}`")


def cli(*args: str):
    result = CliRunner().invoke(app, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def test_a_dry_run_on_a_missing_database_says_init_would_create_it_and_init_does(missing_database: str):
    dry = cli("--db", missing_database, "init", "--dry-run")
    where = dry.stdout.split(": ", 1)[0]
    assert where.startswith("mysql://") and where.endswith(urlsplit(missing_database).path)
    assert (dry.exit_code, dry.stderr, dry.stdout) == (
        0,
        "",
        f"{where}: would create the database, then the ledger tables; nothing written\n",
    )
    init = cli("--db", missing_database, "init")
    assert (init.exit_code, init.stderr) == (0, "")
    assert init.stdout == (
        f"{where}: created the database (character set utf8mb4)\n{where}: created (schema version 3)\n"
    )
    again = cli("--db", missing_database, "init", "--dry-run")
    assert (again.exit_code, again.stdout) == (0, f"{where}: already up to date (schema version 3); nothing to do\n")
