"""Idempotent functions: the Idempotency-Key contract for calls made by
workers, queue consumers and scripts (docs/workers.md).

A call is identified, like a request, by a principal and a key. Its
fingerprint is the sha256 of the canonical JSON of the arguments that
identify it, so that a repeat with the same arguments gets the stored
return value without running, and a repeat with other arguments is refused.
Each step is the ledger's own single statement (claim, lookup, takeover,
fenced completion, release), so calls and HTTP requests share one ledger,
one fencing rule and one set of operator views (`idemctl pending`,
`idemctl fenced`).

>>> from idemctl import Ledger
>>> ledger = Ledger.open(":memory:"); _ = ledger.init()
>>> @ledger.idempotent(key=lambda payment: payment["id"], principal="billing")
... def charge(payment):
...     return {"charged": payment["amount"]}
>>> charge({"id": "pay_1", "amount": 500})
{'charged': 500}
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, ParamSpec, Protocol, TypeVar, cast

from . import decision
from .call_values import JSON, Serializer, SerializerLike, as_serializer, call_fingerprint
from .errors import (
    CallInProgressError,
    IdemctlError,
    KeyReusedError,
    LedgerUnavailableError,
    MalformedRowError,
    ResultNotSerializableError,
    ResultNotStoredError,
    ResultTooLargeError,
    StorageError,
    UnsupportedFunctionError,
)
from .fingerprint import check_key
from .outcomes import Answer, Completion, Event, FencedEvent, Outcome, Reservation, StoredRow, SweepResult, Ticket
from .policy import Policy
from .storage.aio import AsyncStore

P = ParamSpec("P")
R = TypeVar("R")

KeySource = str | Callable[..., str]
PrincipalSource = str | Callable[..., str]
ArgsSelector = str | Sequence[str] | Callable[..., object]


class CallLedger(Protocol):
    """What an idempotent call asks of its ledger: the decision loop and the
    steps around it. :class:`idemctl.Ledger` is one; the protocol keeps this
    module from importing the ledger that builds its decorators."""

    policy: Policy

    def now(self) -> int: ...
    def decide(self, principal: str, key: str, fingerprint: str) -> decision.Steps[decision.Decision]: ...
    def publish(self, event: Event) -> None: ...
    def heard(self, outcome: Outcome) -> bool: ...
    def async_store(self) -> AsyncStore | None: ...
    def abandon(self, ticket: Ticket, *, release: bool = False) -> None: ...
    def abandon_steps(self, ticket: Ticket, *, release: bool = False) -> decision.Steps[None]: ...
    def release_steps(self, reservation: Reservation) -> decision.Steps[bool]: ...
    def after_response_steps(self, answer: Answer) -> decision.Steps[SweepResult | None]: ...
    def complete_steps(
        self, reservation: Reservation, status: int, headers: None, body: bytes, *, now: int | None = None
    ) -> decision.Steps[Completion]: ...


ReleasePolicy = bool | Callable[[BaseException], bool]

log = logging.getLogger("idemctl")

# A completed call's row holds its serialized value under status 200; status
# 500 says the function ran but its value was not stored (over the body cap:
# NULL body, as for HTTP answers; not serializable: a JSON note saying so).
STORED_STATUS = 200
NOT_STORED_STATUS = 500
_NOT_SERIALIZABLE = "result_not_serializable"
# How often a row may vanish (released, purged) between a failed claim and
# its lookup before the call gives up.
_CLAIM_ATTEMPTS = 3


@dataclass(frozen=True)
class CallSettings:
    """How a call is stored, the same for every call a decorator makes: the
    `name` its fingerprint carries (None: the function's ``__qualname__``),
    the `serializer` of its value (None: JSON; see
    :func:`idemctl.call_values.as_serializer` for what it may be), and
    whether a call that raised releases its reservation.

    >>> CallSettings().release_on_error
    False
    """

    name: str | None = None
    serializer: SerializerLike | None = None
    release_on_error: ReleasePolicy = False


class IdempotentCall:
    """One call under the contract, as a context manager (``with`` or
    ``async with``); made by :meth:`Ledger.idempotent_call`.

    Entering decides: a replay (``call.replayed``; ``call.value`` is the
    stored value), or leave to run once (the block does the work and hands
    its result to :meth:`store`). It raises KeyReusedError or
    CallInProgressError without running anything. When the block ends, the
    result is stored with one fenced statement; ``call.value`` is then what
    every repeat returns. A block that raises before :meth:`store` leaves
    the reservation pending for a takeover after the TTL, or releases it
    when ``release_on_error`` says so.

    >>> from idemctl import Ledger
    >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
    >>> def refund(order):
    ...     with ledger.idempotent_call(principal="billing", key=order["refund_id"], args=order) as call:
    ...         if not call.replayed:
    ...             call.store({"refunded": order["amount"]})  # the real work goes here
    ...     return call.value, call.outcome.value
    >>> refund({"refund_id": "rf_1", "amount": 300})
    ({'refunded': 300}, 'executed')
    >>> refund({"refund_id": "rf_1", "amount": 300})
    ({'refunded': 300}, 'replayed')
    """

    def __init__(
        self, ledger: CallLedger, *, principal: str, key: str, args: object, settings: CallSettings = CallSettings()
    ) -> None:
        key = check_key(key)
        self.ledger = ledger
        self.principal = principal
        self.key = key
        self.fingerprint = call_fingerprint(args, name=settings.name)
        self.serializer: Serializer = as_serializer(settings.serializer)
        self.release_on_error = settings.release_on_error
        #: EXECUTED or TAKEN_OVER (this call runs), REPLAYED, or, after a
        #: late completion, FENCED_OUT; None before the call is entered.
        self.outcome: Outcome | None = None
        self.generation: int | None = None
        #: The fenced-out event recorded for this call's late completion.
        self.event: FencedEvent | None = None
        #: The stored value (replays), or once the block has ended the value
        #: as stored (what every repeat returns); a fenced-out call keeps its own.
        self.value: Any = None
        self._reservation: Reservation | None = None
        self._started_at: int | None = None
        # For the events: a call shows as method CALL and its function's name.
        self._name = settings.name or ""
        self._ledger_s = 0.0
        self._owned_at = 0.0
        self._result: tuple[Any] | None = None
        self._entered = False
        self._decide_started = 0.0
        self._ended = False
        self._waited = False  # the decision waited on an in-progress duplicate first

    @property
    def replayed(self) -> bool:
        """True when the value was stored by an earlier call: do not run again."""
        return self.outcome is Outcome.REPLAYED

    @property
    def fenced_out(self) -> bool:
        """True when a takeover superseded this call while it ran: its value
        was not stored (the event is in `idemctl fenced`)."""
        return self.outcome is Outcome.FENCED_OUT

    def store(self, value: Any) -> None:
        """The call's result: stored when the block ends. From here on the
        work counts as done, so an exception later in the block still
        completes the call rather than leaving it for a takeover."""
        if self._reservation is None or self._ended:
            raise RuntimeError("store() needs a call that this block runs: a replayed call must not run again")
        if self._result is not None:
            raise RuntimeError("store() was already called for this call")
        self._result = (value,)

    def discard(self) -> None:
        """Nothing of the work ran: release the reservation now, so a repeat
        runs at once, and end the call without storing anything. Inside
        ``async with``, use :meth:`adiscard`, which releases without
        blocking the event loop.

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> with ledger.idempotent_call(principal="acct_1", key="k1", args=()) as call:
        ...     call.discard()
        >>> ledger.lookup("acct_1", "k1") is None
        True
        """
        decision.run(self._discard_steps())

    async def adiscard(self) -> None:
        """:meth:`discard` for ``async with``: the release runs on the
        ledger's asynchronous store (PostgreSQL) or in a worker thread
        (SQLite), never blocking the event loop.

        >>> import asyncio
        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> async def main() -> None:
        ...     async with ledger.idempotent_call(principal="acct_1", key="k1", args=()) as call:
        ...         await call.adiscard()
        >>> asyncio.run(main()); ledger.lookup("acct_1", "k1") is None
        True
        """
        steps = self._discard_steps()
        await decision.run_async(steps, asyncio.to_thread, store=self.ledger.async_store())

    def _discard_steps(self) -> decision.Steps[None]:
        # Checked now, not at the steps' first step: the caller's mistake is raised where it is made.
        reservation = self._reservation
        if reservation is None or self._ended or self._result is not None:
            raise RuntimeError("discard() needs a call that this block runs and has not stored")
        self._ended = True
        return self.ledger.abandon_steps(self._ticket(reservation), release=True)

    def _ticket(self, reservation: Reservation) -> Ticket:
        """The call's reservation as the ledger's abandon takes it."""
        return Ticket(
            reservation,
            self.outcome or Outcome.EXECUTED,
            b"",
            self._started_at,
            "CALL",
            self._name,
            self._ledger_s * 1000,
            self._owned_at,
        )

    # -- the context manager, sync and async --------------------------------------------
    def __enter__(self) -> IdempotentCall:
        self._enter()
        try:
            made = decision.run(self._steps())
        except StorageError:
            self._unavailable()
            raise
        self._take(made)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._close(exc)

    async def __aenter__(self) -> IdempotentCall:
        self._enter()
        # Statements on the ledger's asynchronous store (PostgreSQL) or in a
        # worker thread (SQLite), waits on the loop; a task cancelled while
        # its claim is under way releases that claim.
        try:
            store = self.ledger.async_store()
            made = await decision.run_async(
                self._steps(), asyncio.to_thread, orphaned=self._release_orphan, store=store
            )
        except StorageError:
            self._unavailable()
            raise
        self._take(made)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await decision.run_async(self._close_steps(exc), asyncio.to_thread, store=self.ledger.async_store())

    # -- the steps --------------------------------------------------------------------
    def _enter(self) -> None:
        if self._entered:
            raise RuntimeError("an IdempotentCall is entered once; make a new one for each call")
        self._entered = True
        self._decide_started = time.perf_counter()

    def _steps(self) -> decision.Steps[decision.Decision]:
        """The ledger's decision loop; a row that vanishes between the failed
        claim and its lookup (released, purged) is decided again."""
        for _ in range(_CLAIM_ATTEMPTS):
            made = yield from self.ledger.decide(self.principal, self.key, self.fingerprint)
            if not isinstance(made, decision.Vanished):
                return made
        raise LedgerUnavailableError(
            f"principal={self.principal} key={self.key} vanished between claim and lookup "
            f"{_CLAIM_ATTEMPTS} times; retry the call"
        )

    def _take(self, made: decision.Decision) -> None:
        started = self._decide_started
        self._waited = made.waited
        if isinstance(made, decision.Reused):
            self._publish(Outcome.REUSED, None, started, None, at=made.now)
            raise KeyReusedError(self.principal, self.key)
        if isinstance(made, decision.Busy):
            self._publish(Outcome.IN_PROGRESS, made.row.generation, started, None, at=made.now)
            raise CallInProgressError(self.principal, self.key, made.row.generation, made.takeover_in_ms)
        self._ledger_s = time.perf_counter() - started
        self._owned_at = time.perf_counter()
        if isinstance(made, decision.Completed):
            self.value = self._stored_value(made.row)
            self.outcome, self.generation = Outcome.REPLAYED, made.row.generation
            self._publish(Outcome.REPLAYED, self.generation, started, None, at=made.now)
            return
        assert isinstance(made, decision.Claimed)  # Vanished is decided again by _steps
        self._reservation, self._started_at = made.reservation, made.now
        self.outcome, self.generation = made.outcome, made.reservation.generation

    def _release_orphan(self, made: decision.Decision) -> decision.Steps[None]:
        if isinstance(made, decision.Claimed):
            try:
                yield from self.ledger.release_steps(made.reservation)
            except IdemctlError as exc:
                log.error(
                    "could not release the claim of a cancelled call principal=%s key=%s: %s",
                    self.principal,
                    self.key,
                    exc,
                )

    def _unavailable(self) -> None:
        """The decision could not be asked: counted like an HTTP door's 503
        (the caller gets the StorageError)."""
        if self.ledger.heard(Outcome.UNAVAILABLE):
            ledger_ms = (time.perf_counter() - self._decide_started) * 1000
            # The database clock, if that is the clock, cannot be asked either.
            at = time.time_ns() // 1_000_000
            event = Event(
                Outcome.UNAVAILABLE, self.principal, self.key, None, "CALL", self._name, None, ledger_ms, None, at
            )
            self.ledger.publish(event)

    def _publish(
        self, outcome: Outcome, generation: int | None, started: float, app_s: float | None, *, at: int | None = None
    ) -> None:
        # Nobody listening (no listener, the events log off): no Event built.
        if not self.ledger.heard(outcome):
            return
        ledger_ms = (self._ledger_s + time.perf_counter() - started) * 1000
        # The decision's own time: with the database's clock, asking again would be a statement.
        at = at if at is not None else self._started_at if self._started_at is not None else self.ledger.now()
        self.ledger.publish(
            Event(
                outcome,
                self.principal,
                self.key,
                generation,
                "CALL",
                self._name,
                None,
                ledger_ms,
                None if app_s is None else app_s * 1000,
                at,
                self._waited,
            )
        )

    def _close(self, exc: BaseException | None) -> None:
        decision.run(self._close_steps(exc))

    def _close_steps(self, exc: BaseException | None) -> decision.Steps[None]:
        reservation = self._reservation
        if reservation is None or self._ended:
            return
        self._ended = True
        if self._result is None and exc is not None:
            policy = self.release_on_error
            release = bool(policy(exc) if callable(policy) else policy)
            yield from self.ledger.abandon_steps(self._ticket(reservation), release=release)
            return
        yield from self._store_value(reservation, None if self._result is None else self._result[0])

    def _store_value(self, reservation: Reservation, value: Any) -> decision.Steps[None]:
        try:
            data = self.serializer.dumps(value)
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(f"{type(self.serializer).__name__}.dumps returned a {type(data).__name__}, not bytes")
        except Exception as exc:
            # It ran: a row left pending would run it again after the TTL,
            # and a row released would let the next caller run it again (a
            # second charge). The row records that it ran and what could not
            # be stored; every repeat is told so, and never runs it.
            type_name = type(value).__qualname__
            note = {"error": _NOT_SERIALIZABLE, "type": type_name}
            yield from self._store_bytes(reservation, NOT_STORED_STATUS, JSON.dumps(note))
            detail = str(exc)
            if self.serializer is JSON:
                detail += "; pass serializer=(dump, load) to store it as JSON (docs/workers.md)"
            raise ResultNotSerializableError(self.principal, self.key, type_name, detail) from exc
        data = bytes(data)
        done = yield from self._store_bytes(reservation, STORED_STATUS, data)
        if done.oversize:
            raise ResultTooLargeError(self.principal, self.key, len(data), self.ledger.policy.body_cap_bytes)
        if not done.stored:
            # The ledger has logged it at ERROR and recorded it; this caller
            # keeps what it computed, as a fenced-out request does.
            self.outcome, self.event = Outcome.FENCED_OUT, done.event
        self.value = self._load(data)

    def _store_bytes(self, reservation: Reservation, status: int, body: bytes) -> decision.Steps[Completion]:
        app_s = time.perf_counter() - self._owned_at
        started = time.perf_counter()
        done = yield from self.ledger.complete_steps(reservation, status, None, body)
        decided = (self.outcome or Outcome.EXECUTED) if done.stored else Outcome.FENCED_OUT
        self._publish(decided, reservation.generation, started, app_s)
        # The request path's housekeeping: one bounded sweep batch at the
        # call's own `now` (none while nothing can expire); it never raises.
        outcome = self.outcome if done.stored and self.outcome is not None else Outcome.FENCED_OUT
        answer = Answer(status, (), b"", outcome, reservation.generation, self._started_at)
        yield from self.ledger.after_response_steps(answer)
        return done

    def _stored_value(self, row: StoredRow) -> Any:
        body = row.body_bytes
        if row.response_status == STORED_STATUS and body is not None:
            return self._load(body)
        if body is None:
            raise ResultTooLargeError(self.principal, self.key, None, self.ledger.policy.body_cap_bytes)
        try:
            note = json.loads(body)
        except ValueError:
            note = None
        if isinstance(note, dict) and note.get("error") == _NOT_SERIALIZABLE:
            raise ResultNotSerializableError(self.principal, self.key, str(note.get("type")))
        raise ResultNotStoredError(self.principal, self.key, f"its row holds status {row.response_status}")

    def _load(self, data: bytes) -> Any:
        try:
            return self.serializer.loads(data)
        except Exception as exc:
            problem = f"its stored value cannot be read by {type(self.serializer).__name__}: {exc}"
            raise MalformedRowError(self.principal, self.key, problem) from exc


class IdempotentDecorator:
    """Makes functions idempotent; made by :meth:`Ledger.idempotent`.

    ``key`` and ``principal`` are strings or callables that receive the
    function's own arguments. ``args`` chooses what the fingerprint covers:
    by default every bound argument by name (defaults applied); a name or a
    list of names; or a callable of the function's arguments returning any
    JSON value. ``name`` (default: the function's ``__qualname__``) is part
    of the fingerprint, so two functions sharing a principal and a key
    refuse each other's repeats instead of replaying each other's values.

    >>> from idemctl import Ledger
    >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
    >>> @ledger.idempotent(key=lambda order_id, amount, note="": order_id, principal="billing",
    ...                    args=["amount"])
    ... def capture(order_id, amount, note=""):
    ...     return amount
    >>> capture("o1", 700, note="first"), capture("o1", 700, note="the note is not covered")
    (700, 700)
    """

    def __init__(
        self,
        ledger: CallLedger,
        *,
        key: KeySource,
        principal: PrincipalSource,
        args: ArgsSelector | None = None,
        settings: CallSettings = CallSettings(),
    ) -> None:
        serializer = settings.serializer
        if not (isinstance(key, str) or callable(key)):
            raise TypeError(f"key must be a str or a callable of the function's arguments, got {type(key).__name__}")
        if not (isinstance(principal, str) or callable(principal)):
            raise TypeError(
                f"principal must be a str or a callable of the function's arguments, got {type(principal).__name__}"
            )
        if args is not None and not (isinstance(args, (str, Sequence)) or callable(args)):
            raise TypeError(f"args must be a name, a list of names or a callable, got {type(args).__name__}")
        as_serializer(serializer)  # refused here, before any call, when it is none
        self.ledger = ledger
        self.key = key
        self.principal = principal
        self.args = args
        self.settings = settings

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]:
        name = self.settings.name if self.settings.name is not None else getattr(fn, "__qualname__", None)
        if name is None:
            raise TypeError(f"{fn!r} has no __qualname__: give the call a name with name=...")
        settings = replace(self.settings, name=name)
        is_async = _kind(fn, name)
        signature = inspect.signature(fn)
        names = self._names(signature)

        def start(a: tuple[Any, ...], kw: dict[str, Any]) -> IdempotentCall:
            return IdempotentCall(
                self.ledger,
                principal=_resolve(self.principal, a, kw),
                key=_resolve(self.key, a, kw),
                args=self._arguments(signature, names, a, kw),
                settings=settings,
            )

        if is_async:
            run_async = cast(Callable[..., Awaitable[Any]], fn)

            @functools.wraps(fn)
            async def call_async(*a: Any, **kw: Any) -> Any:
                call = start(a, kw)
                async with call:
                    if not call.replayed:
                        call.store(await run_async(*a, **kw))
                return call.value

            return cast(Callable[P, R], call_async)

        @functools.wraps(fn)
        def call_sync(*a: P.args, **kw: P.kwargs) -> R:
            call = start(a, kw)
            with call:
                if not call.replayed:
                    result = fn(*a, **kw)
                    if _deferred(result):
                        # Nothing of it ran: release the claim and say why, so
                        # the key is not burned for a value that never existed.
                        call.discard()
                        raise UnsupportedFunctionError(name, f"it returned a {type(result).__name__}, not its value")
                    call.store(result)
            return cast(R, call.value)

        return call_sync

    def _names(self, signature: inspect.Signature) -> tuple[str, ...] | None:
        """The argument names `args` selects, checked once against the signature."""
        if self.args is None or callable(self.args):
            return None
        names = (self.args,) if isinstance(self.args, str) else tuple(self.args)
        unknown = [n for n in names if n not in signature.parameters]
        if unknown:
            raise TypeError(f"args names {', '.join(map(repr, unknown))}, which the function does not take")
        return names

    def _arguments(
        self, signature: inspect.Signature, names: tuple[str, ...] | None, a: tuple[Any, ...], kw: dict[str, Any]
    ) -> object:
        if callable(self.args):
            return self.args(*a, **kw)
        bound = signature.bind(*a, **kw)
        # f(x) and f(x, y=<its default>) are one call and get one fingerprint.
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        return arguments if names is None else {n: arguments[n] for n in names}


def _kind(fn: Callable[..., Any], name: str) -> bool:
    """Whether `fn` is async (a coroutine function, or an object whose
    ``__call__`` is one); refuses generator functions of either kind."""
    candidates = [fn]
    if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
        candidates.append(inspect.getattr_static(type(fn), "__call__", fn))
    for candidate in candidates:
        if inspect.isgeneratorfunction(candidate) or inspect.isasyncgenfunction(candidate):
            raise UnsupportedFunctionError(name, "it is a generator function: its body runs only when iterated")
    return any(inspect.iscoroutinefunction(candidate) for candidate in candidates)


def _deferred(result: object) -> bool:
    """A value that is work not yet done; closed so it never runs later."""
    if inspect.iscoroutine(result) or inspect.isgenerator(result):
        result.close()
        return True
    return inspect.isawaitable(result) or inspect.isasyncgen(result)


def _resolve(source: str | Callable[..., str], a: tuple[Any, ...], kw: dict[str, Any]) -> str:
    return source if isinstance(source, str) else source(*a, **kw)
