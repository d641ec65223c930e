"""The MariaDB/MySQL engine's side of `init`: the catalog, the DDL file's
statements, and the transaction-like handle the store's schema step runs in
(DDL commits implicitly on these servers, so it is one connection, not one
transaction; storage/mysql.py holds the lock and the Galera wait's settings)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from typing import Any

import pymysql

from ..errors import StorageError
from .engine import Params, Rows
from .statements import VERSION_TABLE

# An init that finds a ledger table without idemctl's version table waits
# this long on a Galera node for another node's init to create it.
GALERA_INIT_WAIT_S = 10.0

# Duplicate column name, duplicate key name.
_ALREADY_THERE = (1060, 1061)
_TABLES = "SELECT table_name FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name IN ({names})"


def existing_tables(conn: pymysql.connections.Connection[Any], names: list[str]) -> set[str]:
    if not names:
        return set()
    with conn.cursor() as cur:
        cur.execute(_TABLES.format(names=", ".join(["%s"] * len(names))), names)
        return {str(row[0]) for row in cur.fetchall()}


def _statements(script: str) -> list[str]:
    """A DDL file's statements (the driver runs one at a time). The files
    keep semicolons out of their comments."""
    out = []
    for chunk in re.split(r";\s*(?:\n|\Z)", script):
        code = "\n".join(line for line in chunk.splitlines() if not line.lstrip().startswith("--"))
        if code.strip():
            out.append(chunk.strip())
    return out


class MysqlTx:
    """One pooled connection of a MysqlEngine, holding the init lock."""

    def __init__(self, engine: Any, pooled: Any) -> None:
        self.engine = engine
        self.pooled = pooled

    def execute(self, sql: str, params: Params) -> Rows:
        rows: Rows = self.engine._execute(self.pooled, sql, params)
        return rows

    def script(self, sql: str) -> None:
        with self.pooled.conn.cursor() as cur:
            for statement in _statements(sql):
                try:
                    cur.execute(statement)
                except pymysql.MySQLError as exc:
                    # An ALTER that adds a column and its index is one
                    # statement (all or nothing) but has no IF NOT EXISTS on
                    # MySQL: run again after an init that failed later, it
                    # finds them there, which is what it was to do.
                    code = "\n".join(ln for ln in statement.splitlines() if not ln.lstrip().startswith("--"))
                    if not (exc.args and exc.args[0] in _ALREADY_THERE and code.lstrip().startswith("ALTER")):
                        raise

    def table_names(self, names: Iterable[str]) -> set[str]:
        return existing_tables(self.pooled.conn, list(names))

    def check_recipe_table(self) -> None:
        """idemctl never wrote a recipe-only ledger on these engines: a table
        of that name made by hand has columns idemctl cannot vouch for.

        An init on another Galera node may be between its statements (DDL
        is ordered cluster-wide, but GET_LOCK is per node). Its version
        table, made first, is the mark of idemctl; its version row, written
        last, says it is done. On a Galera node both are looked for again,
        with causal reads, for GALERA_INIT_WAIT_S: once the row is there,
        this init goes on and finds it has nothing to do (IF NOT EXISTS DDL,
        and the row decided by one INSERT). A version table still empty then
        is an init that stopped half-way, which this one finishes; no
        version table at all is a table idemctl did not make."""
        galera = bool(self.engine.galera)
        deadline = time.monotonic() + (GALERA_INIT_WAIT_S if galera else 0.0)
        while True:
            made_by_idemctl = VERSION_TABLE in self.table_names([VERSION_TABLE])
            if made_by_idemctl and (not galera or self._has_version_row()):
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if made_by_idemctl:
            return
        raise StorageError(
            f"{self.engine.describe()}: idempotency_keys exists but was not made by idemctl "
            "(no idemctl_schema_version table); idemctl creates its own ledger table on MariaDB/MySQL: "
            "rename or drop that one first (schema/mysql has the DDL)"
        )

    def _has_version_row(self) -> bool:
        with self.pooled.conn.cursor() as cur:
            cur.execute(f"SELECT 1 FROM {VERSION_TABLE} LIMIT 1")
            return cur.fetchone() is not None
