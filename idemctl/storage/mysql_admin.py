"""What an operator's tools ask of a MariaDB/MySQL server beyond the
ledger's statements: creating the database the URL names (`init` on a
missing database; a user who may not gets the statements an administrator
runs instead), and reading the variables and status values `idemctl
doctor` assesses (failover/mysql.py)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Mapping
from typing import Any

import pymysql

from .capabilities import DatabaseCreated, DatabaseNotCreatedError
from .failover.mysql import MysqlFacts

# The variables (the ledger's session) and status values `idemctl doctor` assesses.
DOCTOR_VARIABLES = (
    "version", "wsrep_on", "wsrep_sync_wait", "wsrep_cluster_name", "read_only", "log_bin", "binlog_format",
    "sync_binlog", "innodb_flush_log_at_trx_commit", "rpl_semi_sync_master_enabled", "rpl_semi_sync_master_wait_point",
)  # fmt: skip
DOCTOR_STATUS = (
    "wsrep_cluster_status", "wsrep_local_state_comment", "wsrep_cluster_size", "wsrep_ready",
    "slaves_connected", "slaves_running", "rpl_semi_sync_master_status",
)  # fmt: skip
_FACT_VARIABLES = "SHOW SESSION VARIABLES WHERE Variable_name IN ({names})"
_FACT_STATUS = "SHOW GLOBAL STATUS WHERE Variable_name IN ({names})"


def read_failover_facts(cur: Any) -> MysqlFacts:
    """The variables (as the session of cursor `cur` has them, its causal
    reads included) and status values `idemctl doctor` assesses, by
    lower-case name; those the server lacks are absent."""
    facts: dict[str, str] = {}
    for sql, names in ((_FACT_VARIABLES, DOCTOR_VARIABLES), (_FACT_STATUS, DOCTOR_STATUS)):
        cur.execute(sql.format(names=", ".join(["%s"] * len(names))), names)
        facts.update((str(name).lower(), str(value)) for name, value in cur.fetchall())
    return MysqlFacts(facts)


def create_database(connect_kwargs: Mapping[str, Any], where: str, scrub: Callable[[str], str]) -> DatabaseCreated:
    """Create the database of an engine's connection settings (utf8mb4), as
    their user, connected without a database. A user who may not gets
    DatabaseNotCreatedError with the statements an administrator runs."""
    kwargs = {k: v for k, v in connect_kwargs.items() if k != "database"}
    database = str(connect_kwargs["database"])
    name = database.replace("`", "``")
    try:
        conn = pymysql.connect(**kwargs)
        try:
            with conn.cursor() as cur:
                created = cur.execute(f"CREATE DATABASE IF NOT EXISTS `{name}` CHARACTER SET utf8mb4") == 1
        finally:
            conn.close()
    except pymysql.MySQLError as exc:
        reason = scrub(str(exc.args[1]) if len(exc.args) > 1 else str(exc))
        raise not_created(connect_kwargs, where, reason) from None
    return DatabaseCreated(where, created, "character set utf8mb4")


def not_created(connect_kwargs: Mapping[str, Any], where: str, reason: str) -> DatabaseNotCreatedError:
    """The database could not be created: the server's reason, and the
    statements an administrator runs instead, with the mysql client.

    >>> e = not_created({"user": "app", "database": "payments", "host": "db", "port": 3306},
    ...                 "mysql://app@db:3306/payments", "Access denied")
    >>> str(e)
    'cannot create the database payments on mysql://app@db:3306/payments: Access denied'
    >>> shlex.split(e.command)[:7]
    ['mysql', '-u', 'root', '-h', 'db', '-P', '3306']
    >>> shlex.split(e.command)[7:]
    ['-e', "CREATE DATABASE payments CHARACTER SET utf8mb4; GRANT ALL ON payments.* TO 'app'@'%'"]
    """
    database = str(connect_kwargs["database"])
    name = database.replace("`", "``")
    # A plain name goes unquoted, so the hint's backquotes delimit only commands.
    shown = database if re.fullmatch(r"[A-Za-z0-9_$]+", database) else f"`{name}`"
    user = connect_kwargs.get("user", "")
    statement = f"CREATE DATABASE {shown} CHARACTER SET utf8mb4; GRANT ALL ON {shown}.* TO '{user}'@'%'"
    admin = ["mysql", "-u", "root"]
    if connect_kwargs.get("host"):
        admin += ["-h", str(connect_kwargs["host"]), "-P", str(connect_kwargs["port"])]
    return DatabaseNotCreatedError(
        f"cannot create the database {database} on {where}: {reason}",
        database=database,
        command=shlex.join([*admin, "-e", statement]),
        who="an administrator",
    )
