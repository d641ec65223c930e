"""What an operator's setup asks of a PostgreSQL server beyond the ledger's
statements: creating the database the URL names (`init` on a missing
database), and, for a role that may not, the createdb command an
administrator runs instead."""

from __future__ import annotations

import shlex
from collections.abc import Callable

import psycopg
import psycopg.sql
from psycopg import errors as pgerrors
from psycopg.conninfo import make_conninfo

from ...text import single_line
from ..capabilities import DatabaseCreated, DatabaseNotCreatedError
from .errors import libpq_reason
from .pooler import refused_startup
from .url import ServerSettings


def create_database(settings: ServerSettings, where: str, scrub: Callable[[str], str]) -> DatabaseCreated:
    """Create the database the URL names, as the URL's role, connected to
    the server's maintenance database (``postgres``, else ``template1``).
    `created` is False when it existed already. A role that may not create
    databases gets DatabaseNotCreatedError with the createdb command to ask for."""
    params = settings.url_params
    name, role = params.get("dbname", ""), params.get("user") or None
    created = DatabaseCreated(where, True, f"owner {role}" if role else "")
    if not name:
        raise not_created(settings, where, name, role, "the URL names no database")
    last: psycopg.Error | None = None
    for maintenance in ("postgres", "template1"):
        try:
            conn = psycopg.connect(make_conninfo(settings.conninfo, dbname=maintenance), autocommit=True)
        except psycopg.Error as exc:
            if refused_startup(exc):  # a pooler: its database list decides
                try:
                    conn = psycopg.connect(make_conninfo(settings.pooled_conninfo, dbname=maintenance), autocommit=True)
                except psycopg.Error as again:
                    last = again
                    continue
            else:
                last = exc
                continue
        try:
            conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
            return created
        except pgerrors.DuplicateDatabase:
            # Another init got there first: the database is there.
            return DatabaseCreated(where, False, created.detail)
        except psycopg.Error as exc:
            raise not_created(settings, where, name, role, scrub(single_line(str(exc)))) from exc
        finally:
            conn.close()
    reason = scrub(libpq_reason(str(last))) if last is not None else "no maintenance database"
    raise not_created(settings, where, name, role, reason)


def not_created(
    settings: ServerSettings, where: str, database: str, role: str | None, reason: str
) -> DatabaseNotCreatedError:
    """The database could not be created: the server's reason, and the
    createdb an administrator runs instead, for the URL's server, owned by
    the URL's role.

    >>> from idemctl.storage.postgres.url import ServerSettings
    >>> settings = ServerSettings.parse("postgresql://app@db.internal:5433/payments", readonly=False,
    ...     busy_timeout_ms=5000, pool_min_size=None, pool_max_size=None, pool_timeout_s=None)
    >>> e = not_created(settings, "postgresql://app@db.internal:5433/payments", "payments", "app", "permission denied")
    >>> str(e)
    "cannot create the database 'payments' for postgresql://app@db.internal:5433/payments: permission denied"
    >>> e.command, e.who
    ('createdb -h db.internal -p 5433 -O app payments', 'a role that may create databases')
    """
    p = settings.url_params
    words = ["createdb"]
    if p.get("host"):
        words += ["-h", p["host"]]
    if p.get("port"):
        words += ["-p", p["port"]]
    if role:
        words += ["-O", role]
    words.append(database)
    return DatabaseNotCreatedError(
        f"cannot create the database {database!r} for {where}: {reason}",
        database=database,
        command=shlex.join(words),
        who="a role that may create databases",
    )
