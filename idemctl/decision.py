"""The one decision loop, shared by HTTP requests and idempotent functions.

Claim, or look up and branch: each step is one atomic statement of the
store, and nothing is held between them. The loop does no I/O itself: it
yields what it needs, in the store's own vocabulary (storage/store_base.py):
a :class:`~idemctl.storage.store_base.Statement` the Store built (claim,
lookup, takeover, the clock when the clock is the database's), a ``Turn`` or
``Tables`` from a multi-statement operation's steps, or a :class:`Pause` of
an in-progress wait, and is sent the result. So one loop serves every
driver: :func:`run` runs each with ``store.run(op)`` and sleeps in the
calling thread (WSGI, scripts, workers); :func:`run_async` awaits
``async_store.run(op)`` on the event loop (PostgreSQL), or runs the steps
between two pauses in a worker thread (SQLite), and sleeps on the loop, so a
waiting duplicate holds no thread while it waits. No operation is looked
up by name: a driver knows one verb, ``run``.

>>> from idemctl import Ledger
>>> ledger = Ledger.open(":memory:"); _ = ledger.init()
>>> made = run(ledger.decide("acct_1", "k1", "fp"))
>>> type(made).__name__, made.outcome.value, made.reservation.generation
('Claimed', 'executed', 1)
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, cast

from .landing import Landing, Outlasting
from .outcomes import Outcome, Reservation, Status, StoredRow, quick_init
from .policy import Policy
from .storage import Store
from .storage.store import Statement, StoreOp, Tables, Turn, new_token
from .storage.store_base import ran

if TYPE_CHECKING:
    from .storage.aio import AsyncStore

log = logging.getLogger("idemctl")

T = TypeVar("T")
S = TypeVar("S")
P = ParamSpec("P")


@dataclass(frozen=True)
class Pause:
    """Wait this many seconds before the next poll; nothing is held meanwhile."""

    seconds: float


Op = StoreOp | Pause
#: A decision (or any ledger work) in the making: yields the operations it
#: needs (the store's, or a pause), is sent their results (a Pause's is
#: None), returns its result.
Steps = Generator[Op, Any, T]
InThread = Callable[..., Awaitable[Any]]

_FIRST_PAUSE_S = 0.005
_LONGEST_PAUSE_S = 0.1
# How often a row past retention may change under us before the request is told to retry.
_EXPIRED_RACES = 3


@quick_init
@dataclass(frozen=True)
class Claimed:
    """This caller owns the reservation (a new claim or a takeover): run once."""

    reservation: Reservation
    outcome: Outcome  # EXECUTED or TAKEN_OVER
    now: int
    waited: bool = False  # decided after waiting on an in-progress duplicate (Policy.in_progress_wait_ms)


@quick_init
@dataclass(frozen=True)
class Completed:
    """The same request completed earlier: replay its row."""

    row: StoredRow
    now: int
    waited: bool = False


@quick_init
@dataclass(frozen=True)
class Reused:
    """The key belongs to another request (another fingerprint)."""

    row: StoredRow
    now: int
    waited: bool = False


@quick_init
@dataclass(frozen=True)
class Busy:
    """The same request is still running under a live reservation."""

    row: StoredRow
    now: int
    takeover_in_ms: int  # until the reservation is stale and can be taken over
    waited: bool = False


@quick_init
@dataclass(frozen=True)
class Vanished:
    """The row went (swept, released, purged) between the failed claim and the lookup."""

    now: int
    waited: bool = False


Decision = Claimed | Completed | Reused | Busy | Vanished


def decide(
    store: Store, policy: Policy, clock: Callable[[], int], principal: str, key: str, fingerprint: str
) -> Steps[Decision]:
    """Decide one (principal, key, fingerprint). With
    ``policy.in_progress_wait_ms``, a duplicate polls the row (reads only)
    and decides again once it completes, goes, changes owner or turns stale."""
    token = new_token()
    deadline: float | None = None
    waited = False  # every decision after a wait on an in-progress duplicate says so
    expired_races = 0
    # The database's clock is a statement (now_steps); any other is a plain call.
    local_clock = clock != store.database_now
    while True:
        now = int(clock()) if local_clock else (yield from now_steps(store, clock))
        got = yield store.claim_or_read_statement(principal, key, fingerprint, token, now)
        if type(got) is int:
            return Claimed(Reservation(principal, key, got, fingerprint, token), Outcome.EXECUTED, now, waited)
        # None: no row came back with the lost claim (the engine does not
        # read it there, or it was committed while the claim waited), so it
        # is read now; still none, it has gone.
        row = got if got is not None else (yield store.lookup_statement(principal, key))
        if row is None:
            return Vanished(now, waited)
        expired_before = now - policy.retention_ms
        if row.updated_at < expired_before:
            # Past retention a row counts as absent: this is a new operation,
            # whatever the row held. The takeover's WHERE decides again,
            # atomically; if the row changed meanwhile (swept, or another
            # request took it), decide afresh.
            stale_before = now - policy.pending_ttl_ms
            generation = yield store.takeover_statement(
                principal, key, fingerprint, token, now, stale_before, expired_before
            )
            if generation is not None:
                reservation = Reservation(principal, key, generation, fingerprint, token)
                return Claimed(reservation, Outcome.EXECUTED, now, waited)
            expired_races += 1
            if expired_races < _EXPIRED_RACES:
                continue
            return Vanished(now, waited)
        if row.fingerprint != fingerprint:
            return Reused(row, now, waited)
        if row.status is Status.COMPLETED:
            return Completed(row, now, waited)
        stale_before = now - policy.pending_ttl_ms
        generation = yield store.takeover_statement(
            principal, key, fingerprint, token, now, stale_before, expired_before
        )
        if generation is not None:
            log.warning("took over stale reservation principal=%s key=%s as generation %d", principal, key, generation)
            return Claimed(Reservation(principal, key, generation, fingerprint, token), Outcome.TAKEN_OVER, now, waited)
        if deadline is None:
            deadline = time.monotonic() + policy.in_progress_wait_ms / 1000
            waited = policy.in_progress_wait_ms > 0  # then it pauses at least once
        changed = yield from _wait_for_change(store, policy, clock, principal, key, row.generation, deadline)
        if not changed:
            # A takeover is possible once the row is older than the TTL (`updated_at < now - ttl`).
            return Busy(row, now, max(0, row.updated_at + policy.pending_ttl_ms + 1 - now), waited)


def _wait_for_change(
    store: Store,
    policy: Policy,
    clock: Callable[[], int],
    principal: str,
    key: str,
    generation: int,
    deadline: float,
) -> Steps[bool]:
    """Poll until the in-progress row completes, goes, changes owner or turns
    stale; False once the deadline passes first."""
    pause = _FIRST_PAUSE_S
    while (left := deadline - time.monotonic()) > 0:
        yield Pause(min(pause, left))
        pause = min(pause * 2, _LONGEST_PAUSE_S)
        row = yield store.lookup_statement(principal, key)
        if row is None or row.status is not Status.PENDING or row.generation != generation:
            return True
        if row.updated_at < (yield from now_steps(store, clock)) - policy.pending_ttl_ms:
            return True  # stale now: deciding again takes it over
    return False


def now_steps(store: Store, clock: Callable[[], int]) -> Steps[int]:
    """The time by `clock`: the database's clock is a statement like any
    other (asked through the driver), any other clock is called here."""
    if clock == store.database_now:
        return int((yield store.database_now_statement()))
    return int(clock())


class End:
    """The end of steps driven by :func:`through_async`, with their result
    (StopIteration cannot cross a Future: the result travels in a value)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class _Raised:
    """The steps' own exception, raised in a worker thread and carried back
    to the loop as a value (a driver tells it from an operation's error)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


#: The operations a driver runs on the store (the rest the steps yield is a
#: Pause, or a need their caller answers).
STORE_OPS: frozenset[type] = frozenset({Statement, Turn, Tables})


def _next(steps: Steps[Any], value: Any, error: Exception | None) -> Any:
    """The steps' next operation, or their End; an operation's error is
    raised inside them, where it happened."""
    try:
        return steps.throw(error) if error is not None else steps.send(value)
    except StopIteration as done:
        return End(done.value)


async def _outcome_async(op: StoreOp, store: AsyncStore) -> tuple[Any, Exception | None]:
    try:
        return await store.run(op), None
    except Exception as exc:
        return None, exc


def run(steps: Steps[T]) -> T:
    """Drive steps in this thread: call the store, sleep through the pauses.
    This is every synchronous request's driver: each operation runs on the
    store that built it, ``store.run(op)``."""
    send = steps.send
    try:
        op: Any = send(None)  # dispatched on its exact class, which mypy cannot follow
        while True:
            if type(op) is Pause:
                time.sleep(op.seconds)
                op = send(None)
                continue
            try:
                value = op.store.run(op)  # not a Pause: a StoreOp
            except Exception as exc:
                error = exc  # raised inside the steps, where it happened (outside this handler)
            else:
                op = send(value)
                continue
            op = steps.throw(error)
    except StopIteration as done:
        result: T = done.value
        return result


def blocking(steps: Callable[Concatenate[S, P], Steps[T]]) -> Callable[Concatenate[S, P], T]:
    """The synchronous method made from a ``*_steps`` method: the same
    arguments, its steps driven by :func:`run` in the calling thread. One
    signature and one docstring serve both.

    >>> class Clock:
    ...     def now_steps(self, offset: int) -> Steps[int]:
    ...         return offset + ((yield Pause(0.0)) or 1)
    ...     now = blocking(now_steps)
    >>> Clock().now(41), Clock.now.__name__
    (42, 'now')
    """

    def call(self: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return run(steps(self, *args, **kwargs))

    name = steps.__name__.removesuffix("_steps")
    call.__name__, call.__qualname__ = name, steps.__qualname__.removesuffix("_steps")
    call.__module__ = steps.__module__
    call.__doc__ = f"Run :meth:`{steps.__name__}` in the calling thread.\n\n{steps.__doc__ or ''}"
    # What help(), inspect and documentation generators show: the steps'
    # parameters, returning what the steps return.
    made = inspect.signature(steps)
    returned = made.return_annotation
    if isinstance(returned, str) and returned.removeprefix("decision.").startswith("Steps["):
        returned = returned.removeprefix("decision.")[len("Steps[") : -1]
    call.__signature__ = made.replace(return_annotation=returned)  # type: ignore[attr-defined]
    return call


def _through(steps: Steps[Any], op: Any) -> Any:
    """In a worker thread: `op`, then each store operation the steps yield
    after it, up to the first other thing they yield (a Pause, or a need of
    their caller's), their End, or their own exception (a _Raised)."""
    try:
        while type(op) in STORE_OPS:
            value, error = ran(op)
            # An operation's error is raised inside the steps, where it happened.
            op = steps.send(value) if error is None else steps.throw(error)
        return op
    except StopIteration as done:
        return End(done.value)
    except BaseException as exc:  # the steps' own: raised again on the loop
        return _Raised(exc)


def _resumed(steps: Steps[Any]) -> Any:
    """:func:`_through` from the steps' next operation (their first, or the
    one after a pause)."""
    try:
        op = steps.send(None)
    except StopIteration as done:
        return End(done.value)
    except BaseException as exc:
        return _Raised(exc)
    return _through(steps, op)


def through_async(
    steps: Steps[Any],
    op: Any,
    in_thread: InThread,
    store: AsyncStore | None = None,
    orphaned: Callable[[Any], object] | None = None,
    shielded: bool = False,
) -> Awaitable[Any]:
    """Run `op` (None: the steps' next operation) and every store operation
    and pause the steps yield after it, from an event loop, up to the first
    other thing they yield (returned: a need of their caller's) or their
    :class:`End`. The pauses are ``asyncio.sleep``, so any number of waiting
    duplicates hold no thread.

    With an asynchronous `store`, each operation is awaited on it, on this
    loop, with no hand-off to a thread. Without one, the operations between
    two pauses run in a worker thread through `in_thread(fn, *args)`, in one
    hand-off.

    With `orphaned`, if the caller is cancelled while an operation runs, the
    operation still lands and the steps go on up to what they yield next,
    which `orphaned(landed)` is given (to release a claim nobody will use);
    it may return steps (the release), driven the same way. Steps not at
    their end are then closed. Without it, what lands for a cancelled
    caller is left as it is (a completion, a release, a sweep).

    `shielded` says the caller runs in a task of its own that a request's
    cancellation never reaches (the door's shielded mutation): its writes
    are awaited as they are, with no task and no shield of their own."""
    # A plain function that returns the coroutine to await: no coroutine of
    # its own around either loop, on every request.
    if store is not None:
        first = _next(steps, None, None) if op is None else op
        return _through_on(steps, first, store, orphaned, in_thread, shielded)
    return _through_threads(steps, op, in_thread, orphaned)


async def _through_threads(
    steps: Steps[Any], op: Any, in_thread: InThread, orphaned: Callable[[Any], object] | None
) -> Any:
    while True:
        if op is None or type(op) is Pause:
            if op is not None:
                await asyncio.sleep(op.seconds)  # cancelled here: nothing was claimed, nothing is held
            handed = in_thread(_resumed, steps)
        else:
            handed = in_thread(_through, steps, op)
        if orphaned is None:
            # Nothing to do with what lands for a cancelled caller: the
            # hand-off runs to its end in its thread all the same.
            op = await handed
        else:
            handed = asyncio.ensure_future(handed)
            try:
                op = await Outlasting(handed)
            except asyncio.CancelledError:
                _keep(asyncio.ensure_future(_land_then_settle(steps, handed, in_thread, orphaned)))
                raise
        if type(op) is _Raised:
            raise op.error
        if type(op) is not Pause:
            return op


async def _through_on(
    steps: Steps[Any],
    op: Any,
    store: AsyncStore,
    orphaned: Callable[[Any], object] | None,
    in_thread: InThread,
    shielded: bool,
) -> Any:
    while True:
        kind = type(op)
        if kind is Pause:
            await asyncio.sleep(op.seconds)  # cancelled here: nothing is held
            value, error = None, None
        elif kind not in STORE_OPS:
            return op
        elif shielded or kind is Tables or (kind is Statement and not op.write):
            # A read cut off by a cancellation leaves nothing behind, and a
            # shielded caller's writes are never cut off: no shield (and no
            # task of its own) needed.
            value, error = await _outcome_async(op, store)
        else:
            # Landed whole: a cancelled caller does not cut a write off half-way
            # (a claim's outcome would be unknown, and could not be released):
            # in this task when the engine allows it (landing.py), else in a
            # task of its own behind a shield.
            landing = Landing(store.run(op)) if store.lands_in_place else None
            rest: asyncio.Future[Any] | None = None
            try:
                if landing is not None:
                    value, error = await landing, None
                else:
                    rest = asyncio.ensure_future(store.run(op))
                    value, error = await Outlasting(rest), None
            except asyncio.CancelledError:
                if landing is not None:
                    rest = landing.rest  # cancelled mid-write: it lands in a task of its own
                if rest is not None:
                    if orphaned is not None:
                        _keep(asyncio.ensure_future(_finish_orphan(steps, rest, store, orphaned, in_thread)))
                    else:
                        _keep(rest)
                raise
            except Exception as exc:
                value, error = None, exc
        op = _next(steps, value, error)


def _on_end(orphaned: Callable[[Any], object], landed: Any) -> object:
    # run_async's `orphaned` is given the steps' result, once they ended.
    return orphaned(landed.value) if type(landed) is End else None


async def run_async(
    steps: Steps[T],
    in_thread: InThread,
    *,
    orphaned: Callable[[T], object] | None = None,
    store: AsyncStore | None = None,
) -> T:
    """Drive steps from an event loop (see :func:`through_async`); with
    `orphaned`, a caller cancelled while an operation runs hands it the
    steps' result once they end (to release a claim nobody will use). It
    may return steps (the release), which are driven the same way."""
    settle = None if orphaned is None else functools.partial(_on_end, orphaned)
    landed = await through_async(steps, None, in_thread, store, settle)
    if type(landed) is not End:
        steps.close()
        raise TypeError(f"steps yielded {landed!r}, which is neither a store operation nor a pause")
    return cast(T, landed.value)


async def _settle_orphan(
    steps: Steps[Any],
    landed: Any,
    orphaned: Callable[[Any], object] | None,
    in_thread: InThread,
    store: AsyncStore | None,
) -> None:
    """What a cancelled caller's steps got to once their operation landed,
    handed to `orphaned`, whose steps (a release) run here; steps not at
    their end are closed: nothing is held across what they yield next."""
    try:
        outcome = orphaned(landed) if orphaned is not None else None
        if type(landed) is not End:
            steps.close()
        if isinstance(outcome, Generator):
            await run_async(outcome, in_thread, store=store)
    except Exception:
        log.exception("releasing the claim of a cancelled request failed")


async def _finish_orphan(
    steps: Steps[Any],
    landing: asyncio.Future[Any],
    store: AsyncStore,
    orphaned: Callable[[Any], object],
    in_thread: InThread,
) -> None:
    """A cancelled caller on the asynchronous store: once its operation
    lands, its steps go on up to what they yield next other than a store
    operation (nothing is held across a pause), as the thread path does
    with a hand-off that lands."""
    try:
        value: Any = await landing
        error: Exception | None = None
    except Exception as exc:
        value, error = None, exc
    try:
        op = _next(steps, value, error)
        while type(op) in STORE_OPS:
            op = _next(steps, *(await _outcome_async(op, store)))
    except Exception:
        log.exception("releasing the claim of a cancelled request failed")
        return
    await _settle_orphan(steps, op, orphaned, in_thread, store)


def _keep(future: asyncio.Future[Any]) -> None:
    # Kept referenced by the loop until it finishes.
    _orphans.add(future)
    future.add_done_callback(_orphans.discard)


async def _land_then_settle(
    steps: Steps[Any], handed: asyncio.Future[Any], in_thread: InThread, orphaned: Callable[[Any], object] | None
) -> None:
    """A cancelled hand-off: its operations still land in their thread;
    what the steps got to there goes to `orphaned` (the release), as on the
    loop path."""
    try:
        landed = await handed
    except Exception:
        return  # it failed in its thread: nothing was claimed
    if type(landed) is not _Raised:
        await _settle_orphan(steps, landed, orphaned, in_thread, None)


# What cancelled requests left running (a landing operation, then its
# release), kept referenced until done; settle_orphans waits for them.
_orphans: set[asyncio.Future[Any]] = set()


def outlive(future: asyncio.Future[Any]) -> None:
    """Keep `future`, work that outlives its request on this loop (a
    post-response sweep), for `settle_orphans` to wait for."""
    _keep(future)


async def settle_orphans(timeout_s: float = 5.0) -> int:
    """Wait, up to `timeout_s`, for what cancelled requests left running on
    this event loop: a claim still landing, then its release. Call it before
    closing the loop's connections (`Ledger.aclose` does), so that shutting
    down does not cut a release off. Returns how many are still running.

    >>> asyncio.run(settle_orphans())
    0
    """
    loop = asyncio.get_running_loop()
    mine = [future for future in _orphans if future.get_loop() is loop]
    if mine:
        await asyncio.wait(mine, timeout=timeout_s)
    return sum(1 for future in mine if not future.done())


__all__ = [
    "STORE_OPS",
    "Busy",
    "Claimed",
    "Completed",
    "Decision",
    "End",
    "Pause",
    "Reused",
    "Steps",
    "Vanished",
    "decide",
    "now_steps",
    "run",
    "run_async",
    "through_async",
]
