"""The one decision loop, shared by HTTP requests and idempotent functions.

Claim, or look up and branch: each step is one atomic statement of the
store, and nothing is held between them. The loop is a generator that yields
the pauses of an in-progress wait instead of sleeping, so one loop serves two
drivers: :func:`run` sleeps in the calling thread (WSGI, scripts, workers),
:func:`run_async` runs each step's statements in a worker thread and sleeps
on the event loop, so a waiting duplicate holds no thread while it waits.

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
from typing import Any, TypeVar

from .outcomes import Outcome, Reservation, Status, StoredRow
from .policy import Policy
from .storage import Store
from .storage.store import new_token

log = logging.getLogger("idemctl")

T = TypeVar("T")
#: A decision in the making: yields the seconds to pause before the next
#: poll, returns its result.
Steps = Generator[float, None, T]
InThread = Callable[..., Awaitable[Any]]

_FIRST_PAUSE_S = 0.005
_LONGEST_PAUSE_S = 0.1
# How often a row past retention may change under us before the request is told to retry.
_EXPIRED_RACES = 3


@dataclass(frozen=True)
class Claimed:
    """This caller owns the reservation (a new claim or a takeover): run once."""

    reservation: Reservation
    outcome: Outcome  # EXECUTED or TAKEN_OVER
    now: int


@dataclass(frozen=True)
class Completed:
    """The same request completed earlier: replay its row."""

    row: StoredRow
    now: int


@dataclass(frozen=True)
class Reused:
    """The key belongs to another request (another fingerprint)."""

    row: StoredRow
    now: int


@dataclass(frozen=True)
class Busy:
    """The same request is still running under a live reservation."""

    row: StoredRow
    now: int
    takeover_in_ms: int  # until the reservation is stale and can be taken over


@dataclass(frozen=True)
class Vanished:
    """The row went (swept, released, purged) between the failed claim and the lookup."""

    now: int


Decision = Claimed | Completed | Reused | Busy | Vanished


def decide(
    store: Store, policy: Policy, clock: Callable[[], int], principal: str, key: str, fingerprint: str
) -> Steps[Decision]:
    """Decide one (principal, key, fingerprint). With
    ``policy.in_progress_wait_ms``, a duplicate polls the row (reads only)
    and decides again once it completes, goes, changes owner or turns stale."""
    token = new_token()
    deadline: float | None = None
    expired_races = 0
    while True:
        now = int(clock())
        generation = store.claim(principal, key, fingerprint, token, now)
        if generation is not None:
            return Claimed(Reservation(principal, key, generation, fingerprint, token), Outcome.EXECUTED, now)
        row = store.lookup(principal, key)
        if row is None:
            return Vanished(now)
        expired_before = now - policy.retention_ms
        if row.updated_at < expired_before:
            # Past retention a row counts as absent: this is a new operation,
            # whatever the row held. The takeover's WHERE decides again,
            # atomically; if the row changed meanwhile (swept, or another
            # request took it), decide afresh.
            stale_before = now - policy.pending_ttl_ms
            generation = store.takeover(principal, key, fingerprint, token, now, stale_before, expired_before)
            if generation is not None:
                return Claimed(Reservation(principal, key, generation, fingerprint, token), Outcome.EXECUTED, now)
            expired_races += 1
            if expired_races < _EXPIRED_RACES:
                continue
            return Vanished(now)
        if row.fingerprint != fingerprint:
            return Reused(row, now)
        if row.status is Status.COMPLETED:
            return Completed(row, now)
        stale_before = now - policy.pending_ttl_ms
        generation = store.takeover(principal, key, fingerprint, token, now, stale_before, expired_before)
        if generation is not None:
            log.warning("took over stale reservation principal=%s key=%s as generation %d", principal, key, generation)
            return Claimed(Reservation(principal, key, generation, fingerprint, token), Outcome.TAKEN_OVER, now)
        if deadline is None:
            deadline = time.monotonic() + policy.in_progress_wait_ms / 1000
        changed = yield from _wait_for_change(store, policy, clock, principal, key, row.generation, deadline)
        if not changed:
            # A takeover is possible once the row is older than the TTL (`updated_at < now - ttl`).
            return Busy(row, now, max(0, row.updated_at + policy.pending_ttl_ms + 1 - now))


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
        yield min(pause, left)
        pause = min(pause * 2, _LONGEST_PAUSE_S)
        row = store.lookup(principal, key)
        if row is None or row.status is not Status.PENDING or row.generation != generation:
            return True
        if row.updated_at < int(clock()) - policy.pending_ttl_ms:
            return True  # stale now: deciding again takes it over
    return False


def run(steps: Steps[T]) -> T:
    """Drive a decision in this thread, sleeping through its pauses."""
    try:
        while True:
            time.sleep(next(steps))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


@dataclass(frozen=True)
class _Step:
    pause: float
    done: bool
    value: Any


def _advance(steps: Steps[Any]) -> _Step:
    # StopIteration cannot cross a Future: the result travels in a value.
    try:
        return _Step(next(steps), False, None)
    except StopIteration as done:
        return _Step(0.0, True, done.value)


async def run_async(
    steps: Steps[T], in_thread: InThread, *, orphaned: Callable[[T], object] | None = None
) -> T:
    """Drive a decision from an event loop: each step's statements run in a
    worker thread through `in_thread(fn, *args)`, and the pauses between
    polls are ``asyncio.sleep``, so any number of waiting duplicates hold no
    thread. If the caller is cancelled while a step's statements run, the
    step still lands in its thread; `orphaned(result)` then gets its result
    (to release a claim nobody will use), called in a worker thread."""
    while True:
        step = asyncio.ensure_future(in_thread(_advance, steps))
        try:
            advanced: _Step = await asyncio.shield(step)
        except asyncio.CancelledError:
            if orphaned is not None:
                step.add_done_callback(lambda future: _adopt(future, in_thread, orphaned))
            raise
        if advanced.done:
            return advanced.value  # type: ignore[no-any-return]
        await asyncio.sleep(advanced.pause)  # cancelled here: nothing was claimed, nothing is held


def _adopt(future: asyncio.Future[_Step], in_thread: InThread, orphaned: Callable[[Any], object]) -> None:
    if future.cancelled() or future.exception() is not None:
        return
    advanced = future.result()
    if advanced.done:
        # Kept referenced by the loop until it finishes; its errors are logged by `orphaned`.
        _orphans.add(task := asyncio.ensure_future(in_thread(orphaned, advanced.value)))
        task.add_done_callback(_orphans.discard)


_orphans: set[asyncio.Future[Any]] = set()


__all__ = ["Busy", "Claimed", "Completed", "Decision", "Reused", "Steps", "Vanished", "decide", "run", "run_async"]
