"""Small typed values that the ledger returns: no dicts, no magic strings."""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass
from typing import TypeVar

C = TypeVar("C", bound=type)


def quick_init(cls: C) -> C:
    """Give a frozen dataclass built on every request an ``__init__`` that
    fills the instance in one step.

    A frozen dataclass's generated ``__init__`` sets each field through
    ``object.__setattr__``, one call per field; a request builds several of
    these values (about 45 fields in a first call), which made them a tenth
    of the ledger's own instructions. The replacement has the same
    signature, defaults and annotations; freezing, equality, hashing and
    repr stay the dataclass's own. Only for plain fields: no
    ``default_factory``, ``__post_init__``, ``InitVar`` or slots.

    >>> Reservation("acct_1", "k1", 1, "fp")
    Reservation(principal='acct_1', key='k1', generation=1, fingerprint='fp', token=None)
    """
    fields = dataclasses.fields(cls)
    if (
        hasattr(cls, "__post_init__")
        or "__slots__" in vars(cls)
        or any(not f.init or f.kw_only or f.default_factory is not dataclasses.MISSING for f in fields)
    ):
        raise TypeError(f"quick_init cannot build {cls.__name__}: only plain fields are supported")
    defaults = {f"_default_{f.name}": f.default for f in fields if f.default is not dataclasses.MISSING}
    params = ", ".join(f.name if f.default is dataclasses.MISSING else f"{f.name}=_default_{f.name}" for f in fields)
    assign = ", ".join(f"{f.name}={f.name}" for f in fields)
    namespace: dict[str, object] = dict(defaults)
    exec(f"def __init__(self, {params}):\n    self.__dict__.update({assign})\n", namespace)
    init = namespace["__init__"]
    generated = cls.__init__  # type: ignore[misc]
    init.__qualname__ = generated.__qualname__  # type: ignore[attr-defined]
    init.__annotations__ = generated.__annotations__
    init.__module__ = cls.__module__
    cls.__init__ = init  # type: ignore[misc]
    return cls


class Outcome(enum.Enum):
    """What `Ledger.handle` did with one request."""

    EXECUTED = "executed"  # won the claim, ran the mutation, stored its answer
    TAKEN_OVER = "taken_over"  # took over a stale reservation, ran, stored
    FENCED_OUT = "fenced_out"  # ran, but a takeover superseded us: answer not stored
    REPLAYED = "replayed"  # answered from the stored response, nothing ran
    IN_PROGRESS = "in_progress"  # 409: the reservation is pending and fresh
    REUSED = "reused"  # 409/422: same key, different request
    RETRY = "retry"  # 409: the row vanished between claim and lookup
    KEY_REQUIRED = "key_required"  # 400
    KEY_INVALID = "key_invalid"  # 400
    UNAUTHENTICATED = "unauthenticated"  # 401: no server-side principal
    PASSTHROUGH = "passthrough"  # unprotected method: ran without the ledger
    UNAVAILABLE = "unavailable"  # 503: the ledger could not be asked; nothing ran
    BODY_REFUSED = "body_refused"  # 400/411/413: the request body could not be read safely
    REQUEST_REFUSED = "request_refused"  # 414/400: a request target the ledger cannot take (too long, controls)
    FAILED = "failed"  # the mutation raised: the reservation waits for a takeover (or was released)
    NOT_KEPT = "not_kept"  # ran; Policy.keep_answer declined to store it, the reservation was released
    NOT_STORED = "not_stored"  # ran; storing its answer failed (AnswerNotStoredError)

    # Members are singletons, equal only to themselves: hashing them by
    # identity keeps `outcome in some_set` (asked for every answer, to see
    # whether anyone hears its event) free of Enum's __hash__, a Python call.
    __hash__ = object.__hash__

    @property
    def ran_mutation(self) -> bool:
        return self in (
            Outcome.EXECUTED,
            Outcome.TAKEN_OVER,
            Outcome.FENCED_OUT,
            Outcome.PASSTHROUGH,
            Outcome.FAILED,
            Outcome.NOT_KEPT,
            Outcome.NOT_STORED,
        )


@quick_init
@dataclass(frozen=True)
class Answer:
    """The HTTP answer to send; `wire` is `(status, headers, body)`.

    >>> status, headers, body = Answer(200, (("content-type", "text/plain"),), b"ok", Outcome.EXECUTED).wire
    >>> status, body
    (200, b'ok')
    """

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    outcome: Outcome
    generation: int | None = None
    # The `now` the request was decided at; the post-response sweep uses it.
    # None when the ledger was never consulted (400, 401, passthrough).
    started_at: int | None = None

    @property
    def wire(self) -> tuple[int, tuple[tuple[str, str], ...], bytes]:
        """What goes on the wire: equal for a first answer and its replays."""
        return self.status, self.headers, self.body

    def header(self, name: str) -> str | None:
        """The first value of a header, case-insensitively, or None."""
        lname = name.lower()
        for k, v in self.headers:
            if k.lower() == lname:
                return v
        return None


class Status(enum.StrEnum):
    """The ledger row's own `status` column."""

    PENDING = "pending"
    COMPLETED = "completed"


class State(enum.Enum):
    """A row's state as seen at one instant, derived from status, age and policy."""

    PENDING_FRESH = "pending_fresh"  # retries get 409 in progress
    PENDING_STALE = "pending_stale"  # the next retry takes it over
    COMPLETED = "completed"  # retries are replayed
    EXPIRED = "expired"  # past retention: waiting for the sweep, a retry runs again


@quick_init
@dataclass(frozen=True)
class Reservation:
    """Ownership of (principal, key), as returned by a claim or a takeover.

    ``generation`` counts the row's owners (1, then +1 per takeover) and is
    what operators see. ``token`` is the fencing token: a random 63-bit
    number drawn for every claim and every takeover and stored in the row.
    Completing or releasing needs both to match, so once a row is deleted
    (release, purge, sweep) and claimed again at generation 1, no earlier
    owner of that key can complete or release the new reservation.
    """

    principal: str
    key: str
    generation: int
    fingerprint: str
    token: int | None = None  # None only for a Reservation made by hand: it never matches a row


@quick_init
@dataclass(frozen=True)
class Ticket:
    """Leave to run the mutation once, from `Ledger.begin`: run it with
    ``body`` (the bytes the fingerprint covered), then `Ledger.finish`."""

    reservation: Reservation | None  # None: the method is not protected, nothing is stored
    outcome: Outcome  # EXECUTED, TAKEN_OVER or PASSTHROUGH
    body: bytes
    started_at: int | None  # the `now` of the claim; the post-response sweep uses it
    method: str = ""
    path: str = ""
    ledger_ms: float = 0.0  # time begin spent in ledger statements
    issued: float = 0.0  # time.perf_counter() when begin returned: the app's time starts here
    waited: bool = False  # begin waited on an in-progress duplicate first (Policy.in_progress_wait_ms)


@quick_init
@dataclass(frozen=True)
class Event:
    """One decision of the ledger, as listeners (`Ledger.subscribe`), the
    `idemctl.events` log and the Prometheus metrics see it.

    `ledger_ms` is the time spent in the ledger's own statements for this
    request (begin and finish together, and any in-progress wait); `app_ms`
    the time between them, the mutation's, or None when nothing ran.
    `waited` says the request first waited on an in-progress duplicate
    (`Policy.in_progress_wait_ms`), whatever it was then decided.
    """

    outcome: Outcome
    principal: str | None
    key: str | None
    generation: int | None
    method: str
    path: str
    status: int | None
    ledger_ms: float
    app_ms: float | None
    at: int  # the decision's `now`, ms since the epoch
    waited: bool = False


@quick_init
@dataclass(frozen=True)
class StoredRow:
    """One `idempotency_keys` row as stored."""

    principal: str
    key: str
    fingerprint: str
    status: Status
    generation: int
    response_status: int | None
    response_body: str | bytes | None  # TEXT when valid UTF-8, BLOB otherwise
    response_headers: str | None  # JSON object of the replayable headers
    created_at: int
    updated_at: int

    @property
    def body_bytes(self) -> bytes | None:
        if self.response_body is None:
            return None
        if isinstance(self.response_body, str):
            return self.response_body.encode("utf-8")
        return bytes(self.response_body)

    @property
    def headers(self) -> dict[str, str]:
        if not self.response_headers:
            return {}
        try:
            value = json.loads(self.response_headers)
        except ValueError:
            return {}
        return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}


@dataclass(frozen=True)
class RowView:
    """A row plus what it means right now, for operators.

    >>> from idemctl import Ledger
    >>> t = [0]; ledger = Ledger.open(":memory:", clock=lambda: t[0]); _ = ledger.init()
    >>> _ = ledger.claim("acct_1", "k1", "fp"); t[0] += 10_000
    >>> view = ledger.operator.get("acct_1", "k1")
    >>> view.state, view.age_ms, view.takeover_in_ms
    (<State.PENDING_FRESH: 'pending_fresh'>, 10000, 20001)
    """

    row: StoredRow
    state: State
    now: int
    pending_ttl_ms: int
    retention_ms: int

    @property
    def age_ms(self) -> int:
        """Time since the row was last written (claim, takeover or completion)."""
        return self.now - self.row.updated_at

    @property
    def takeovers(self) -> int:
        return self.row.generation - 1

    @property
    def takeover_at(self) -> int | None:
        """First instant at which a retry takes a pending row over (None if not pending)."""
        if self.row.status is not Status.PENDING:
            return None
        return self.row.updated_at + self.pending_ttl_ms + 1

    @property
    def takeover_in_ms(self) -> int | None:
        at = self.takeover_at
        return None if at is None else max(0, at - self.now)

    @property
    def takes_over_now(self) -> bool:
        """A stale reservation, whatever its age: the next retry takes it over.
        True in state PENDING_STALE, and for a pending row past retention
        (state EXPIRED) too."""
        return self.row.status is Status.PENDING and self.now - self.row.updated_at > self.pending_ttl_ms

    @property
    def replay_until(self) -> int | None:
        """Last instant a completed row is guaranteed to be replayed."""
        if self.row.status is not Status.COMPLETED:
            return None
        return self.row.updated_at + self.retention_ms

    @property
    def sweep_after(self) -> int:
        """From this instant on the sweep may delete the row."""
        return self.row.updated_at + self.retention_ms + 1


@quick_init
@dataclass(frozen=True)
class Completion:
    """Result of a fenced completion, with the answer built from what was (or
    would have been) stored."""

    stored: bool  # False: fenced out, the row belongs to a newer generation
    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    oversize: bool = False  # the body exceeded the cap: the 500 sentinel was stored
    event: FencedEvent | None = None


@dataclass(frozen=True)
class FencedEvent:
    """A late completion that the fencing token rejected."""

    id: int
    principal: str
    key: str
    superseded_generation: int
    current_generation: int | None
    computed_status: int
    fenced_at: int


@quick_init
@dataclass(frozen=True)
class SweepResult:
    """One bounded sweep batch."""

    keys_deleted: int
    fenced_deleted: int
    cutoff: int  # rows with updated_at < cutoff were eligible
    fenced_cutoff: int | None = None  # fenced-out events with fenced_at < this were eligible
    # Set when nothing was past retention: for this long nothing can be,
    # since rows and events only get newer. The per-request sweep rests.
    quiet_for_ms: int | None = None

    @property
    def deleted(self) -> int:
        return self.keys_deleted + self.fenced_deleted


class DrainStop(enum.Enum):
    """Why `Ledger.drain` stopped."""

    DRAINED = "drained"  # a batch deleted nothing: nothing is left past retention
    MAX_BATCHES = "max_batches"
    INTERRUPTED = "interrupted"  # should_stop() said so, between two batches


@dataclass(frozen=True)
class Drained:
    """What a whole `Ledger.drain` did."""

    keys_deleted: int
    fenced_deleted: int
    batches: int
    stopped: DrainStop


class Verdict(enum.Enum):
    """What the ledger would do with a request, decided from its stored row."""

    NEW = "new"  # no row: claimed and run
    REUSED = "reused"  # another request's key: 409 idempotency_key_reused
    REPLAY = "replay"  # the stored answer is replayed
    IN_PROGRESS = "in_progress"  # 409 in progress until the TTL, then a takeover
    TAKEOVER = "takeover"  # stale reservation: taken over and run


@dataclass(frozen=True)
class Prediction:
    """`Ledger.predict`: the verdict for one fingerprint, and the row it rests on."""

    verdict: Verdict
    view: RowView | None


@dataclass(frozen=True)
class Stats:
    """Counts for dashboards and cron checks, all taken at `now`."""

    now: int
    total: int
    pending_fresh: int
    pending_stale: int
    completed: int
    expired: int  # sweep backlog: rows past retention
    taken_over: int  # rows with generation > 1
    fenced_out_events: int
    oldest_pending_at: int | None  # created_at of the oldest pending row
    oldest_completed_at: int | None
    oldest_row_at: int | None
    storage_bytes: int | None
    schema_version: int
    # Pending rows past retention: a dead owner's reservation that no retry
    # came back for. Counted in `expired` (the sweep deletes them) and in
    # `pending_stale` (a retry takes them over), so the four state counts
    # add up to `total + expired_pending`.
    expired_pending: int = 0


class InitAction(enum.Enum):
    """What `Ledger.init` did to the schema."""

    CREATED = "created"
    UP_TO_DATE = "already up to date"
    UPGRADED = "upgraded"


@dataclass(frozen=True)
class InitResult:
    """What `Ledger.init` did (or, with ``dry_run``, would do), from which
    schema version to which.

    >>> InitResult(InitAction.UPGRADED, 1, 2).describe()
    'upgraded from 1 to 2'
    """

    action: InitAction
    from_version: int | None  # None: there was no ledger table at all
    to_version: int
    dry_run: bool = False

    def describe(self) -> str:
        if self.action is InitAction.UPGRADED:
            return f"upgraded from {self.from_version} to {self.to_version}"
        if self.action is InitAction.CREATED:
            return f"created (schema version {self.to_version})"
        return f"already up to date (schema version {self.to_version})"


class PurgeOutcome(enum.Enum):
    """What `Ledger.purge` did: deleted the row, found none, or refused a
    fresh pending row whose owner may still be running (``force`` deletes it)."""

    PURGED = "purged"
    NOT_FOUND = "not_found"
    REFUSED_FRESH_PENDING = "refused_fresh_pending"


@dataclass(frozen=True)
class PurgeResult:
    """The purge's outcome and the row as it was (None when there was none)."""

    outcome: PurgeOutcome
    row: StoredRow | None
