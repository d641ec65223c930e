"""Leases a live owner renews (``Policy(lease_renewal=True)``).

While a mutation runs in a live process, its reservation's ``updated_at`` is
moved forward every third of the pending TTL, so the row never looks stale
and no retry takes it over. One thread per ledger renews every live
reservation of the process with one statement a tick (per engine), fenced
by generation and token, so a thousand requests in flight cost one
statement a tick and a renewal can never revive or steal a row someone
else now owns. When the process dies, or the mutation returns, renewals
stop, and a retry takes over once the TTL passes after the last one. A
mutation still running after ``Policy.lease_max_ms`` is renewed no more, so
a hung handler cannot hold its key forever.

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

from .errors import IdemctlError
from .outcomes import Reservation

log = logging.getLogger("idemctl")

Renew = Callable[[list[Reservation]], int]


class LeaseKeeper:
    """This process's live reservations of one ledger, renewed together."""

    def __init__(self, renew: Renew, *, interval_s: float, max_s: float) -> None:
        self._renew = renew
        self.interval_s = interval_s
        self.max_s = max_s
        self._held: dict[Reservation, float] = {}  # reservation -> monotonic time it was claimed
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._closed = False
        self.ticks = 0  # statements run, for tests and the curious
        _keepers.add(self)

    def hold(self, reservation: Reservation) -> None:
        """Renew `reservation` from now on, until it is dropped or too old."""
        with self._lock:
            if self._closed:
                return
            first = not self._held
            self._held[reservation] = time.monotonic()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="idemctl-leases", daemon=True)
                self._thread.start()
            elif first:
                self._wake.notify()  # only an idle thread needs waking: a busy one ticks anyway

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
            self._wake.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _forget_after_fork(self) -> None:
        # A forked child holds none of its parent's reservations (its parent
        # renews them) and has no renewing thread until it claims one itself.
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._held = {}
        self._thread = None

    def _run(self) -> None:
        while True:
            with self._lock:
                self._wake.wait_for(lambda: self._closed or bool(self._held))
                if self._closed:
                    return
                deadline = time.monotonic() + self.interval_s
                while not self._closed and (left := deadline - time.monotonic()) > 0:
                    self._wake.wait(timeout=left)
                if self._closed:
                    return
                oldest = time.monotonic() - self.max_s
                for reservation in [r for r, since in self._held.items() if since < oldest]:
                    del self._held[reservation]
                    log.warning(
                        "stopped renewing principal=%s key=%s generation %d after %.0f s: a retry may take it over",
                        reservation.principal,
                        reservation.key,
                        reservation.generation,
                        self.max_s,
                    )
                live = list(self._held)
            if live:
                try:
                    self._renew(live)
                    self.ticks += 1
                except IdemctlError as exc:  # the next tick tries again; the TTL is three ticks long
                    log.warning("could not renew %d reservation(s): %s", len(live), exc)
                except Exception:
                    log.exception("renewing reservations failed")


_keepers: weakref.WeakSet[LeaseKeeper] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for keeper in list(_keepers):
        keeper._forget_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["LeaseKeeper"]
