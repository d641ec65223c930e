"""The gate: each answer the contract gives around the ledger, once.

The order of a request's steps is :mod:`idemctl.exchange.sequence`'s; the
gate is what each step decides, for one adapter instance:

- the options every adapter takes, checked the same way at construction;
- the principal (a str, or None for the contract's 401);
- the key field (several ``Idempotency-Key`` fields are a 400);
- a body refused by the rules of :mod:`idemctl.exchange.body` (400, 411, 413);
- the decision (`Ledger.begin`, or its steps driven on an event loop so a
  waiting duplicate holds no thread), failing closed with 503 and
  Retry-After when the ledger cannot be asked;
- the completion: the captured answer (see :mod:`idemctl.exchange.capture`) stored,
  or, when storing fails after the app ran, the app's own answer sent
  anyway with an ERROR line, never an invitation to run it again;
- one event for every answer, refusals included.

>>> from idemctl import Ledger
>>> ledger = Ledger.open(":memory:"); _ = ledger.init()
>>> gate = Gate(ledger, max_body_bytes=1024)
>>> gate.principal(None, key="k1", method="POST", target="/orders").status
401
>>> ticket = gate.begin("acct_1", "k1", "POST", "/orders", [], b"{}")
>>> capture = gate.capture(); capture.start(201, [("content-type", "text/plain")]); capture.add(b"made")
>>> gate.finish(ticket, capture).answer.body
b'made'
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .. import decision, responses
from ..errors import (
    AnswerNotStoredError,
    CommitTimeoutError,
    InvalidPrincipalError,
    InvalidRequestError,
    LedgerUnavailableError,
    StorageError,
)
from ..fingerprint import HeadersLike
from ..ledger import MAX_PATH_BYTES, Ledger
from ..outcomes import Answer, Outcome, Ticket
from ..policy import Policy
from .body import BodyRefused
from .capture import Capture
from .wire import DEFAULT_MAX_BODY_BYTES, DEFAULT_UNAVAILABLE_RETRY_AFTER_MS

log = logging.getLogger("idemctl.gate")

T = TypeVar("T")
A = TypeVar("A")  # the wrapped app
R = TypeVar("R")  # what the options' callables receive: a WSGI environ, an ASGI scope, a request
InThread = Callable[..., Awaitable[Any]]

KEY_HEADER = "idempotency-key"

# What a retry meets after an answer was not stored: the reservation as it
# was, or (a commit no standby acknowledged) a completion that the primary
# may hold without a standby's copy.
_STAYS_PENDING = "the reservation stays pending and a retry after the TTL will run it again"
_NOT_ACKNOWLEDGED = (
    "the completion may be committed on the primary without a standby's copy: a retry replays it while the primary "
    "keeps it; if it was not committed, or a failover loses it, a retry after the TTL runs the mutation again"
)


class Delivery:
    """What an adapter sends after the app ran: the answer, and whether the
    post-response sweep may follow it (not after an answer that could not
    be stored: the ledger just failed)."""

    __slots__ = ("answer", "sweep")  # one a request: a plain class is cheaper than a frozen dataclass

    def __init__(self, answer: Answer, sweep: bool) -> None:
        self.answer = answer
        self.sweep = sweep

    def __repr__(self) -> str:
        return f"Delivery(answer={self.answer!r}, sweep={self.sweep!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Delivery):
            return NotImplemented
        return self.answer == other.answer and self.sweep == other.sweep

    __hash__ = None  # type: ignore[assignment]


def check_options(max_body_bytes: object, unavailable_retry_after_ms: object) -> None:
    """The options every adapter shares, refused the same way by each.

    >>> check_options(1024, 1000)
    >>> check_options(-5, 1000)
    Traceback (most recent call last):
    ...
    ValueError: max_body_bytes must be an integer >= 0, got -5
    """
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 0:
        raise ValueError(f"max_body_bytes must be an integer >= 0, got {max_body_bytes!r}")
    retry_ms = unavailable_retry_after_ms
    if isinstance(retry_ms, bool) or not isinstance(retry_ms, int) or retry_ms < 1:
        raise ValueError(f"unavailable_retry_after_ms must be an integer >= 1, got {retry_ms!r}")


def release_wanted(release_on_error: bool | Callable[[R], object], request: R) -> bool:
    """An adapter's `release_on_error` option for one request: a flag, or a
    predicate of the request.

    >>> release_wanted(True, {}), release_wanted(lambda environ: "HTTP_X_RETRY" in environ, {})
    (True, False)
    """
    return bool(release_on_error(request)) if callable(release_on_error) else bool(release_on_error)


def check_principal_source(principal: object, *, takes: str) -> None:
    """An adapter's `principal` option must be callable.

    >>> check_principal_source(None, takes="environ")
    Traceback (most recent call last):
    ...
    TypeError: principal must be a callable environ -> str | None
    """
    if not callable(principal):
        raise TypeError(f"principal must be a callable {takes} -> str | None")


# -- the gate ---------------------------------------------------------------------------
class Gate:
    """The contract around the ledger, for one adapter instance.

    `ledger` is a Ledger, or a function returning one (an adapter that opens
    its ledger lazily, once per process). `release_on_error` is what the
    adapter decides per request; the gate only applies it."""

    def __init__(
        self,
        ledger: Ledger | Callable[[], Ledger],
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        replayed_header: bool = False,
        unavailable_retry_after_ms: int = DEFAULT_UNAVAILABLE_RETRY_AFTER_MS,
        logger: logging.Logger | None = None,
    ) -> None:
        check_options(max_body_bytes, unavailable_retry_after_ms)
        self._ledger = ledger
        if isinstance(ledger, Ledger):
            # A plain attribute: read several times a request, a property would be a call each time.
            self.ledger = ledger
        else:
            self.__class__ = _LazyGate  # the ledger asked of its source each time
        self.max_body_bytes = max_body_bytes
        self.replayed_header = bool(replayed_header)
        self.unavailable_retry_after_ms = unavailable_retry_after_ms
        self.log = logger if logger is not None else log

    ledger: Ledger  # set once for a Ledger; a ledger opened lazily is asked each time (_LazyGate)

    # -- before the ledger --------------------------------------------------------------
    def principal(self, who: object, *, key: str | None, method: str, target: str) -> str | Answer:
        """The principal an adapter's auth layer resolved, or the 401 answer.
        A user object that says it is not authenticated (Starlette's
        UnauthenticatedUser, Django's AnonymousUser) is nobody: 401. Anything
        else but a str or None is a bug in that auth layer: TypeError."""
        if who is not None and not isinstance(who, str):
            if getattr(who, "is_authenticated", None) is not False:
                raise TypeError(
                    f"principal() must return str or None, got {type(who).__name__} "
                    "(return the user's identity, e.g. user.identity)"
                )
            who = None
        if not who:
            return self.ledger.refuse(
                responses.unauthenticated(),
                Outcome.UNAUTHENTICATED,
                principal=None,
                key=key,
                method=method,
                path=target,
            )
        return who

    def key(self, fields: Sequence[str], *, method: str, target: str) -> str | Answer | None:
        """The key from every ``Idempotency-Key`` field the adapter can see:
        none, one, or a 400 for several (which one would be the key?)."""
        if len(fields) <= 1:
            return fields[0] if fields else None
        return self.ledger.refuse(
            responses.key_repeated(), Outcome.KEY_INVALID, principal=None, key=None, method=method, path=target
        )

    def refused(self, refusal: BodyRefused, *, principal: str, key: str | None, method: str, target: str) -> Answer:
        """The answer for a body the adapter could not read safely."""
        return self.ledger.refuse(
            refusal.refusal, Outcome.BODY_REFUSED, principal=principal, key=key, method=method, path=target
        )

    # -- the decision -------------------------------------------------------------------
    def begin(
        self, who: str, key: str | None, method: str, target: str, headers: HeadersLike | None, body: bytes
    ) -> Answer | Ticket:
        """`Ledger.begin` in this thread; 503 when the ledger cannot be asked."""
        try:
            return self.ledger.begin(who, key, method, target, headers, body)
        except StorageError as exc:
            return self._unavailable(exc, method, target)
        except (InvalidPrincipalError, InvalidRequestError) as exc:
            return self._unacceptable(exc, who, key, method, target)

    async def begin_async(
        self,
        who: str,
        key: str | None,
        method: str,
        target: str,
        headers: HeadersLike | None,
        body: bytes,
        in_thread: InThread,
    ) -> Answer | Ticket:
        """`Ledger.begin` from an event loop: statements awaited on the
        ledger's asynchronous store (PostgreSQL), or in a worker thread
        through `in_thread` (SQLite); the waits of an in-progress duplicate
        on the loop. A request cancelled while its claim is under way releases it."""
        ledger = self.ledger
        steps = ledger.begin_steps(who, key, method, target, headers, body)
        orphaned = functools.partial(_release_orphan, ledger)
        try:
            return await decision.run_async(steps, in_thread, orphaned=orphaned, store=ledger.async_store())
        except StorageError as exc:
            return self._unavailable(exc, method, target)
        except (InvalidPrincipalError, InvalidRequestError) as exc:
            return self._unacceptable(exc, who, key, method, target)

    def _unacceptable(
        self, exc: InvalidPrincipalError | InvalidRequestError, who: str, key: str | None, method: str, target: str
    ) -> Answer:
        """A request the ledger refused before any statement: the client's
        4xx, never a 500 (nothing was claimed, nothing runs).

        A request target over the ledger's bound is 414, one with control
        characters 400. A principal the ledger cannot hold exactly (over
        its byte limit, a NUL, a lone surrogate) is no usable principal: the
        contract's 401, never a truncated or shared namespace, and an
        ERROR line, since the app's auth layer resolved it."""
        # Events and log lines carry a bounded request target.
        shown = target if len(target) <= 256 else target[:256] + "..."
        if isinstance(exc, InvalidPrincipalError):
            # The principal quoted escaped and in its first 40 characters (it may be huge).
            self.log.error(
                "%s %s: the app's principal %s... (%d characters) cannot be used as a ledger principal "
                "(over 512 bytes of UTF-8, a NUL or a lone surrogate); answered 401",
                method,
                shown,
                ascii(who[:40]),
                len(who),
            )
            refusal, outcome, principal = responses.principal_unusable(), Outcome.UNAUTHENTICATED, None
        else:
            too_long = len(target.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES
            refusal = responses.target_too_long(MAX_PATH_BYTES) if too_long else responses.target_invalid()
            outcome, principal = Outcome.REQUEST_REFUSED, who
        return self.ledger.refuse(refusal, outcome, principal=principal, key=key, method=method, path=shown)

    def _unavailable(self, exc: StorageError, method: str, target: str) -> Answer:
        # Fail closed: an unprotected mutation is worse than a refused one.
        level = logging.WARNING if isinstance(exc, LedgerUnavailableError) else logging.ERROR
        self.log.log(level, "idempotency ledger unavailable, refused %s %s with 503: %s", method, target, exc)
        unavailable = responses.unavailable(self.unavailable_retry_after_ms)
        # A ledger opened lazily that cannot even be opened gets the plain answer.
        with contextlib.suppress(StorageError):
            unavailable = self.ledger.shape(unavailable)
        return Answer(*unavailable, Outcome.UNAVAILABLE)

    # -- after the app ran --------------------------------------------------------------
    def capture(self) -> Capture:
        """An empty capture bounded by the ledger's body cap."""
        return Capture(self.ledger.policy.body_cap_bytes)

    def finish(self, ticket: Ticket, capture: Capture) -> Delivery:
        """Store the captured answer; the answer to send and whether to sweep after it."""
        status, headers, body = capture.answer()
        try:
            return Delivery(self.ledger.finish(ticket, status, headers, body), True)
        except AnswerNotStoredError as exc:
            self._not_stored(exc, ticket)
            return Delivery(exc.answer, False)

    async def finish_async(self, ticket: Ticket, capture: Capture, in_thread: InThread) -> Delivery:
        status, headers, body = capture.answer()
        ledger = self.ledger
        try:
            steps = ledger.finish_steps(ticket, status, headers, body)
            return Delivery(await decision.drive(steps, in_thread, ledger.async_store()), True)
        except AnswerNotStoredError as exc:
            self._not_stored(exc, ticket)
            return Delivery(exc.answer, False)

    def _not_stored(self, exc: AnswerNotStoredError, ticket: Ticket) -> None:
        # Telling the client to retry would invite a second run once the
        # reservation goes stale: it gets what the app computed, shaped
        # exactly as a stored answer, and the operator an ERROR line.
        reservation = ticket.reservation
        self.log.error(
            "principal=%s key=%s: the mutation ran but its answer (status %d) could not be stored: %s — %s",
            reservation.principal if reservation else None,
            reservation.key if reservation else None,
            exc.answer.status,
            exc.cause,
            _NOT_ACKNOWLEDGED if isinstance(exc.cause, CommitTimeoutError) else _STAYS_PENDING,
        )

    def abandon(self, ticket: Ticket, *, release: bool) -> None:
        """The app raised: leave the reservation for a takeover, or release it."""
        self.ledger.abandon(ticket, release=release)

    async def abandon_async(self, ticket: Ticket, *, release: bool, in_thread: InThread) -> None:
        """`abandon` from an event loop (see `finish_async`)."""
        ledger = self.ledger
        await decision.drive(ledger.abandon_steps(ticket, release=release), in_thread, ledger.async_store())

    def sweep_after(self, delivery: Delivery) -> Callable[[], None] | None:
        """The post-response housekeeping to run once `delivery` is sent, or
        None when there is nothing to do (no statement, no hand-off)."""
        ledger = self.ledger
        answer = delivery.answer
        if not delivery.sweep or not ledger.sweep_due(answer):
            return None

        def sweep() -> None:
            try:
                ledger.after_response(answer)
            except Exception:  # the answer is out; a failed sweep must not turn into a 500
                self.log.exception("post-response housekeeping failed")

        return sweep

    def sweep_after_async(self, delivery: Delivery, in_thread: InThread) -> Callable[[], Awaitable[None]] | None:
        """`sweep_after` for an event loop: awaited on the asynchronous
        store, or handed to a worker thread through `in_thread`."""
        sweep = self.sweep_after(delivery)
        if sweep is None:
            return None
        ledger = self.ledger
        store = ledger.async_store()
        if store is None:
            # A coroutine function, whatever `in_thread` is (it may return a
            # plain future): Starlette's background tasks await only those.
            async def sweep_in_thread() -> None:
                await in_thread(sweep)

            return sweep_in_thread
        answer = delivery.answer

        async def sweep_on_loop() -> None:
            running = asyncio.current_task()
            if running is not None:
                decision.outlive(running)  # Ledger.aclose lets it finish before closing the connections
            if store.closed:
                return  # the loop's connections were closed since the answer: no sweep this time
            try:
                await decision.drive(ledger.after_response_steps(answer), in_thread, store)
            except Exception:  # the answer is out; a failed sweep must not turn into a 500
                self.log.exception("post-response housekeeping failed")

        return sweep_on_loop


class _LazyGate(Gate):
    """A gate whose ledger is opened lazily: asked of its source each time.
    (A subclass, so a gate holding its Ledger pays for no property.)"""

    @property
    def ledger(self) -> Ledger:  # type: ignore[override]
        source = self._ledger
        return source if isinstance(source, Ledger) else source()


def adapter_gate(
    ledger: Ledger,
    principal: object,
    takes: str,
    logger: logging.Logger,
    max_body_bytes: int,
    replayed_header: bool,
    unavailable_retry_after_ms: int,
) -> Gate:
    """The gate of an adapter whose `principal` option is a callable taking
    `takes`, that option checked first, then the options every adapter takes
    (in the order every adapter's signature lists them)."""
    check_principal_source(principal, takes=takes)
    return Gate(
        ledger,
        max_body_bytes=max_body_bytes,
        replayed_header=replayed_header,
        unavailable_retry_after_ms=unavailable_retry_after_ms,
        logger=logger,
    )


@dataclass(eq=False, repr=False)  # a middleware is compared and hashed by identity, as any object
class GatedMiddleware(Generic[A, R]):
    """What the WSGI and ASGI middleware hold and decide alike: the wrapped
    app, its ledger and gate, the principal source, and the per-request
    options `exempt`, `key_optional` and `release_on_error`."""

    app: A
    ledger: Ledger
    gate: Gate
    principal: Callable[[R], Any]
    exempt: Callable[[R], bool] | None
    key_optional: Callable[[R], bool] | None
    release_on_error: bool | Callable[[R], bool]

    @property
    def policy(self) -> Policy:
        return self.ledger.policy

    def exempts(self, request: R) -> bool:
        """Whether `exempt` leaves this request alone."""
        return self.exempt is not None and bool(self.exempt(request))

    def lets_keyless(self, request: R) -> bool:
        """Whether `key_optional` lets this request through without a key."""
        return self.key_optional is not None and bool(self.key_optional(request))

    def release(self, request: R) -> bool:
        """Whether the reservation of a request whose app raised is released."""
        return release_wanted(self.release_on_error, request)


def _release_orphan(ledger: Ledger, result: Answer | Ticket) -> decision.Steps[None] | None:
    """A request cancelled while its claim was under way: nobody will run
    the mutation, so the claim goes at once instead of blocking its key
    (the release's steps, run by the driver that ran the claim)."""
    if isinstance(result, Ticket) and result.reservation is not None:
        return ledger.abandon_steps(result, release=True)
    return None


def replied(answer: Answer) -> Delivery:
    """An answer the ledger made without running the app (replay, 4xx, 503)."""
    return Delivery(answer, True)


__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_UNAVAILABLE_RETRY_AFTER_MS",
    "KEY_HEADER",
    "Delivery",
    "Gate",
    "GatedMiddleware",
    "adapter_gate",
    "check_options",
    "check_principal_source",
    "release_wanted",
]
