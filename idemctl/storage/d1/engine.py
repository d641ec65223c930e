"""The D1 engine: the SQLite dialect's statements sent to D1's HTTP API.

Every statement is one call; a turn of statements (the sweep's deletes, a
copy's batch) and a schema change are one call each, as a D1 batch, which
D1 runs as one transaction. D1 keeps its own rules, and so does this
engine: no PRAGMA, parameters bound by position (at most 100), statements
of at most 100 000 bytes, integers exact only below 2**53 (JavaScript
numbers), and BLOBs handed back as arrays of numbers."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from ...errors import ReadOnlyDatabaseError, StorageError
from ..dialect import D1
from ..engine import Params, Rows, SchemaTx
from .api import D1Api, Query
from .facts import D1Facts, read_facts
from .location import D1Location
from .schema import D1Tx, Raced

T = TypeVar("T")

#: D1's limits (developers.cloudflare.com/d1/platform/limits/).
MAX_BOUND_PARAMS = 100
MAX_STATEMENT_BYTES = 100_000
_SAFE_INTEGER = 2**53 - 1

_NAMED = re.compile(r"(?<![:\w]):([a-z_][a-z0-9_]*)")


def positional(sql: str) -> tuple[str, tuple[str, ...]]:
    """A statement with ``:name`` parameters as D1 binds them (``?N``, by
    position, numbered in order of first use) and the names in that order.

    >>> positional("SELECT :a, :b WHERE x = :a")
    ('SELECT ?1, ?2 WHERE x = ?1', ('a', 'b'))
    """
    names: dict[str, int] = {}

    def number(match: re.Match[str]) -> str:
        return f"?{names.setdefault(match.group(1), len(names) + 1)}"

    return _NAMED.sub(number, sql), tuple(names)


def json_value(value: object) -> object:
    """A parameter as D1 takes it in JSON: an integer past 2**53 as its
    decimal text (an INTEGER column's affinity stores it exactly; a JSON
    number would be rounded to a double).

    >>> json_value(2**60), json_value(7), json_value(True)
    ('1152921504606846976', 7, 1)
    """
    if value is None or isinstance(value, str | float):
        return value
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value if -_SAFE_INTEGER <= value <= _SAFE_INTEGER else str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        raise StorageError("D1's HTTP API cannot bind bytes: a body that is not UTF-8 cannot be stored on D1")
    raise StorageError(f"D1 cannot bind a {type(value).__name__}")


class D1Engine:
    """One D1 database through Cloudflare's HTTP API (``d1://ACCOUNT/DATABASE``).

    Nothing is called before the first statement. The token comes from
    CLOUDFLARE_API_TOKEN and is never part of a message or a repr.

    >>> engine = D1Engine("d1://acct/db", environ={"CLOUDFLARE_API_TOKEN": "s3cret"})
    >>> engine.describe(), "s3cret" in repr(engine)
    ('d1://acct/db', False)
    """

    dialect = D1

    def __init__(
        self,
        url: str,
        *,
        readonly: bool = False,
        busy_timeout_ms: int = 5000,
        timeout_s: float = 10.0,
        retries: int = 4,
        backoff_s: float = 0.25,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.location = D1Location.parse(url, environ)
        self.readonly = readonly
        self.api = D1Api(self.location, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s)
        self._spelled: dict[str, tuple[str, tuple[str, ...]]] = {}

    def __repr__(self) -> str:
        return f"D1Engine({self.describe()!r})"

    def describe(self) -> str:
        return self.location.describe()

    def close(self) -> None:
        self.api.close()

    # -- statements -------------------------------------------------------------
    def query(self, sql: str, params: Params) -> Query:
        """One statement as the API takes it, checked against D1's limits."""
        spelled = self._spelled.get(sql)
        if spelled is None:
            spelled = positional(sql)
            if len(spelled[1]) > MAX_BOUND_PARAMS:
                raise StorageError(f"D1 binds at most {MAX_BOUND_PARAMS} parameters a statement, got {len(spelled[1])}")
            if len(spelled[0].encode("utf-8")) > MAX_STATEMENT_BYTES:
                raise StorageError(f"D1 takes statements of at most {MAX_STATEMENT_BYTES} bytes")
            if len(self._spelled) < 512:  # the copy's statements differ with their batch
                self._spelled[sql] = spelled
        text, names = spelled
        try:
            return text, [json_value(params[name]) for name in names]
        except KeyError as exc:
            raise StorageError(f"no value for the parameter :{exc.args[0]}") from None

    def read(self, sql: str, params: Params) -> Rows:
        return [tuple(row) for row in self.api.run([self.query(sql, params)], write=False)[0]]

    def write(self, sql: str, params: Params) -> Rows:
        self._writable()
        return [tuple(row) for row in self.api.run([self.query(sql, params)], write=True)[0]]

    def write_turn(self, statements: Sequence[tuple[str, Params]]) -> list[Rows]:
        if not statements:
            return []
        self._writable()
        done = self.api.run([self.query(sql, params) for sql, params in statements], write=True)
        return [[tuple(row) for row in rows] for rows in done]

    def _writable(self) -> None:
        if self.readonly:
            raise ReadOnlyDatabaseError(f"{self.describe()} was opened read-only")

    def stream(self, sql: str, params: Params) -> Iterator[tuple[Any, ...]]:
        # D1 answers a statement in one JSON document: the rows come at once.
        yield from self.read(sql, params)

    def table_names(self, names: Iterable[str]) -> set[str]:
        wanted = sorted(set(names))
        if not wanted:
            return set()
        marks = ", ".join(f":t{i}" for i in range(len(wanted)))
        rows = self.read(
            f"SELECT name FROM sqlite_master WHERE type = 'table' AND name IN ({marks})",
            {f"t{i}": name for i, name in enumerate(wanted)},
        )
        return {str(r[0]) for r in rows}

    def storage_bytes(self, tables: Iterable[str]) -> int | None:
        if self.api.size_after is None:
            self.read("SELECT 1", {})
        return self.api.size_after

    # -- schema -------------------------------------------------------------------
    def migrate(self, body: Callable[[SchemaTx], T], *, write: bool) -> T:
        """`body` with its reads run at once and its writes sent together, as
        one D1 batch (one transaction), with the statement whose rows it
        waits for. D1 has no transaction across calls: an init racing this
        one makes the batch fail on a column that is already there, and the
        body is run again from what the winner left."""
        if write:
            self._writable()
        try:
            return body(D1Tx(self, write))
        except Raced:
            return body(D1Tx(self, write))

    # -- what doctor reports ----------------------------------------------------------
    def call_latency_s(self) -> float:
        """The seconds one call of the API takes (a `SELECT 1`)."""
        self.read("SELECT 1", {})
        return self.api.last_call_s

    def failover_facts(self) -> D1Facts:
        """`idemctl doctor` on D1: the token's reach, a call's latency, the
        schema (version, tables, indexes) and the rows."""
        return read_facts(self)
