"""Copying a ledger into another, on any engine: every row with its
generation, token, timestamps and stored answer, and the fenced-out log.

The source is only read, a page at a time in primary-key order. Each page
is compared with the destination's rows of the same keys (one read), and
only what differs is written, gathered up to a batch: absent rows in one
insert-if-absent statement, older versions in one guarded UPDATE (one a
row on engines without arrays; on MariaDB/MySQL, which lack RETURNING, one
statement a row for both, each answering through its affected-row count). The statements' own conflict clause and
WHERE decide row by row, so a row the destination holds in a newer version
is never overwritten, whatever happened since it was read. Running the copy
again writes only what changed since; with nothing changed it writes
nothing."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import SchemaMissingError, SchemaOutdatedError, StorageError
from ..fingerprint import stored_key_identity
from ..outcomes import FencedEvent, Status
from ..schema import SCHEMA_VERSION
from ..storage.store import LedgerRow, Store

DEFAULT_COPY_BATCH = 500
# Rows per page, and so per insert statement: 11 parameters a row stays well
# under every engine's limit on parameters in one statement.
MAX_COPY_BATCH = 2000


class KeptReason(enum.Enum):
    """Why the destination's version of a row was kept."""

    HIGHER_GENERATION = "the destination's row has a higher generation (taken over there)"
    COMPLETED = "the destination's row is completed; the source's is still pending at the same generation"
    WRITTEN_LATER = "the destination's row was written later at the same generation"
    SAME_AGE = "the rows differ at the same generation, status and time; the destination's is kept"
    OTHER_FORM = (
        "the destination holds this key in its other form (with or without the sf-string quotes); "
        "the destination's row is kept"
    )


@dataclass(frozen=True)
class KeptRow:
    """A row whose destination version is not older than the source's, and differs."""

    principal: str
    key: str
    reason: KeptReason
    source_generation: int
    destination_generation: int


@dataclass(frozen=True)
class CopyConflict:
    """The same key holds a different request in each ledger: not copied."""

    principal: str
    key: str
    source_fingerprint: str
    destination_fingerprint: str


@dataclass(frozen=True)
class CopyProgress:
    """How far a copy has got, after each page."""

    rows_read: int
    fenced_read: int


@dataclass(frozen=True)
class CopyResult:
    """What a copy did (or, with `dry_run`, would do).

    `copied` rows were inserted or brought up to date in the destination;
    `unchanged` ones were already equal there; `kept` lists rows whose
    destination version is newer (never overwritten); `conflicts` lists keys
    that hold another request in the destination (never overwritten: a copy
    with conflicts has not finished its job)."""

    source: str
    destination: str
    dry_run: bool
    rows_read: int
    inserted: int
    updated: int
    unchanged: int
    kept: tuple[KeptRow, ...]
    conflicts: tuple[CopyConflict, ...]
    fenced_read: int
    fenced_copied: int
    fenced_unchanged: int

    @property
    def copied(self) -> int:
        return self.inserted + self.updated

    @property
    def kept_newer(self) -> int:
        return len(self.kept)

    @property
    def complete(self) -> bool:
        """Every source row is in the destination, in this or a newer version."""
        return not self.conflicts


def source_is_newer(source: LedgerRow, destination: LedgerRow) -> bool:
    """Whether the source's version of a request supersedes the destination's:
    a higher generation; or the same one, completed over pending; or the same
    one and status, written later. Store.COPY_UPDATE's WHERE says the same.

    >>> row = LedgerRow("acct", "k", "fp", "pending", 1, 7, None, None, None, 1000, 1000)
    >>> done = row._replace(status="completed", response_status=201, updated_at=1500)
    >>> source_is_newer(done, row), source_is_newer(row, done)
    (True, False)
    """
    if source.generation != destination.generation:
        return source.generation > destination.generation
    if source.status != destination.status:
        return source.status == Status.COMPLETED.value and destination.status == Status.PENDING.value
    return source.updated_at > destination.updated_at


def _kept_reason(source: LedgerRow, destination: LedgerRow) -> KeptReason:
    if destination.generation > source.generation:
        return KeptReason.HIGHER_GENERATION
    if destination.status != source.status:
        return KeptReason.COMPLETED
    if destination.updated_at > source.updated_at:
        return KeptReason.WRITTEN_LATER
    return KeptReason.SAME_AGE


class _Tally:
    def __init__(self) -> None:
        self.rows_read = self.inserted = self.updated = self.unchanged = 0
        self.fenced_read = self.fenced_copied = self.fenced_unchanged = 0
        self.kept: list[KeptRow] = []
        self.conflicts: list[CopyConflict] = []

    def settle(self, source: LedgerRow, destination: LedgerRow) -> bool:
        """Count a row the destination already holds; True when it should be written."""
        if source.fingerprint != destination.fingerprint:
            self.conflicts.append(
                CopyConflict(source.principal, source.key, source.fingerprint, destination.fingerprint)
            )
        elif source == destination:
            self.unchanged += 1
        elif source_is_newer(source, destination):
            return True
        else:
            reason = _kept_reason(source, destination)
            self.kept.append(KeptRow(source.principal, source.key, reason, source.generation, destination.generation))
        return False


def _check_ready(source: Store, destination: Store) -> bool:
    """Whether the source has tokens to copy; refuses what cannot be copied."""
    if source.engine is destination.engine or source.describe() == destination.describe() != ":memory:":
        raise StorageError(f"cannot copy {source.describe()} onto itself")
    version = source.schema_version()
    if version is None:
        raise SchemaMissingError(source.describe())
    target = destination.schema_version()
    if target is None:
        raise SchemaMissingError(destination.describe())
    if target < SCHEMA_VERSION:
        raise SchemaOutdatedError(destination.describe())
    destination.check_not_newer()
    # The token column arrived in schema version 2; older rows carry none.
    return version >= 2


def copy_ledger(
    source: Store,
    destination: Store,
    *,
    batch: int = DEFAULT_COPY_BATCH,
    dry_run: bool = False,
    on_progress: Callable[[CopyProgress], object] | None = None,
) -> CopyResult:
    """Copy every row and fenced-out event of `source` into `destination`
    (both initialised; the destination at the current schema). See the
    module's docstring; Ledger.copy_to is the public way in.

    >>> from idemctl.storage import open_engine
    >>> a, b = Store(open_engine(":memory:")), Store(open_engine(":memory:"))
    >>> _ = a.init(0, dry_run=False), b.init(0, dry_run=False)
    >>> a.claim("acct", "k", "fp", 7, 1000)
    1
    >>> copy_ledger(a, b).inserted, copy_ledger(a, b).unchanged
    (1, 1)
    """
    if not 1 <= batch <= MAX_COPY_BATCH:
        raise ValueError(f"batch must be 1 to {MAX_COPY_BATCH} rows, got {batch}")
    with_token = _check_ready(source, destination)
    tally = _Tally()
    after: tuple[str, str] | None = None
    # Rows to write are gathered over pages up to a batch, so that a pass
    # where few rows changed (the paused one of a cutover) writes them in a
    # few statements, not in one commit per page that holds one of them.
    absent: list[LedgerRow] = []
    newer: list[LedgerRow] = []
    while True:
        page = source.copy_page(after, batch, with_token=with_token)
        if page:
            after = page[-1].where
            tally.rows_read += len(page)
            _compare(page, destination, tally, absent, newer)
        if absent and (len(absent) + len(newer) >= batch or not page):
            _write(absent, destination, tally, dry_run, insert=True)
            absent = []
        if newer and (len(newer) >= batch or not page):
            _write(newer, destination, tally, dry_run, insert=False)
            newer = []
        if not page:
            break
        if on_progress is not None:
            on_progress(CopyProgress(tally.rows_read, tally.fenced_read))
    last_id = 0
    while True:
        events = source.fenced_page(last_id, batch)
        if not events:
            break
        last_id = events[-1].id
        tally.fenced_read += len(events)
        _copy_events(events, destination, tally, dry_run)
        if on_progress is not None:
            on_progress(CopyProgress(tally.rows_read, tally.fenced_read))
    return CopyResult(
        source=source.describe(),
        destination=destination.describe(),
        dry_run=dry_run,
        rows_read=tally.rows_read,
        inserted=tally.inserted,
        updated=tally.updated,
        unchanged=tally.unchanged,
        kept=tuple(tally.kept),
        conflicts=tuple(tally.conflicts),
        fenced_read=tally.fenced_read,
        fenced_copied=tally.fenced_copied,
        fenced_unchanged=tally.fenced_unchanged,
    )


def _compare(
    page: Sequence[LedgerRow], destination: Store, tally: _Tally, absent: list[LedgerRow], newer: list[LedgerRow]
) -> None:
    """Sort a page against the destination's rows of the same keys (one read):
    absent rows and newer versions are added to the lists; the rest counted."""
    present = destination.rows_at([row.where for row in page])
    for row in page:
        there = present.get(row.where)
        if there is None:
            absent.append(row)
        elif tally.settle(row, there):
            newer.append(row)


def _write(rows: list[LedgerRow], destination: Store, tally: _Tally, dry_run: bool, *, insert: bool) -> None:
    """Insert the absent rows, or bring the older ones up to date, each in one
    statement that decides row by row; look again at any row it refused."""
    if dry_run:
        if insert:
            tally.inserted += len(rows)
        else:
            tally.updated += len(rows)
        return
    again: list[LedgerRow] = []
    if insert:
        inserted = destination.copy_insert(rows)
        tally.inserted += len(inserted)
        # Rows that appeared in the destination since the read: decide again
        # against what is there now.
        late = [row for row in rows if row.where not in inserted]
        now_there = destination.rows_at([row.where for row in late])
        newer = [row for row in late if row.where in now_there and tally.settle(row, now_there[row.where])]
        again += [row for row in late if row.where not in now_there]
    else:
        newer = rows
    updated = destination.copy_update(newer)
    tally.updated += len(updated)
    # Refused by the UPDATE's WHERE, or gone again since: look once more.
    again += [row for row in newer if row.where not in updated]
    for row in again:
        _write_newer(row, destination, tally)


# A row whose statement was refused is looked at again this many times (the
# destination is being written meanwhile) before it is left to the next run.
_RETRIES = 3


def _write_newer(row: LedgerRow, destination: Store, tally: _Tally) -> None:
    """A row whose UPDATE refused it: the destination's row changed since it
    was read. Decide again against what is there now."""
    for attempt in range(_RETRIES):
        if attempt and destination.copy_update([row]):
            tally.updated += 1
            return
        current = destination.rows_at([row.where]).get(row.where)
        if current is None:
            if destination.copy_insert([row]):
                tally.inserted += 1
                return
            continue
        if not tally.settle(row, current):
            return
    current = destination.rows_at([row.where]).get(row.where)
    if current is None:
        # Not there under this stored key, yet the insert is refused every
        # time: the same key_id holds it ("k" and k are one key).
        held = destination.lookup(row.principal, stored_key_identity(row.key))
        generation = 0 if held is None else held.generation
        tally.kept.append(KeptRow(row.principal, row.key, KeptReason.OTHER_FORM, row.generation, generation))
        return
    tally.kept.append(KeptRow(row.principal, row.key, KeptReason.WRITTEN_LATER, row.generation, current.generation))


def _copy_events(events: Sequence[FencedEvent], destination: Store, tally: _Tally, dry_run: bool) -> None:
    for event in events:
        fresh = not destination.has_event(event) if dry_run else destination.copy_fenced(event)
        if fresh:
            tally.fenced_copied += 1
        else:
            tally.fenced_unchanged += 1
