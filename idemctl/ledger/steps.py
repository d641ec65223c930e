"""Single steps of the contract, one statement each: claim, lookup,
takeover, complete, release. The request flow is built on them, and a
`Ledger` is one: scripts and tests may call them directly
(`Ledger.claim`, ...)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from .. import decision, responses
from ..errors import ConnectionFailedError, IdemctlError
from ..fingerprint import HeadersLike, check_key, parse_key
from ..outcomes import Completion, FencedEvent, Reservation, StoredRow
from ..storage.store import new_token
from .core import LedgerCore
from .inputs import check_principal

log = logging.getLogger("idemctl")
T = TypeVar("T")

# Storing an answer again after its connection was lost (see
# `_store_again`): the pause before each further try, so at most
# 1 + len(STORE_RETRY_PAUSES_S) tries, and no try starts later than
# STORE_RETRY_WITHIN_S after the first loss (a try under way finishes: its
# own bound is the engine's connect and pool timeouts). The first retry
# does not wait: what usually failed is one dead connection, and the next
# one is fresh. A server that stays away longer gets AnswerNotStoredError.
STORE_RETRY_PAUSES_S = (0.0, 0.05, 0.25, 0.7)
STORE_RETRY_WITHIN_S = 2.0


class SingleSteps:
    """One statement per step, on a ledger's core: the base of the request
    flow (:class:`~idemctl.ledger.requests.RequestFlow`), and so of
    :class:`~idemctl.Ledger`.

    >>> from idemctl import Ledger
    >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
    >>> steps = SingleSteps(ledger.core)
    >>> steps.release(steps.claim("acct_1", "k1", "fp"))
    True
    """

    def __init__(self, core: LedgerCore) -> None:
        self.core = core
        # Fixed at opening: read straight off this object on the request path.
        self.store, self.policy = core.store, core.policy
        self._drop = core.drop

    def claim(self, principal: str, key: str, fingerprint: str, *, now: int | None = None) -> Reservation | None:
        """Atomically claim (principal, key) as generation 1; None if it exists.

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> ledger.claim("acct_1", "k1", "fp").generation, ledger.claim("acct_1", "k1", "fp")
        (1, None)
        """
        check_principal(principal)
        key = check_key(key)
        now = self.core.now() if now is None else now
        token = new_token()
        generation = self.store.claim(principal, key, fingerprint, token, now)
        return None if generation is None else Reservation(principal, key, generation, fingerprint, token)

    def lookup(self, principal: str, key: str) -> StoredRow | None:
        """The stored row, or None.

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> _ = ledger.claim("acct_1", "k1", "fp")
        >>> ledger.lookup("acct_1", "k1").status
        <Status.PENDING: 'pending'>
        """
        return self.store.lookup(principal, parse_key(key) or key)

    def takeover(self, principal: str, key: str, fingerprint: str, *, now: int | None = None) -> Reservation | None:
        """Take over a pending row older than the TTL, or any row past
        retention (which counts as absent), as the next generation; None if
        it is fresh, completed within retention, gone or for another request.

        >>> from idemctl import Ledger
        >>> t = [0]; ledger = Ledger.open(":memory:", clock=lambda: t[0]); _ = ledger.init()
        >>> _ = ledger.claim("acct_1", "k1", "fp")
        >>> ledger.takeover("acct_1", "k1", "fp") is None  # still fresh
        True
        >>> t[0] += ledger.policy.pending_ttl_ms + 1
        >>> ledger.takeover("acct_1", "k1", "fp").generation
        2
        """
        check_principal(principal)
        key = check_key(key)
        now = self.core.now() if now is None else now
        token = new_token()
        p = self.policy
        generation = self.store.takeover(
            principal, key, fingerprint, token, now, now - p.pending_ttl_ms, now - p.retention_ms
        )
        return None if generation is None else Reservation(principal, key, generation, fingerprint, token)

    def complete_steps(
        self,
        reservation: Reservation,
        status: int,
        headers: HeadersLike | None,
        body: bytes | bytearray | memoryview | str,
        *,
        now: int | None = None,
    ) -> decision.Steps[Completion]:
        """Store the answer if `reservation` still holds the current generation.
        When fenced out, the event is recorded and logged at ERROR, and the
        caller still gets the answer it computed. :meth:`complete` runs these
        steps in the calling thread; a driver that does its I/O its own way
        runs them itself (see :meth:`begin_steps`).

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> reservation = ledger.claim("acct_1", "k1", "fp")
        >>> ledger.complete(reservation, 201, {"content-type": "text/plain"}, b"ok").stored
        True
        >>> decision.run(ledger.complete_steps(reservation, 201, {}, b"again")).stored  # already completed
        False
        """
        self._drop(reservation)
        stored = self._prepare(reservation, status, headers, body)
        stamp = (yield from self._stamp_steps(reservation)) if now is None else now
        ok, event = yield from self._store_answer(reservation, stored, stamp)
        return Completion(ok, *stored.answer, stored.oversize, event)

    complete = decision.blocking(complete_steps)

    def _prepare(
        self,
        reservation: Reservation,
        status: int,
        headers: HeadersLike | None,
        body: bytes | bytearray | memoryview | str | responses.OversizeBody,
    ) -> responses.ToStore:
        """What will be stored for this answer (with the answer built from it)."""
        where = (reservation.principal, reservation.key)
        stored = responses.to_store(status, headers, body, self.policy, row=where)
        if type(stored.body) is bytes and not self.store.dialect.binary_bodies:
            # A ledger that cannot hold bytes (its dialect says so: another
            # program replaying from it could not send them) stores the
            # sentinel: every replay then fails loudly, as for an answer over the cap.
            log.warning(
                "response for principal=%s key=%s: its body is not UTF-8 and this ledger stores text only: "
                "stored as a 500 sentinel",
                reservation.principal,
                reservation.key,
            )
            return responses.ToStore(responses.OVERSIZE_STATUS, None, stored.headers_json, True, "body")
        if stored.oversize:
            cap = self.policy.header_cap_bytes if stored.over_cap == "headers" else self.policy.body_cap_bytes
            log.warning(
                "response for principal=%s key=%s: its %s exceed %d bytes: stored as a 500 sentinel",
                reservation.principal,
                reservation.key,
                "headers" if stored.over_cap == "headers" else "body bytes",
                cap,
            )
        return stored

    def _store_answer(
        self, reservation: Reservation, stored: responses.ToStore, stamp: int
    ) -> decision.Steps[tuple[bool, FencedEvent | None]]:
        """Whether the answer was stored; when fenced out, the event recorded."""
        store, r = self.store, reservation
        try:
            ok = yield store.complete_statement(
                r.principal, r.key, r.generation, r.token, stored.status, stored.body, stored.headers_json, stamp
            )
        except ConnectionFailedError as lost:
            ok = yield from _on_a_fresh_connection(lambda: self._store_again(r, stored, stamp), lost, r)
        event = None
        if not ok:
            event = yield from store.record_fenced_steps(r.principal, r.key, r.generation, stored.status, stamp)
            log.error(
                "fenced out: principal=%s key=%s generation=%d was superseded by generation %s; "
                "its answer (status %d) was not stored and the mutation may have run twice — "
                "raise the pending TTL above the slowest mutation",
                reservation.principal,
                reservation.key,
                reservation.generation,
                event.current_generation if event is not None else "?",
                stored.status,
            )
        return ok, event

    def _store_again(self, r: Reservation, stored: responses.ToStore, stamp: int) -> decision.Steps[bool]:
        """COMPLETE once more, after a try whose connection was lost. The
        fence makes it safe to repeat; if the row is no longer pending under
        our generation and token, either the lost try committed (the row
        holds this answer under them: stored) or a takeover fenced us out."""
        store = self.store
        answer = (r.token, stored.status, stored.body, stored.headers_json)
        if (yield store.complete_statement(r.principal, r.key, r.generation, *answer, stamp)):
            return True
        return bool((yield store.completed_as_statement(r.principal, r.key, r.generation, *answer)))

    def _stamp_steps(self, reservation: Reservation) -> decision.Steps[int]:
        """The completion's timestamp; the database's clock is asked again
        on a fresh connection, within the same bound as the completion."""
        try:
            return (yield from self.core.now_steps())
        except ConnectionFailedError as lost:
            return (yield from _on_a_fresh_connection(self.core.now_steps, lost, reservation))

    def release_steps(self, reservation: Reservation) -> decision.Steps[bool]:
        """Opt-in: delete a pending reservation whose mutation is known to have
        rolled back, so the client's retry runs again at once. Fenced like a
        completion: it deletes the row only while it is still this
        reservation's (generation and token), never a newer owner's.
        :meth:`release` runs these steps in the calling thread.

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> reservation = ledger.claim("acct_1", "k1", "fp")
        >>> ledger.release(reservation), decision.run(ledger.release_steps(reservation))
        (True, False)
        """
        self._drop(reservation)
        r = reservation
        return bool((yield self.store.release_statement(r.principal, r.key, r.generation, r.token)))

    release = decision.blocking(release_steps)

    def _release_quietly(self, reservation: Reservation) -> decision.Steps[None]:
        try:
            yield from self.release_steps(reservation)
        except IdemctlError as exc:
            log.error("could not release principal=%s key=%s: %s", reservation.principal, reservation.key, exc)


def _on_a_fresh_connection(
    attempt: Callable[[], decision.Steps[T]], lost: ConnectionFailedError, reservation: Reservation
) -> decision.Steps[T]:
    """`attempt` again after `lost`, within the bound (STORE_RETRY_PAUSES_S,
    STORE_RETRY_WITHIN_S), only while what fails is the connection: each
    engine has dropped the dead connection by then (PostgreSQL replaces its
    pool, MariaDB pings its idle ones), so a try runs on a fresh one. Any
    other failure, and the last loss, are raised."""
    deadline = time.monotonic() + STORE_RETRY_WITHIN_S
    tries = 1
    for pause in STORE_RETRY_PAUSES_S:
        if pause:
            yield decision.Pause(pause)
        if time.monotonic() > deadline:
            break
        tries += 1
        try:
            done = yield from attempt()
        except ConnectionFailedError as exc:
            lost = exc
            continue
        log.warning(
            "principal=%s key=%s: the connection was lost while storing the answer; "
            "done on a fresh connection (try %d): %s",
            reservation.principal,
            reservation.key,
            tries,
            lost,
        )
        return done
    raise lost
