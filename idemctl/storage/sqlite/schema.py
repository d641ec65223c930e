"""Schema transactions on a SQLite ledger (storage/engine.py's SchemaTx)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable

import sqlite_utils

from ...errors import StorageError
from ..engine import Params, Rows


def split_statements(script: str) -> list[str]:
    """A DDL file as single statements, so that a schema change runs inside
    the caller's transaction (executescript would commit it first)."""
    statements, buffer = [], ""
    for line in script.splitlines(keepends=True):
        buffer += line
        if sqlite3.complete_statement(buffer):
            if buffer.strip():
                statements.append(buffer.strip())
            buffer = ""
    if buffer.strip() and not all(ln.strip().startswith("--") or not ln.strip() for ln in buffer.splitlines()):
        raise StorageError("a schema file ends inside a statement")
    return statements


def admin_view(conn: sqlite3.Connection) -> sqlite_utils.Database:
    """sqlite-utils over `conn`, for introspection and admin."""
    return sqlite_utils.Database(conn, recursive_triggers=False, execute_plugins=False)


class SqliteTx:
    """A schema transaction on one connection."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def execute(self, sql: str, params: Params) -> Rows:
        return self.conn.execute(sql, params).fetchall()

    def script(self, sql: str) -> None:
        for statement in split_statements(sql):
            self.conn.execute(statement)

    def table_names(self, names: Iterable[str]) -> set[str]:
        return set(names) & set(admin_view(self.conn).table_names())

    def check_recipe_table(self) -> None:
        return None


class AbsentTx:
    """A dry run (or a read-only open) of a ledger file that does not exist yet."""

    def execute(self, sql: str, params: Params) -> Rows:
        raise AssertionError("no statement runs against a ledger file that does not exist")

    def script(self, sql: str) -> None:
        raise AssertionError("no statement runs against a ledger file that does not exist")

    def table_names(self, names: Iterable[str]) -> set[str]:
        return set()

    def check_recipe_table(self) -> None:
        return None
