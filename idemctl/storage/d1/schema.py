"""Schema changes on D1: its HTTP API has no transaction across calls, but
runs a batch as one. The schema transaction reads at once and holds its
writes until the body asks for a write's rows (init's version row, always
last): then all of them go as one batch, and either all apply or none."""

from __future__ import annotations

from collections.abc import Iterable

from ...errors import StorageError
from ..engine import Engine, Params, Rows
from ..sqlite.schema import split_statements
from ..store_base import KeyStoredTwiceError, _duplicate


class Raced(Exception):
    """Another init applied the same schema first: run the decision again."""


def _reads(sql: str) -> bool:
    return sql.lstrip().upper().startswith(("SELECT", "WITH"))


class D1Tx:
    """storage/engine.py's SchemaTx on D1."""

    def __init__(self, engine: Engine, write: bool) -> None:
        self.engine = engine
        self.write = write
        self.held: list[tuple[str, Params]] = []

    def execute(self, sql: str, params: Params) -> Rows:
        if _reads(sql) and not self.held:
            return self.engine.read(sql, params)
        if not self.write:
            raise StorageError("a dry run writes nothing")
        statements, self.held = [*self.held, (sql, params)], []
        try:
            return self.engine.write_turn(statements)[-1]
        except StorageError as exc:
            if _duplicate(exc):
                raise KeyStoredTwiceError(self.engine.describe()) from exc
            if "duplicate column name" in str(exc) or "already exists" in str(exc):
                raise Raced() from exc
            raise

    def script(self, sql: str) -> None:
        self.held.extend((statement, {}) for statement in split_statements(sql))

    def table_names(self, names: Iterable[str]) -> set[str]:
        return self.engine.table_names(names)

    def check_recipe_table(self) -> None:
        return None
