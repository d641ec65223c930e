"""The gate: each answer the contract gives around the ledger, once.

The order of a request's steps is :mod:`idemctl.exchange.sequence`'s; the
gate is what each step decides, for one adapter instance:

- the options every adapter takes, checked the same way at construction;
- the principal (a str, or None for the contract's 401);
- the key field (several ``Idempotency-Key`` fields are a 400);
- a body refused by the rules of :mod:`idemctl.exchange.body` (400, 411, 413);
- a decision the ledger could not make: 503 with Retry-After when it
  cannot be asked (failing closed), 401 or 414/400 for a principal or a
  request line it cannot take;
- the completion that could not be stored after the app ran: the app's own
  answer sent anyway with an ERROR line, never an invitation to run it again;
- the post-response sweep allowed after an answer;
- one event for every answer, refusals included.

The decision, the completion and the release are the ledger's own steps,
run inside the sequence.

>>> from idemctl import Ledger
>>> ledger = Ledger.open(":memory:"); _ = ledger.init()
>>> gate = Gate(ledger, max_body_bytes=1024)
>>> gate.principal(None, key="k1", method="POST", target="/orders").status
401
>>> gate.unavailable(LedgerUnavailableError("down"), "POST", "/orders").headers
(('content-type', 'application/json'), ('retry-after', '1'))
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypedDict, TypeVar, Unpack

from .. import responses
from ..errors import (
    AnswerNotStoredError,
    CommitTimeoutError,
    InvalidPrincipalError,
    InvalidRequestError,
    LedgerUnavailableError,
    StorageError,
)
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


class GateOptions(TypedDict, total=False):
    """The options every adapter's gate takes (see :class:`Gate`)."""

    max_body_bytes: int
    replayed_header: bool
    unavailable_retry_after_ms: int
    logger: logging.Logger | None


# -- the gate ---------------------------------------------------------------------------
class Gate:
    """The contract around the ledger, for one adapter instance.

    `release_on_error` is what the adapter decides per request; the gate
    only applies it. An adapter that opens its ledger lazily, once per
    process, has a :class:`LazyGate`."""

    def __init__(self, ledger: Ledger, **options: Unpack[GateOptions]) -> None:
        # A plain attribute: read on every request, a property would be a call each time.
        self.ledger = ledger
        self._configure(**options)

    def _configure(
        self,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        replayed_header: bool = False,
        unavailable_retry_after_ms: int = DEFAULT_UNAVAILABLE_RETRY_AFTER_MS,
        logger: logging.Logger | None = None,
    ) -> None:
        check_options(max_body_bytes, unavailable_retry_after_ms)
        self.max_body_bytes = max_body_bytes
        self.replayed_header = bool(replayed_header)
        self.unavailable_retry_after_ms = unavailable_retry_after_ms
        self.log = logger if logger is not None else log

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

    def key_repeated(self, method: str, target: str) -> Answer:
        """The 400 for several ``Idempotency-Key`` fields."""
        refusal = self.key(("", ""), method=method, target=target)
        assert isinstance(refusal, Answer)
        return refusal

    def refused(self, refusal: BodyRefused, *, principal: str, key: str | None, method: str, target: str) -> Answer:
        """The answer for a body the adapter could not read safely."""
        return self.ledger.refuse(
            refusal.refusal, Outcome.BODY_REFUSED, principal=principal, key=key, method=method, path=target
        )

    # -- what the ledger could not decide ------------------------------------------------
    def unacceptable(
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

    def unavailable(self, exc: StorageError, method: str, target: str) -> Answer:
        """The 503 for a ledger that cannot be asked (its own, or a plain one
        for a ledger that cannot even be opened)."""
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

    def not_stored(self, exc: AnswerNotStoredError, ticket: Ticket) -> Delivery:
        """The app's answer, which could not be stored, to send anyway (and
        no sweep after it: the ledger just failed)."""
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
        return Delivery(exc.answer, False)

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


class LazyGate(Gate):
    """A gate whose ledger is opened lazily, once per process, by `source`:
    asked of it on every request. (A class of its own, so that a gate
    holding its Ledger pays for no property.) The options are `Gate`'s."""

    def __init__(self, source: Callable[[], Ledger], **options: Unpack[GateOptions]) -> None:
        self.source = source
        self._configure(**options)

    @property
    def ledger(self) -> Ledger:
        return self.source()

    @ledger.setter
    def ledger(self, value: Ledger) -> None:
        raise AttributeError("a lazy gate's ledger is its source's")


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


class MiddlewareDoor(Generic[R]):
    """What one request's door inside a :class:`GatedMiddleware` answers of
    its own: the middleware's per-request options, asked of `request` (a
    WSGI environ, an ASGI scope)."""

    __slots__ = ("middleware", "request")

    middleware: GatedMiddleware[Any, R]
    request: R

    def exempt(self) -> bool:
        return self.middleware.exempts(self.request)

    def key_optional(self) -> bool:
        return self.middleware.lets_keyless(self.request)

    def release(self) -> bool:
        return self.middleware.release(self.request)


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
    "LazyGate",
    "MiddlewareDoor",
    "adapter_gate",
    "check_options",
    "check_principal_source",
    "release_wanted",
]
