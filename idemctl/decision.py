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
import logging
import time
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, cast

from .outcomes import Outcome, Reservation, Status, StoredRow, quick_init
from .policy import Policy
from .storage import Store
from .storage.store import Statement, StoreOp, Tables, new_token

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


@quick_init
@dataclass(frozen=True)
class _Step:
    pause: float
    done: bool
    value: Any


def _resume(steps: Steps[Any], value: Any, error: Exception | None) -> Op | _Step:
    """The next operation, or the steps' end as a done _Step (StopIteration
    cannot cross a Future: the result travels in a value)."""
    try:
        # An operation's error is raised inside the steps, where it happened.
        return steps.throw(error) if error is not None else steps.send(value)
    except StopIteration as done:
        return _Step(0.0, True, done.value)


async def _outcome_async(op: StoreOp, store: AsyncStore) -> tuple[Any, Exception | None]:
    try:
        return await store.run(op), None
    except Exception as exc:
        return None, exc


def run(steps: Steps[T]) -> T:
    """Drive steps in this thread: call the store, sleep through the pauses."""
    try:
        pause = _until_pause(steps, steps.send(None))
        while True:
            time.sleep(pause.seconds)
            pause = _until_pause(steps, steps.send(None))
    except StopIteration as done:
        return cast(T, done.value)


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
    return call


def _advance(steps: Steps[Any]) -> _Step:
    """Every operation up to the next pause (or the end), in this thread:
    one hand-off to a worker thread runs them all."""
    try:
        return _Step(_until_pause(steps, steps.send(None)).seconds, False, None)
    except StopIteration as done:  # it cannot cross a Future: the result travels in a value
        return _Step(0.0, True, done.value)


def _until_pause(steps: Steps[Any], op: Op) -> Pause:
    """Run the operations the steps yield, from `op` on, up to the next
    pause; the steps' end raises StopIteration. This is every request's
    driver: each operation runs on the store that built it, ``store.run(op)``."""
    while type(op) is not Pause:
        try:
            value = op.store.run(op)  # type: ignore[union-attr, arg-type]  # not a Pause: a StoreOp
        except Exception as exc:
            error = exc  # raised inside the steps, where it happened (outside this handler)
        else:
            op = steps.send(value)
            continue
        op = steps.throw(error)
    return op


def _settled(outcome: object) -> object:
    """What `orphaned` returned, with any steps it returned run here."""
    if isinstance(outcome, Generator):
        return run(outcome)
    return outcome


async def run_async(
    steps: Steps[T],
    in_thread: InThread,
    *,
    orphaned: Callable[[T], object] | None = None,
    store: AsyncStore | None = None,
) -> T:
    """Drive steps from an event loop; the pauses between polls are
    ``asyncio.sleep``, so any number of waiting duplicates hold no thread.

    With an asynchronous `store`, each operation is awaited on it, on this
    loop, with no hand-off to a thread. Without one, the operations between
    two pauses run in a worker thread through `in_thread(fn, *args)`, in one
    hand-off.

    If the caller is cancelled while an operation runs, the operation still
    lands; `orphaned(result)` then gets the decision's result (to release a
    claim nobody will use). It may return steps (the release), which are
    driven the same way."""
    if store is not None:
        return await _run_on(steps, store, orphaned)
    while True:
        step = asyncio.ensure_future(in_thread(_advance, steps))
        try:
            advanced: _Step = await asyncio.shield(step)
        except asyncio.CancelledError:
            _keep(asyncio.ensure_future(_land_then_release(step, in_thread, orphaned)))
            raise
        if advanced.done:
            return advanced.value  # type: ignore[no-any-return]
        await asyncio.sleep(advanced.pause)  # cancelled here: nothing was claimed, nothing is held


async def drive(steps: Steps[T], in_thread: InThread, store: AsyncStore | None) -> T:
    """Steps with no pause in them (a completion, a release, a sweep): on the
    asynchronous store when there is one, else in one worker-thread hand-off."""
    if store is None:
        return await in_thread(run, steps)  # type: ignore[no-any-return]
    return await _run_on(steps, store, None)


async def _run_on(steps: Steps[T], store: AsyncStore, orphaned: Callable[[T], object] | None) -> T:
    value: Any = None
    error: Exception | None = None
    while not isinstance(op := _resume(steps, value, error), _Step):
        value, error = None, None
        if isinstance(op, Pause):
            await asyncio.sleep(op.seconds)  # cancelled here: nothing is held
            continue
        if type(op) is Tables or (type(op) is Statement and not op.write):
            # A read cut off by a cancellation leaves nothing behind: no
            # shield (and no task of its own) needed.
            value, error = await _outcome_async(op, store)
            continue
        # Shielded: a cancelled caller does not cut a write off half-way
        # (a claim's outcome would be unknown, and could not be released).
        landing = asyncio.ensure_future(store.run(op))
        try:
            value = await asyncio.shield(landing)
        except asyncio.CancelledError:
            if orphaned is not None:
                _keep(asyncio.ensure_future(_finish_orphan(steps, landing, store, orphaned)))
            else:
                _keep(landing)
            raise
        except Exception as exc:
            error = exc
    return cast(T, op.value)


async def _finish_orphan(
    steps: Steps[Any], landing: asyncio.Future[Any], store: AsyncStore, orphaned: Callable[[Any], object]
) -> None:
    """A cancelled decision: once its operation lands, go on up to the next
    pause (nothing is held across a pause) or the end, and hand a result to
    `orphaned`, as the thread path does with a step that lands."""
    try:
        value: Any = await landing
        error: Exception | None = None
    except Exception as exc:
        value, error = None, exc
    try:
        while not isinstance(op := _resume(steps, value, error), (Pause, _Step)):
            value, error = await _outcome_async(op, store)
        if isinstance(op, Pause):
            steps.close()
            return
        outcome = orphaned(op.value)
        if isinstance(outcome, Generator):
            await _run_on(outcome, store, None)
    except Exception:
        log.exception("releasing the claim of a cancelled request failed")


def _keep(future: asyncio.Future[Any]) -> None:
    # Kept referenced by the loop until it finishes.
    _orphans.add(future)
    future.add_done_callback(_orphans.discard)


async def _land_then_release(
    step: asyncio.Future[_Step], in_thread: InThread, orphaned: Callable[[Any], object] | None
) -> None:
    """A cancelled hand-off: its operations still land in their thread; a
    decision that finished there goes to `orphaned` (the release), as on the
    loop path."""
    try:
        advanced = await step
    except Exception:
        return  # it failed in its thread: nothing was claimed
    if orphaned is None or not advanced.done:
        return
    try:
        await in_thread(lambda value: _settled(orphaned(value)), advanced.value)
    except Exception:
        log.exception("releasing the claim of a cancelled request failed")


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
    "Busy",
    "Claimed",
    "Completed",
    "Decision",
    "Pause",
    "Reused",
    "Steps",
    "Vanished",
    "decide",
    "drive",
    "now_steps",
    "run",
    "run_async",
]
