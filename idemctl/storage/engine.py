"""What the SQL core needs from an engine: running statements.

An engine knows its connections, its locking and its error classes, and
nothing about the ledger's statements (those live in storage/statements.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from .dialect import Dialect

T = TypeVar("T")
Params = Mapping[str, Any]
Rows = list[tuple[Any, ...]]


class SchemaTx(Protocol):
    """One schema transaction, serialised against other inits."""

    def execute(self, sql: str, params: Params) -> Rows: ...

    def script(self, sql: str) -> None:
        """Run a DDL file (several statements, no parameters)."""

    def table_names(self, names: Iterable[str]) -> set[str]: ...

    def check_recipe_table(self) -> None:
        """Refuse a recipe-only ledger table this engine cannot adopt as it is."""


class Engine(Protocol):
    dialect: Dialect

    def describe(self) -> str:
        """Where the ledger lives, safe to print (no password)."""

    def close(self) -> None: ...

    def read(self, sql: str, params: Params) -> Rows:
        """One statement that writes nothing."""

    def write(self, sql: str, params: Params) -> Rows:
        """One auto-committed statement; its RETURNING rows. An engine
        without RETURNING (dialect.returning is False) gives one row
        (LAST_INSERT_ID(),) per affected row instead."""

    def write_turn(self, statements: Sequence[tuple[str, Params]]) -> list[Rows]:
        """Each statement's RETURNING rows, all run in one turn of the writers."""

    def stream(self, sql: str, params: Params) -> Iterator[tuple[Any, ...]]:
        """A read whose rows are not all held in memory at once."""

    def table_names(self, names: Iterable[str]) -> set[str]:
        """Which of `names` exist as tables."""

    def migrate(self, body: Callable[[SchemaTx], T], *, write: bool) -> T:
        """Run `body` in a schema transaction; commit only if `write`."""

    def storage_bytes(self, tables: Iterable[str]) -> int | None: ...
