"""Leases a live owner renews (``Policy(lease_renewal=True)``).

While a mutation runs in a live process, its reservation's ``updated_at`` is
moved forward every third of the pending TTL, so the row never looks stale
and no retry takes it over. One thread per ledger renews every live
reservation of the process together (one statement per 512 reservations,
or on SQLite one per reservation in one transaction), each row reached
through the key's unique index and fenced by generation and token, so a thousand
requests in flight cost one renewal a tick whatever the size of the ledger,
and a renewal can never revive or steal a row someone else now owns. When
the process dies, or the mutation returns, renewals stop, and a retry takes
over once the TTL passes after the last one. A mutation still running after
``Policy.lease_max_ms`` is renewed no more, so a hung handler cannot hold
its key forever.

A renewal that runs late is reported long before the TTL runs out: every
tick is a :class:`LeaseTick` for the listeners of :meth:`LeaseKeeper.subscribe`
(and the Prometheus metrics), and a tick after which some reservation had
gone more than half the TTL without renewal, where a third is normal, is
logged at WARNING. A watchdog thread says so while such a tick is still
running, and logs at ERROR once the TTL itself has passed (a retry may then
take the reservation over).

>>> from idemctl import Ledger, Policy
>>> ledger = Ledger.open(":memory:", policy=Policy(lease_renewal=True)); _ = ledger.init()
>>> ticket = ledger.begin("acct_1", "k1", "POST", "/orders", {}, b"")
>>> ledger.leases.held()
1
>>> _ = ledger.finish(ticket, 201, {}, b"made")
>>> ledger.leases.held()
0
>>> ledger.close()
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from .errors import IdemctlError
from .outcomes import Reservation
from .subscribers import Subscribers

log = logging.getLogger("idemctl")

Renew = Callable[[list[Reservation]], int]

# A tick is late once a reservation has gone this share of the TTL without
# renewal: renewals are due every third of it, so half leaves the other half
# of the TTL to notice and act before a retry may take a live owner over.
LATE_SHARE = 0.5


@dataclass(frozen=True)
class LeaseTick:
    """One renewal of a process's live reservations, or the watchdog's word
    that one is overdue (``done`` False: it is still running, or the last
    one failed).

    ``lapse_ms`` is how long the least recently renewed of them had gone
    without a renewal when this tick's renewal was committed (for a report
    from the watchdog: by now). It is normally a third of the TTL plus the
    statement's time; ``late`` once it passes half the TTL; at the TTL a
    retry may take the reservation over.

    >>> LeaseTick(reservations=3, renewed=3, seconds=0.002, lapse_ms=1002.0, ttl_ms=3000).late
    False
    """

    reservations: int  # renewed together in this tick (held, for the watchdog's report)
    renewed: int | None  # rows the renewal touched; None: it failed, or is still running
    seconds: float  # the renewal's time (so far, for the watchdog's report)
    lapse_ms: float
    ttl_ms: int
    done: bool = True
    error: str | None = None

    @property
    def late(self) -> bool:
        return self.lapse_ms > self.ttl_ms * LATE_SHARE

    @property
    def expired(self) -> bool:
        """The TTL has passed since the last renewal: a retry may take over."""
        return self.lapse_ms >= self.ttl_ms


TickListener = Callable[[LeaseTick], object]


class HeldShare:
    """One metrics observer's share of a gauge of held reservations that
    several lease keepers may feed (the gauge is their sum): what each
    finished tick moves the gauge by.

    >>> share = HeldShare()
    >>> share.moved(LeaseTick(3, 3, 0.002, 1000.0, 3000)), share.moved(LeaseTick(1, 1, 0.002, 1000.0, 3000))
    (3, -2)
    """

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held = 0

    def moved(self, tick: LeaseTick) -> int:
        change = tick.reservations - self.held
        self.held = tick.reservations
        return change


class LeaseKeeper(Subscribers[TickListener]):
    """This process's live reservations of one ledger, renewed together."""

    def __init__(self, renew: Renew, *, interval_s: float, max_s: float, ttl_s: float | None = None) -> None:
        self._renew = renew
        self.interval_s = interval_s
        self.max_s = max_s
        self.ttl_s = 3 * interval_s if ttl_s is None else ttl_s
        # reservation -> [monotonic time it was claimed, monotonic time of its last renewal]
        self._held: dict[Reservation, list[float]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._closed = False
        self._listeners: tuple[TickListener, ...] = ()
        self._running_since: float | None = None  # when the tick in flight began
        self._last_error: str | None = None  # why the last renewal failed
        self.ticks = 0  # renewals run, for tests and the curious
        self.late_ticks = 0  # ticks (and watchdog reports) that came late
        self.last_tick: LeaseTick | None = None
        _keepers.add(self)

    def subscribe(self, listener: TickListener) -> Callable[[], None]:
        """Call `listener(tick)` after every renewal and for every report of
        the watchdog; returns the function that unsubscribes it. It runs in
        the renewing thread (or the watchdog's): keep it quick. One that
        raises is logged.

        >>> keeper = LeaseKeeper(lambda held: len(held), interval_s=1.0, max_s=60.0)
        >>> seen = []
        >>> stop = keeper.subscribe(seen.append)
        >>> stop(); keeper.close()
        """
        return super().subscribe(listener)

    def hold(self, reservation: Reservation) -> None:
        """Renew `reservation` from now on, until it is dropped or too old."""
        with self._lock:
            if self._closed:
                return
            first = not self._held
            now = time.monotonic()
            self._held[reservation] = [now, now]
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="idemctl-leases", daemon=True)
                self._thread.start()
            if first:
                self._wake.notify_all()  # only idle threads need waking: busy ones look anyway
            if self._watchdog is None or not self._watchdog.is_alive():
                self._watchdog = threading.Thread(target=self._watch, name="idemctl-leases-watch", daemon=True)
                self._watchdog.start()

    def drop(self, reservation: Reservation) -> None:
        """The mutation returned (or raised): stop renewing."""
        if self._held:
            with self._lock:
                self._held.pop(reservation, None)

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._held.clear()
            self._wake.notify_all()
        for thread in (self._thread, self._watchdog):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=5)

    def _forget_after_fork(self) -> None:
        # A forked child holds none of its parent's reservations (its parent
        # renews them) and has no renewing thread until it claims one itself.
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._held = {}
        self._thread = None
        self._watchdog = None
        self._running_since = None
        self._last_error = None

    def _run(self) -> None:
        # Ticks are due an interval after the previous one began (the rows'
        # new updated_at is read then), so a slow renewal shortens the wait
        # after it instead of adding to the time the rows go unrenewed.
        due: float | None = None
        while True:
            with self._lock:
                if not self._held:
                    due = None  # idle: the first claim waits a whole interval
                self._wake.wait_for(lambda: self._closed or bool(self._held))
                if self._closed:
                    return
                deadline = time.monotonic() + self.interval_s if due is None else due
                while not self._closed and (left := deadline - time.monotonic()) > 0:
                    self._wake.wait(timeout=left)
                if self._closed:
                    return
                oldest = time.monotonic() - self.max_s
                for reservation in [r for r, (since, _) in self._held.items() if since < oldest]:
                    del self._held[reservation]
                    log.warning(
                        "stopped renewing principal=%s key=%s generation %d after %.0f s: a retry may take it over",
                        reservation.principal,
                        reservation.key,
                        reservation.generation,
                        self.max_s,
                    )
                live = list(self._held)
                if not live:
                    continue
                # The rows' new updated_at is read when the renewal starts.
                started = self._running_since = time.monotonic()
                due = started + self.interval_s
                lapsed_since = min(self._held[r][1] for r in live)
            renewed: int | None = None
            error: str | None = None
            try:
                renewed = self._renew(live)
                self.ticks += 1
            except IdemctlError as exc:  # the next tick tries again; the TTL is three ticks long
                error = str(exc)
                log.warning("could not renew %d reservation(s): %s", len(live), exc)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                log.exception("renewing reservations failed")
            ended = time.monotonic()
            lapse_ms = (ended - lapsed_since) * 1000
            # Reported first: the watchdog, told next, reports after it.
            self._report(LeaseTick(len(live), renewed, ended - started, lapse_ms, self._ttl_ms(), True, error))
            with self._lock:
                self._running_since = None
                self._last_error = error
                if renewed is not None:
                    for reservation in live:
                        times = self._held.get(reservation)
                        if times is not None:
                            times[1] = started
                self._wake.notify_all()  # the watchdog measures from the new renewals

    def _ttl_ms(self) -> int:
        return round(self.ttl_s * 1000)

    def _watch(self) -> None:
        """Say so while reservations go unrenewed past half the TTL (a tick
        stuck on a lock, a slow server, failing renewals), and again once
        the TTL has passed: the renewing thread cannot, while it waits."""
        reported: tuple[float, int] | None = None  # (lapse start, 1: late, 2: past the TTL)
        while True:
            with self._lock:
                if self._closed:
                    return
                if not self._held:
                    self._wake.wait()
                    continue
                since = min(times[1] for times in self._held.values())
                level = 0 if reported is None or reported[0] != since else reported[1]
                threshold = self.ttl_s * (LATE_SHARE if level == 0 else 1.0)
                now = time.monotonic()
                if level >= 2 or now < since + threshold:
                    wait = self.interval_s if level >= 2 else since + threshold - now
                    self._wake.wait(timeout=max(wait, 0.001))
                    continue
                reported = (since, level + 1)
                running = self._running_since
                held = len(self._held)
                error = self._last_error
            seconds = 0.0 if running is None else now - running
            self._report(LeaseTick(held, None, seconds, (now - since) * 1000, self._ttl_ms(), False, error))

    def _report(self, tick: LeaseTick) -> None:
        with self._lock:
            self.last_tick = tick
            self.late_ticks += tick.late
            listeners = self._listeners
        if tick.late:
            if tick.done:
                log.log(
                    logging.ERROR if tick.expired else logging.WARNING,
                    "lease renewal ran late: %d reservation(s) went %.0f ms without renewal"
                    " (TTL %d ms, due every %.0f ms); the renewal took %.0f ms%s",
                    tick.reservations,
                    tick.lapse_ms,
                    tick.ttl_ms,
                    self.interval_s * 1000,
                    tick.seconds * 1000,
                    "" if tick.error is None else f" and failed: {tick.error}",
                )
            else:
                log.log(
                    logging.ERROR if tick.expired else logging.WARNING,
                    "lease renewal is late: %d reservation(s) have gone %.0f ms without renewal (TTL %d ms, due every"
                    " %.0f ms); %s%s",
                    tick.reservations,
                    tick.lapse_ms,
                    tick.ttl_ms,
                    self.interval_s * 1000,
                    f"the renewal in progress has run {tick.seconds * 1000:.0f} ms"
                    if tick.seconds
                    else f"the last renewal failed: {tick.error}"
                    if tick.error
                    else "the next renewal is starting",
                    ": a retry may take them over now" if tick.expired else "",
                )
        for listener in listeners:
            try:
                listener(tick)
            except Exception:  # a listener must never stop the renewals it observes
                log.exception("an idemctl lease listener failed")


_keepers: weakref.WeakSet[LeaseKeeper] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for keeper in list(_keepers):
        keeper._forget_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["LATE_SHARE", "LeaseKeeper", "LeaseTick"]
