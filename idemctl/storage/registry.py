"""The engines idemctl knows: which one a ledger's location names, how it is
built, which store runs over it, and what it can do. Every engine-specific
name lives under `idemctl/storage/`; the rest of the package (CLI,
operations, ledger, adapters) asks this module, never a scheme string.

An engine is described by one :class:`EngineKind` and added with
:func:`register` (the built-in kinds are registered at the end of this
module: SQLite, PostgreSQL, MariaDB/MySQL, Cloudflare D1, Redis). Its fields:

- ``name``: the kind's name, equal to its engine's ``dialect.name``
  (``"sqlite"``, ``"postgres"``, ``"mysql"``); :func:`engine_kind` finds a
  kind from an open engine by it, so a non-SQL engine too has a
  ``dialect`` whose ``name`` is its kind's. Its modules under storage/ are
  named for it (the boundary test knows an engine's modules by that).
- ``title``: how messages name it (``"PostgreSQL"``, ``"MariaDB/MySQL"``).
- ``locations``: which locations are its own, a :class:`Locations`:

  - ``schemes``: its URL schemes, without ``://`` (``("postgresql", "postgres")``);
    the first is the one messages show. Matched case-sensitively at the start
    of a string location.
  - ``described``: how a message describes them (``"a mysql:// URL"``).
  - ``recognises``: a predicate for locations that carry none of its schemes
    (PostgreSQL: a libpq ``host=… dbname=…`` string); ``locate`` turns such a
    location into what the engine class is given (that string's URL).
  - ``fallback``: the kind of every location no other kind claims and that is
    no URL (SQLite: a file path, ``":memory:"``, any ``os.PathLike``). One kind
    at most; it is tried last.

- ``engine``: ``"module:Class"`` of the engine, imported on first use. The
  class is called ``Class(location, readonly=..., busy_timeout_ms=...)``
  (and ``options=SqliteOptions`` when ``sqlite_options``); it connects to
  nothing before its first statement when its ``server`` capability is True.
- ``extra``: the ``pip install 'idemctl[extra]'`` that brings its driver, named
  in the error when importing ``engine`` fails; None when the driver ships
  with Python.
- ``store``: ``"module:Class"`` of the store built over the engine by
  :func:`open_store` (default the SQL :class:`~idemctl.storage.store.Store`).
  A non-SQL engine brings a store class of its own with the same vocabulary
  (the Store's methods and operation builders, ``check_not_newer``,
  ``close``), called ``Class(engine)``.
- ``missing_database``: whether an error from opening may mean that the
  database the URL names is not there (default: a LedgerNotFoundError).
- ``capabilities``: a :class:`Capabilities`, each a promise about the engine class:

  - ``server``: nothing connects at open (a URL); False: a file, whose schema
    is checked at open (:func:`open_store` calls ``store.check_not_newer()``).
  - ``native_async``: the engine has ``open_async()``, an asynchronous engine
    for :class:`~idemctl.storage.aio.AsyncStore` (else the asynchronous
    path runs the synchronous one in worker threads).
  - ``creates_database``: the engine has ``create_database()`` returning a
    :class:`~idemctl.storage.capabilities.DatabaseCreated` or raising
    :class:`~idemctl.storage.capabilities.DatabaseNotCreatedError`.
  - ``replicates``: the engine has ``failover_facts()`` returning a value that
    follows :class:`~idemctl.storage.failover.FailoverFacts`; a kind that
    does not is described by :class:`~idemctl.storage.failover.SingleHost`.
  - ``readonly_reaches_writer``: a read-only opening reaches the server the
    request path writes to (False for PostgreSQL, where a multi-host URL
    opened read-only may land on a standby).

The functions (all re-exported by :mod:`idemctl.storage`):

- ``register(kind) -> EngineKind``: add a kind, or replace the one of the
  same name in its place; a scheme another kind has, or a second fallback,
  is a StorageError. Kinds are tried in registration order, the fallback last.
- ``kinds() -> tuple[EngineKind, ...]``, in that order;
  ``kind_named(name)``; ``engine_kind(engine)``, by ``engine.dialect.name``.
- ``kind_of(target) -> EngineKind``: the kind of a location (a ``str`` or
  ``os.PathLike``); a URL no kind knows, or no location at all, is a
  StorageError whose message lists what is accepted.
- ``is_file_location(target) -> bool`` (never raises) and
  ``accepted_urls() -> str``, for messages and hints.
- ``open_engine(target, *, readonly=False, busy_timeout_ms=5000,
  sqlite=SQLITE_DEFAULTS) -> Engine`` and ``open_store(...)`` with the same
  arguments, the kind's store over it.
- The capability queries, which callers use instead of looking for a method:
  ``create_database(target, *, busy_timeout_ms=5000) -> DatabaseCreated |
  None`` (None: the kind creates none), ``database_missing(target, exc)``,
  ``failover_facts(engine) -> FailoverFacts``, ``async_opener(engine)`` (the
  engine's ``open_async`` or None) and ``reads_where_it_writes(target)``.

>>> kind_of("postgresql://app@db/payments").title, kind_of("ledger.db").name
('PostgreSQL', 'sqlite')
>>> kind_of("host=db dbname=payments").name, kind_of("mariadb://app@db/x").title
('postgres', 'MariaDB/MySQL')
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ..errors import ConnectionFailedError, LedgerNotFoundError, StorageError
from ..policy import DEFAULT_BUSY_TIMEOUT_MS
from .capabilities import CreatesDatabase, DatabaseCreated, OpensAsync, ReadsFailoverFacts
from .failover import FailoverFacts, SingleHost
from .locations import dsn_url, keyword_dsn
from .sqlite.options import SQLITE_DEFAULTS, SqliteOptions

if TYPE_CHECKING:
    from .engine import Engine
    from .store import Store


def _not_found(exc: BaseException) -> bool:
    return isinstance(exc, LedgerNotFoundError)


@dataclass(frozen=True)
class Locations:
    """Which ledger locations are an engine kind's, and how messages
    describe them (the module's docstring says what each field promises).

    >>> Locations(("mysql", "mariadb"), "a mysql:// URL").claims("mariadb://app@db/x")
    True
    """

    schemes: tuple[str, ...]
    described: str
    recognises: Callable[[str], bool] | None = None
    locate: Callable[[str], str] | None = None
    fallback: bool = False

    def claims(self, target: str) -> bool:
        """Whether the string location `target` is one of these."""
        if any(target.startswith(f"{scheme}://") for scheme in self.schemes):
            return True
        return self.recognises is not None and self.recognises(target)


@dataclass(frozen=True)
class Capabilities:
    """What an engine class promises beyond running statements (the
    module's docstring says each); the defaults are a server that has none.

    >>> Capabilities(replicates=True).server
    True
    """

    server: bool = True
    native_async: bool = False
    creates_database: bool = False
    replicates: bool = False
    readonly_reaches_writer: bool = True


@dataclass(frozen=True)
class EngineKind:
    """One engine idemctl can open (the module's docstring says what each
    field promises).

    >>> kind_named("mysql").locations.schemes
    ('mysql', 'mariadb')
    """

    name: str
    title: str
    locations: Locations
    engine: str
    extra: str | None = None
    store: str = "idemctl.storage.store:Store"
    sqlite_options: bool = False
    missing_database: Callable[[BaseException], bool] = _not_found
    capabilities: Capabilities = Capabilities()

    def engine_class(self) -> Callable[..., Engine]:
        """The engine class, imported now; a missing driver is a StorageError
        naming the extra that brings it."""
        try:
            built: Callable[..., Engine] = _imported(self.engine)
        except ImportError as exc:
            if self.extra is None:
                raise
            raise StorageError(
                f"{self.title} support needs the driver: pip install 'idemctl[{self.extra}]' ({exc.name} is missing)"
            ) from exc
        return built


def _imported(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


_KINDS: dict[str, EngineKind] = {}


def register(kind: EngineKind) -> EngineKind:
    """Add `kind` (or replace the kind of the same name, in its place);
    kinds are tried in the order they were first registered, the fallback
    kind last. Returns `kind`.

    >>> register(kind_named("sqlite")) is kind_named("sqlite")
    True
    """
    if kind.locations.fallback and any(k.locations.fallback and k.name != kind.name for k in _KINDS.values()):
        raise StorageError(f"engine kind {kind.name}: another kind is the fallback already")
    taken = {s: k.name for k in _KINDS.values() if k.name != kind.name for s in k.locations.schemes}
    clashing = sorted(s for s in kind.locations.schemes if s in taken)
    if clashing:
        raise StorageError(f"engine kind {kind.name}: scheme {clashing[0]}:// is {taken[clashing[0]]}'s already")
    _KINDS[kind.name] = kind
    return kind


def kinds() -> tuple[EngineKind, ...]:
    """Every registered kind, in the order locations are tried."""
    ordered = sorted(_KINDS.values(), key=lambda k: k.locations.fallback)
    return tuple(ordered)


def kind_named(name: str) -> EngineKind:
    """The kind called `name` (its engine's dialect name)."""
    try:
        return _KINDS[name]
    except KeyError:
        raise StorageError(f"no engine kind named {name!r}") from None


def engine_kind(engine: object) -> EngineKind:
    """The kind of an open engine, by its ``dialect.name``.

    >>> engine_kind(open_engine(":memory:")).title
    'SQLite'
    """
    return kind_named(getattr(getattr(engine, "dialect", None), "name", ""))


def _find(target: str | os.PathLike[str]) -> EngineKind | None:
    """The kind claiming `target`; None for a URL no kind knows."""
    fallback = next((k for k in _KINDS.values() if k.locations.fallback), None)
    if not isinstance(target, str):
        return fallback
    for kind in kinds():
        if not kind.locations.fallback and kind.locations.claims(target):
            return kind
    return None if "://" in target else fallback


def kind_of(target: str | os.PathLike[str]) -> EngineKind:
    """The kind of the ledger at `target`; a URL of no registered kind, or
    a target that is no location at all, is a StorageError."""
    if not isinstance(target, (str, os.PathLike)):
        raise StorageError(
            f"a ledger is {_or_join([k.locations.described for k in _described()])}, got {type(target).__name__}"
        )
    kind = _find(target)
    if kind is None:
        assert isinstance(target, str)
        scheme = target.split("://", 1)[0]
        shown = [
            k.locations.described if k.locations.fallback else f"{k.locations.schemes[0]}://" for k in _described()
        ]
        raise StorageError(f"unsupported ledger URL {scheme}://…: use {_plain_join(shown)}")
    if kind.locations.fallback and isinstance(target, str) and (typo := _mistyped_scheme(target)) is not None:
        raise StorageError(typo)
    return kind


def _mistyped_scheme(target: str) -> str | None:
    """Why `target`, which begins with a registered scheme but not its
    ``://`` (``postgresql:/db/x``), is a bad URL rather than a file path
    (where `init` would make a directory named after the scheme); None for
    any other target. The rest is not echoed: it may hold a password.

    >>> _mistyped_scheme("postgresql:/app@db/payments")
    "bad ledger URL: it begins with 'postgresql:/', and a PostgreSQL URL begins with 'postgresql://'"
    >>> _mistyped_scheme("postgresql://app@db/payments"), _mistyped_scheme("ledger.db")
    (None, None)
    """
    head, colon, rest = target.partition(":")
    if not colon or rest.startswith("//"):
        return None
    kind = next((k for k in kinds() if head.lower() in k.locations.schemes), None)
    if kind is None:
        return None
    given = f"{head}:{'/' if rest.startswith('/') else ''}"
    return f"bad ledger URL: it begins with {given!r}, and a {kind.title} URL begins with '{head.lower()}://'"


def _described() -> list[EngineKind]:
    """The kinds in the order messages list them: the fallback (a file) first."""
    return sorted(_KINDS.values(), key=lambda k: not k.locations.fallback)


def _or_join(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + f"{',' if len(words) > 2 else ''} or {words[-1]}"


def _plain_join(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + f" or {words[-1]}"


def accepted_urls() -> str:
    """The URLs of the server kinds, as a message lists them (each kind's
    first scheme, in registration order).

    >>> accepted_urls()
    'a postgresql://, a mysql://, a d1:// or a redis:// URL'
    """
    shown = [f"a {k.locations.schemes[0]}://" for k in kinds() if k.capabilities.server and k.locations.schemes]
    return f"{_plain_join(shown)} URL" if shown else "no URL"


def is_file_location(target: str | os.PathLike[str]) -> bool:
    """Whether `target` names a file (the fallback kind's, and no URL):
    what a missing directory, file permissions and read-only mounts are
    about. Never raises.

    >>> is_file_location("/srv/ledger.db"), is_file_location("mysql://app@db/x"), is_file_location("x://y")
    (True, False, False)
    """
    if isinstance(target, str) and "://" in target:
        return False
    kind = _find(target) if isinstance(target, (str, os.PathLike)) else None
    return kind is not None and kind.locations.fallback


def open_engine(
    target: str | os.PathLike[str],
    *,
    readonly: bool = False,
    busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
    sqlite: SqliteOptions = SQLITE_DEFAULTS,
) -> Engine:
    """The engine of the ledger at `target`, built by its kind; `sqlite`
    holds what only a SQLite file has (a server URL ignores it).

    >>> open_engine(":memory:").dialect.name
    'sqlite'
    """
    kind = kind_of(target)
    build = kind.engine_class()
    location: str | os.PathLike[str] = target
    locate = kind.locations.locate
    if locate is not None and isinstance(target, str):
        location = locate(target)
    elif kind.capabilities.server:
        location = str(target)
    if kind.sqlite_options:
        return build(location, readonly=readonly, busy_timeout_ms=busy_timeout_ms, options=sqlite)
    return build(location, readonly=readonly, busy_timeout_ms=busy_timeout_ms)


def open_store(
    target: str | os.PathLike[str],
    *,
    readonly: bool = False,
    busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
    sqlite: SqliteOptions = SQLITE_DEFAULTS,
) -> Store:
    """The store of the ledger at `target`: its kind's store class over its
    engine. A file's schema is checked at open (it costs no connection): a
    ledger written by a newer idemctl is refused before any use.

    >>> open_store(":memory:").describe()
    ':memory:'
    """
    kind = kind_of(target)
    engine = open_engine(target, readonly=readonly, busy_timeout_ms=busy_timeout_ms, sqlite=sqlite)
    try:
        store: Store = _imported(kind.store)(engine)
        if not kind.capabilities.server:
            store.check_not_newer()
    except BaseException:
        engine.close()
        raise
    return store


# -- capabilities ------------------------------------------------------------------------


def create_database(target: str, *, busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS) -> DatabaseCreated | None:
    """Create the server database `target` names, as its role; None for a
    kind that cannot (a file). Raises DatabaseNotCreatedError, carrying the
    command an administrator runs instead, when the role may not.

    >>> create_database("ledger.db") is None
    True
    """
    kind = kind_of(target)
    if not kind.capabilities.creates_database:
        return None
    engine = open_engine(target, busy_timeout_ms=busy_timeout_ms)
    try:
        result = cast(CreatesDatabase, engine).create_database()
    finally:
        engine.close()
    return result


def database_missing(target: str, exc: BaseException) -> bool:
    """Whether `exc`, raised opening the ledger at `target`, may mean that
    the server database it names is not there (MariaDB tells a user with no
    privilege on a database that does not exist "access denied to
    database", not "unknown database").

    >>> database_missing("mysql://app@db/x", ConnectionFailedError("Access denied for user 'app' to database 'x'"))
    True
    >>> database_missing("postgresql://app@db/x", ConnectionFailedError("Access denied to database 'x'"))
    False
    """
    return kind_of(target).missing_database(exc)


def failover_facts(engine: object) -> FailoverFacts:
    """What the engine reads of its replication (`doctor`); for a kind that
    does not replicate, its :class:`SingleHost` facts.

    >>> failover_facts(open_engine(":memory:")).product
    'SQLite'
    """
    kind = engine_kind(engine)
    if kind.capabilities.replicates:
        return cast(ReadsFailoverFacts, engine).failover_facts()
    return SingleHost(kind.title, file=not kind.capabilities.server)


def async_opener(engine: object) -> Callable[[], Any] | None:
    """The engine's ``open_async`` when its kind has a native asynchronous
    path; None when the asynchronous path runs in worker threads.

    >>> async_opener(open_engine(":memory:")) is None
    True
    """
    if not engine_kind(engine).capabilities.native_async:
        return None
    return cast(OpensAsync, engine).open_async


def reads_where_it_writes(target: str | os.PathLike[str]) -> bool:
    """Whether a read-only opening of `target` reaches the server the
    request path writes to (False on PostgreSQL: a multi-host URL opened
    read-only may reach a standby).

    >>> reads_where_it_writes("ledger.db"), reads_where_it_writes("postgresql://db1,db2/payments")
    (True, False)
    """
    return kind_of(target).capabilities.readonly_reaches_writer


# -- the built-in kinds ------------------------------------------------------------------


def _is_keyword_dsn(target: str) -> bool:
    return keyword_dsn(target) is not None


def _dsn_as_url(target: str) -> str:
    """A libpq connection string as the postgresql:// URL it stands for (a URL as it is)."""
    pairs = keyword_dsn(target)
    return dsn_url(pairs) if pairs is not None else target


def _mysql_database_missing(exc: BaseException) -> bool:
    return isinstance(exc, LedgerNotFoundError) or (
        isinstance(exc, ConnectionFailedError) and "to database" in str(exc)
    )


SQLITE_KIND = register(
    EngineKind(
        name="sqlite",
        title="SQLite",
        locations=Locations((), "a file path", fallback=True),
        engine="idemctl.storage.sqlite:SqliteEngine",
        sqlite_options=True,
        capabilities=Capabilities(server=False),
    )
)
POSTGRES_KIND = register(
    EngineKind(
        name="postgres",
        title="PostgreSQL",
        locations=Locations(
            ("postgresql", "postgres"),
            "a postgresql:// URL or connection string",
            recognises=_is_keyword_dsn,
            locate=_dsn_as_url,
        ),
        engine="idemctl.storage.postgres:PostgresEngine",
        extra="postgres",
        capabilities=Capabilities(
            native_async=True, creates_database=True, replicates=True, readonly_reaches_writer=False
        ),
    )
)
MYSQL_KIND = register(
    EngineKind(
        name="mysql",
        title="MariaDB/MySQL",
        locations=Locations(("mysql", "mariadb"), "a mysql:// URL"),
        engine="idemctl.storage.mysql:MysqlEngine",
        extra="mysql",
        missing_database=_mysql_database_missing,
        capabilities=Capabilities(creates_database=True, replicates=True),
    )
)
D1_KIND = register(
    EngineKind(
        name="d1",
        title="Cloudflare D1",
        locations=Locations(("d1",), "a d1://ACCOUNT_ID/DATABASE_ID URL"),
        engine="idemctl.storage.d1:D1Engine",
        extra="d1",
        # Its facts for doctor are the token's reach, a call's latency and
        # the schema: Cloudflare runs the replication (docs/d1.md).
        capabilities=Capabilities(replicates=True),
    )
)
# Redis (and Valkey, wire-compatible): a store of its own, whose steps are
# Lua scripts (storage/redis/); a cluster is recognised from any node's URL.
REDIS_KIND = register(
    EngineKind(
        name="redis",
        title="Redis",
        locations=Locations(("redis", "rediss", "redis+sentinel", "rediss+sentinel"), "a redis:// URL"),
        engine="idemctl.storage.redis.engine:RedisEngine",
        extra="redis",
        store="idemctl.storage.redis.store:RedisStore",
        capabilities=Capabilities(native_async=True, replicates=True),
    )
)
