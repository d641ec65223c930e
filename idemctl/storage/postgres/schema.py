"""Schema transactions on a PostgreSQL ledger (storage/engine.py's SchemaTx),
and which of the ledger's tables exist."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import psycopg

from ...errors import StorageError
from ..engine import Params, Rows

# to_regclass resolves through the connection's search_path, exactly as the
# unqualified names in every statement do.
EXISTING = "SELECT array_agg(name) FILTER (WHERE to_regclass(name) IS NOT NULL) FROM unnest(%(names)s::text[]) AS name"


def existing_tables(rows: Rows) -> set[str]:
    """EXISTING's answer as a set of names."""
    return set(rows[0][0] or []) if rows else set()


def existing(conn: psycopg.Connection[Any], names: list[str]) -> set[str]:
    return existing_tables(conn.execute(EXISTING, {"names": names}).fetchall())


class PostgresTx:
    """A schema transaction on one connection."""

    def __init__(self, where: str, conn: psycopg.Connection[Any]) -> None:
        self.where = where
        self.conn = conn

    def execute(self, sql: str, params: Params) -> Rows:
        cur = self.conn.execute(sql, params)
        return cur.fetchall() if cur.description is not None else []

    def script(self, sql: str) -> None:
        self.conn.execute(sql)

    def table_names(self, names: Iterable[str]) -> set[str]:
        return existing(self.conn, list(names))

    def check_recipe_table(self) -> None:
        """A ledger table made by hand from the recipe's DDL has a TEXT body
        column, which cannot hold every response: say how to fix it rather
        than adopting it."""
        row = self.conn.execute(
            "SELECT format_type(atttypid, atttypmod) FROM pg_attribute"
            " WHERE attrelid = to_regclass('idempotency_keys') AND attname = 'response_body' AND NOT attisdropped",
        ).fetchone()
        if row is not None and row[0] != "bytea":
            raise StorageError(
                f"{self.where}: idempotency_keys.response_body is {row[0]}, "
                "and idemctl on PostgreSQL stores "
                "response bodies as bytea; convert it first: ALTER TABLE idempotency_keys ALTER COLUMN response_body "
                "TYPE bytea USING convert_to(response_body, 'UTF8')"
            )
