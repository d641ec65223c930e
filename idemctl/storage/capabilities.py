"""The typed answers of what an engine can do beyond running statements,
for the kinds whose capability says so (storage/registry.py): creating the
database its URL names. (Its replication facts are in `failover/`; its
asynchronous path is `open_async`, see `aio.py`.)

An engine whose kind has ``creates_database`` has a ``create_database()``
method that returns a :class:`DatabaseCreated` or raises
:class:`DatabaseNotCreatedError`, which carries the command an
administrator runs instead: the caller (the CLI) only renders them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import StorageError
from .failover import FailoverFacts


@dataclass(frozen=True)
class DatabaseCreated:
    """The outcome of creating a server database: `where` the ledger (as
    shown, no password), `created` False when it was there already,
    `detail` what was chosen for it ("owner app", "character set utf8mb4").

    >>> DatabaseCreated("postgresql://app@db/payments", True, "owner app").describe()
    'postgresql://app@db/payments: created the database (owner app)'
    """

    where: str
    created: bool
    detail: str = ""

    def describe(self) -> str:
        if not self.created:
            return f"{self.where}: the database exists already"
        return f"{self.where}: created the database{f' ({self.detail})' if self.detail else ''}"


class DatabaseNotCreatedError(StorageError):
    """The database a URL names does not exist and its role could not create
    it. The message is the engine's (the server's reason included, no
    password); `command` is what `who` ("an administrator", "a role that
    may create databases") runs instead, as one shell line.

    >>> e = DatabaseNotCreatedError("cannot create it: denied", database="payments",
    ...                             command="createdb payments", who="an administrator")
    >>> str(e), e.command
    ('cannot create it: denied', 'createdb payments')
    """

    def __init__(self, message: str, *, database: str, command: str, who: str) -> None:
        super().__init__(message)
        self.database, self.command, self.who = database, command, who


# What an engine class has when its kind promises the capability
# (registry.py asks through these; `test_engine_registry.py` checks every
# registered kind's class against its promises).
class CreatesDatabase(Protocol):
    def create_database(self) -> DatabaseCreated: ...


class ReadsFailoverFacts(Protocol):
    def failover_facts(self) -> FailoverFacts: ...


class OpensAsync(Protocol):
    def open_async(self) -> Any:
        """An asynchronous engine for this loop (storage/aio.py's AsyncStore runs on it)."""


CAPABILITY_METHODS = {
    "creates_database": "create_database",
    "replicates": "failover_facts",
    "native_async": "open_async",
}
