"""The store's foundation: a statement ready to run, and a Store's plumbing
over its engine (spelling, running, the schema guard, init's decision, the
row reads every part needs). store.py assembles the Store from it."""

from __future__ import annotations

from collections.abc import Callable, Collection, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

from ..errors import SchemaOutdatedError, SchemaTooNewError, StorageError
from ..fingerprint import stored_key_identity
from ..outcomes import FencedEvent, InitAction, InitResult, StoredRow, SweepResult
from ..schema import SCHEMA_VERSION, schema_files
from .engine import Engine, Rows, SchemaTx
from .rows import database_ms, decode_event, decode_row, version_of
from .statements import (
    FENCED_TABLE,
    FROM_THE_START,
    INSERT_VERSION,
    LEDGER_TABLE,
    LOOKUP,
    LOOKUP_STORED,
    TABLES,
    VERSION,
    VERSION_TABLE,
    WITHOUT_RETURNING,
)

R = TypeVar("R")

# The schema version that adds key_id and its unique index.
KEY_ID_VERSION = 3


class KeyStoredTwiceError(StorageError):
    """The upgrade to schema 3 found a principal's key stored twice: once as
    an older writer stored the header (``"k"``) and once bare (``k``). They
    are one key from schema 3 on, and idemctl will not pick which row keeps
    the promise: nothing was changed."""

    def __init__(self, where: str) -> None:
        self.where = where
        super().__init__(
            f"{where}: cannot upgrade to schema {KEY_ID_VERSION}: a key is stored twice for one principal, "
            'with and without the sf-string quotes ("k" and k), and from this version on they are one key; '
            "nothing was changed. Find and settle those rows first (docs/runbook.md, "
            '"Upgrading a ledger with keys stored before sf-string parsing"), then run init again'
        )


# The rows whose key an older writer stored as the header's sf-string, and
# whether rows hold given keys as they are: what the upgrade to schema 3's
# unique index would find twice, read by a dry run that creates no index.
QUOTED_KEYS = "SELECT principal, key FROM idempotency_keys WHERE substr(key, 1, 1) = '\"'"
_PAIRS_AT_ONCE = 100

# The key a stored value names, as schema 3's key_id column computes it.
key_id = stored_key_identity


def _text(value: object) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)


def _duplicate(exc: Exception) -> bool:
    """Whether a schema statement failed on a duplicate of the new unique index."""
    text = str(exc).lower()
    return "idx_idempotency_keys_key_id" in text or ("key_id" in text and ("unique" in text or "duplicate" in text))


# -- the store's vocabulary: what the ledger asks it to run -------------------------
# The decision loop (idemctl/decision.py) and every multi-statement
# operation (the claim then the lookup, the fenced-out event, the
# completion's retry, the sweep) are generator steps that yield these and are
# sent what they give back: a Statement (its rows, decoded), a Turn (the rows
# of each of its statements) or Tables (which of idemctl's tables exist).
# A synchronous driver runs each with `Store.run`, an asynchronous one with
# `await AsyncStore.run` (storage/aio.py): the SQL, its decoding and the
# operations' branches exist once, only the execution differs, and no
# operation is looked up by name. Each carries the store that spelled it
# (its SQL is that engine's), so a driver needs nothing else to run it.


# Not frozen: two are built for every request, and a frozen dataclass pays
# for its guard on every field; a Statement is read once, by the store that runs it.
@dataclass(slots=True)
class Statement(Generic[R]):
    """One step ready to run: spelled for `store`'s engine, bound, and how
    its rows decode. `sql` is what the engine runs: a SQL statement, or on
    Redis the name of the operation (a Lua script) whose keys and arguments
    are `params`. A `write` runs only after the store's schema guard."""

    store: StoreBase
    sql: str
    params: Mapping[str, Any]
    decode: Callable[[Rows], R]
    write: bool


@dataclass(frozen=True, slots=True)
class Turn:
    """Statements that run together in one turn of the engine's writers
    (`Engine.write_turn`); the sweep's deletes. Runs after the schema guard;
    gives back a list of rows per statement."""

    store: StoreBase
    statements: Sequence[tuple[str, Mapping[str, Any]]]


@dataclass(frozen=True, slots=True)
class Tables:
    """Which of idemctl's tables exist (`StoreBase.tables`): a catalog read
    until the schema is complete, remembered from then on."""

    store: StoreBase


#: What a store runs: `Store.run`, or `await AsyncStore.run`.
StoreOp = Statement[Any] | Turn | Tables
#: A store operation of several statements, as steps: it yields StoreOps
#: and is sent what each gives back; it returns its result.
StoreSteps = Generator[StoreOp, Any, R]
#: The sweep as steps.
SweepSteps = StoreSteps[SweepResult]


class Done:
    """What steps returned, once they returned (StopIteration made a value)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def next_op(steps: StoreSteps[Any], value: Any = None, error: Exception | None = None) -> StoreOp | Done:
    """The steps' next operation, sent `value`, the last one's result, or
    with `error`, the last one's, raised inside them where it happened;
    Done, with their result, once they return. What both stores' step
    drivers (`Store.run_steps`, `AsyncStore.run_steps`) advance by."""
    try:
        return steps.throw(error) if error is not None else steps.send(value)
    except StopIteration as done:
        return Done(done.value)


def ran(op: StoreOp) -> tuple[Any, Exception | None]:
    """`op` run on the store that built it: its result, or the error it raised."""
    try:
        return op.store.run(op), None
    except Exception as exc:
        return None, exc


def reads_version(tables: Collection[str]) -> bool:
    """Whether a ledger with these tables has a schema version to read (VERSION)."""
    return LEDGER_TABLE in tables and VERSION_TABLE in tables


def version_in(tables: Collection[str], version_rows: Rows) -> int | None:
    """None: no ledger table; 0: the recipe's table only; N: idemctl schema N
    (VERSION's rows, read when `reads_version`)."""
    if LEDGER_TABLE not in tables:
        return None
    if VERSION_TABLE not in tables:
        return 0
    return version_of(version_rows)


class StoreBase:
    """A store's engine, how it spells and runs statements, and what it knows
    of the schema."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.dialect = engine.dialect
        spell = engine.dialect.params
        self._sql: dict[str, str] = {}
        self._spell = spell
        self._tables: frozenset[str] | None = None
        self._checked = False
        # Where the last batch that deleted rows ended (the newest timestamp
        # it deleted). While a backlog drains, the next batch starts its index
        # walk there: on PostgreSQL the rows earlier batches deleted stay in
        # the index as dead entries until VACUUM, and a walk from the start
        # would step over all of them. Rows only get newer (claims and
        # takeovers write the current time), so nothing is left below it;
        # it is dropped once a sweep finds nothing due, after one more walk
        # from the start.
        self._sweep_from = FROM_THE_START
        # The last batch was full: the backlog goes on, and the next batch
        # skips the probe (its DELETE decides on its own anyway).
        self._draining = False

    # -- plumbing -------------------------------------------------------------------
    def sql(self, text: str) -> str:
        """A statement as this engine spells it (cached: the hot path asks twice a request)."""
        spelled = self._sql.get(text)
        if spelled is None:
            form = text if self.dialect.returning else WITHOUT_RETURNING.get(text, text)
            if not self.dialect.returning and "RETURNING" in form:
                raise StorageError(f"no form for {self.dialect.name} of: {' '.join(text.split())}")
            spelled = self._sql[text] = self._spell(form)
        return spelled

    def _read(self, text: str, params: Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
        return self.engine.read(self.sql(text), params or {})

    def _write(self, text: str, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        return self.engine.write(self.sql(text), params)

    def describe(self) -> str:
        return self.engine.describe()

    def keep_rows_for(self, retention_ms: int) -> None:
        """How long the ledger's policy keeps a row. The SQL engines keep
        every row until the sweep deletes it; an engine whose rows expire on
        their own (Redis) sets their expiry from it."""

    def close(self) -> None:
        self.engine.close()

    @property
    def drain_batch(self) -> int:
        return self.dialect.sweep.drain_batch

    @overload
    def run(self, op: Statement[R]) -> R: ...
    @overload
    def run(self, op: Turn) -> list[Rows]: ...
    @overload
    def run(self, op: Tables) -> frozenset[str]: ...
    def run(self, op: StoreOp) -> Any:
        """Run one operation on this store's engine: a Statement's rows
        decoded, a Turn's rows per statement, or the tables found."""
        if type(op) is Statement:
            if op.write:
                self._guard()
                return op.decode(self.engine.write(op.sql, op.params))
            return op.decode(self.engine.read(op.sql, op.params))
        if type(op) is Turn:
            self._guard()
            return self.engine.write_turn(op.statements)
        return self.tables()

    def run_steps(self, steps: StoreSteps[R]) -> R:
        """A multi-statement operation's steps, each run here in turn (the
        synchronous twin of `AsyncStore.run_steps`). An operation's error is
        raised inside the steps, where it happened."""
        op = next_op(steps)
        while not isinstance(op, Done):
            op = next_op(steps, *ran(op))
        return op.value  # type: ignore[no-any-return]

    def database_now_statement(self) -> Statement[int]:
        return Statement(self, self.sql(self.dialect.now_sql), {}, database_ms, False)

    def database_now(self) -> int:
        """The database server's clock in ms since the epoch (one round trip)."""
        return self.run(self.database_now_statement())

    def decode_row(self, values: tuple[Any, ...]) -> StoredRow:
        """A row as stored, or MalformedRowError naming what is wrong with it."""
        return decode_row(self.dialect, values)

    def _event(self, values: tuple[Any, ...]) -> FencedEvent:
        return decode_event(self.dialect, values)

    def lookup_statement(self, principal: str, key: str) -> Statement[StoredRow | None]:
        return Statement(self, self.sql(LOOKUP), {"principal": principal, "key": key}, self._decode_first_row, False)

    def _decode_first_row(self, rows: Rows) -> StoredRow | None:
        return decode_row(self.dialect, rows[0]) if rows else None

    def lookup(self, principal: str, key: str) -> StoredRow | None:
        try:
            return self.run(self.lookup_statement(principal, key))
        except SchemaOutdatedError:
            # No key_id yet (an operator reading a ledger before `init`):
            # the key as stored, bare or as the header's sf-string.
            quoted = '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'
            params = {"principal": principal, "key": key, "quoted": quoted}
            return self.run(Statement(self, self.sql(LOOKUP_STORED), params, self._decode_first_row, False))

    # -- schema ---------------------------------------------------------------------
    def tables(self) -> frozenset[str]:
        """Which of idemctl's tables exist. Only a complete schema is
        remembered (idemctl never drops a table): while one is missing,
        every use looks again, because `idemctl init` in another process may
        have just created it. A current ledger pays nothing; an outdated one
        one catalog read per use, and only until it is upgraded."""
        if self._tables is not None:
            return self._tables
        return self.found_tables(self.engine.table_names(TABLES))

    @property
    def known_tables(self) -> frozenset[str] | None:
        """The tables of a complete schema once found; None until then."""
        return self._tables

    def found_tables(self, found: Collection[str]) -> frozenset[str]:
        """Which tables a look-up found; remembered once the schema is complete."""
        tables = frozenset(found)
        if len(tables) == len(TABLES):
            self._tables = tables
        return tables

    def forget_schema(self) -> None:
        """Look the tables up again at next use (another process may have run init)."""
        self._tables = None

    def has_fenced_log(self) -> bool:
        return FENCED_TABLE in self.tables()

    def schema_version(self) -> int | None:
        """None: no ledger table; 0: the recipe's table only; N: idemctl schema N."""
        self.forget_schema()
        tables = self.tables()
        return version_in(tables, self._read(VERSION) if reads_version(tables) else [])

    def check_not_newer(self) -> None:
        """Refuse a ledger written by a newer idemctl before writing to it."""
        self.version_checked(self.schema_version())

    def version_checked(self, version: int | None) -> None:
        """The ledger's schema version was read (`version_in`): refuse one
        written by a newer idemctl; a ledger that has one is not checked again."""
        if version is not None and version > SCHEMA_VERSION:
            raise SchemaTooNewError(self.describe(), version, SCHEMA_VERSION)
        self._checked = version is not None

    @property
    def schema_checked(self) -> bool:
        """Whether the schema guard has passed (it runs before the first write)."""
        return self._checked

    def _guard(self) -> None:
        # Once per store (and so per process), before its first write.
        if not self._checked:
            self.check_not_newer()

    def init(self, now: int, dry_run: bool) -> InitResult:
        """Create or upgrade the schema in one transaction that the engine
        serialises against other inits; an up-to-date schema is only read."""
        # Read first: an up-to-date ledger needs no transaction, and behind a
        # pooler in statement mode there is none to have, so an app that calls
        # init() at every start starts there. A schema is never downgraded, so
        # what this read found up to date stays so.
        current = self.schema_version()
        if current is not None and current >= SCHEMA_VERSION:
            self.version_checked(current)
            return InitResult(InitAction.UP_TO_DATE, current, SCHEMA_VERSION, dry_run)

        def decide(tx: SchemaTx) -> InitResult:
            tables = tx.table_names(TABLES)
            before = version_in(tables, tx.execute(self.sql(VERSION), {}) if reads_version(tables) else [])
            if before is not None and before > SCHEMA_VERSION:
                raise SchemaTooNewError(self.describe(), before, SCHEMA_VERSION)
            if before == SCHEMA_VERSION:
                return InitResult(InitAction.UP_TO_DATE, before, SCHEMA_VERSION, dry_run)
            action = InitAction.CREATED if before is None else InitAction.UPGRADED
            if before == 0:
                tx.check_recipe_table()
            if dry_run:
                if before is not None and before < KEY_ID_VERSION and self._key_stored_twice(tx):
                    raise KeyStoredTwiceError(self.describe())
                return InitResult(action, before, SCHEMA_VERSION, dry_run)
            floor = -1 if before is None else before
            for f in schema_files(self.dialect.schema_folder):
                if f.version > floor:
                    try:
                        tx.script(f.sql)
                    except Exception as exc:  # the engine's own error: it translates the rest
                        if f.version == KEY_ID_VERSION and _duplicate(exc):
                            raise KeyStoredTwiceError(self.describe()) from exc
                        raise
            mine = tx.execute(self.sql(INSERT_VERSION), {"version": SCHEMA_VERSION, "now": now})
            if not mine:
                # Another init decided from the same state and committed first
                # (with no version table there was nothing to lock); our
                # IF NOT EXISTS DDL did nothing. Whoever inserted the row did the work.
                return InitResult(InitAction.UP_TO_DATE, SCHEMA_VERSION, SCHEMA_VERSION, dry_run)
            return InitResult(action, before, SCHEMA_VERSION, dry_run)

        result = self.engine.migrate(decide, write=not dry_run)
        self.forget_schema()
        return result

    def _key_stored_twice(self, tx: SchemaTx) -> bool:
        """Whether two rows of one principal name the same key (`key_id`),
        which the upgrade to schema 3's unique index would refuse."""
        seen: set[tuple[str, str]] = set()
        bare: list[tuple[str, str]] = []
        for principal, stored in tx.execute(self.sql(QUOTED_KEYS), {}):
            named = (_text(principal), key_id(_text(stored)))
            if named in seen:
                return True
            seen.add(named)
            if not named[1].startswith('"'):  # also the key of a row that holds it bare
                bare.append(named)
        for at in range(0, len(bare), _PAIRS_AT_ONCE):
            chunk = bare[at : at + _PAIRS_AT_ONCE]
            pairs = " OR ".join(f"(principal = :p{i} AND key = :k{i})" for i in range(len(chunk)))
            params = {name: value for i, (p, k) in enumerate(chunk) for name, value in ((f"p{i}", p), (f"k{i}", k))}
            if tx.execute(self.sql(f"SELECT 1 FROM idempotency_keys WHERE {pairs} LIMIT 1"), params):
                return True
        return False
