"""The two drivers of :func:`~idemctl.exchange.sequence.sequence`: one for a
thread (WSGI, Flask, Django), one for an event loop (ASGI, FastAPI).

A driver runs the store's work the sequence yields (the ledger's own
steps: its statements and the pauses of an in-progress wait) itself: in
this thread with ``store.run``, or from an event loop, awaited on the
ledger's asynchronous store or, on SQLite, handed to a worker thread (see
:func:`idemctl.decision.through_async`); it hands every other need to the
door. What a door's `send` or `pass_through` returns is what the
driver returns. A door whose framework runs the app itself, after the door
has returned (Django's middleware, DRF's view, FastAPI's route), answers
`Run` with :data:`LATER`: the driver returns a :class:`Later`, and the door
resumes it once the app's answer is in the capture (or the app failed).

An event-loop door that runs the app itself (the ASGI middleware) has a
`keep` for background work: its app and the storing of its answer run as
one task the request cannot cancel, so a client that leaves mid-mutation
finds its answer stored when it retries.

>>> from idemctl import Ledger
>>> from idemctl.exchange.gate import Gate
>>> from idemctl.exchange.sequence import Request, sequence
>>> gate = Gate(Ledger.open(":memory:")); _ = gate.ledger.init()
>>> class Door:
...     def exempt(self): return False
...     def key_optional(self): return False
...     def release(self): return False
...     def principal(self): return "acct_1"
...     def read_body(self, limit, declared): return b"{}"
...     def run(self, need): need.capture.start(201, []); need.capture.add(b"made")
...     def send(self, delivery, after): return delivery.answer.status, delivery.answer.body
...     def pass_through(self): return "untouched"
>>> request = Request("POST", "/orders", ("k1",), (), "2", False)
>>> drive(gate, sequence(gate, request, Door()), Door())
(201, b'made')
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from .. import decision
from ..decision import End, Pause
from ..landing import Outlasting
from ..storage.store_base import Statement
from .gate import Delivery, Gate
from .sequence import Door, Exchange, PassThrough, ReadBody, ResolvePrincipal, Run, Send

#: What a door's `run` returns when its framework runs the app after the door returned.
LATER: Any = object()

InThread = Callable[..., Awaitable[Any]]
# What a driver runs itself: the store's operations and the pauses between polls.
_STORE_WORK = decision.STORE_OPS | {Pause}
_UNKNOWN: Any = object()  # the asynchronous store, until a request first needs it


class Later:
    """A sequence waiting for its app to run: `run.capture` is to be filled,
    then the door resumes it (:func:`drive` or :func:`drive_async` with
    `later.steps`, and the app's exception if it failed)."""

    __slots__ = ("run", "steps")

    def __init__(self, steps: Exchange, run: Run) -> None:
        self.steps = steps
        self.run = run


class SyncDoor(Door, Protocol):
    """A door in a thread: it answers the sequence's needs as they come."""

    def principal(self) -> object: ...
    def read_body(self, limit: int, declared: int | None) -> bytes: ...
    def run(self, need: Run) -> object: ...
    def send(self, delivery: Delivery, after: Callable[[], None] | None) -> Any: ...
    def pass_through(self) -> Any: ...


class AsyncDoor(Door, Protocol):
    """A door on an event loop; `in_thread` runs blocking work in a worker
    thread, `keep` (or None) holds work that outlives its request."""

    @property
    def in_thread(self) -> InThread: ...
    @property
    def keep(self) -> Callable[[asyncio.Future[Any]], None] | None: ...

    # The principal, or an awaitable of it (an async auth callback): most
    # are plain strings, which then cost no coroutine.
    def principal(self) -> object: ...
    def read_body(self, limit: int, declared: int | None) -> Awaitable[bytes]: ...
    async def run(self, need: Run) -> object: ...
    async def send(self, delivery: Delivery, after: Callable[[], Awaitable[None]] | None) -> Any: ...
    async def pass_through(self) -> Any: ...


def drive(gate: Gate, steps: Exchange, door: SyncDoor, error: BaseException | None = None) -> Any:
    """Run `steps` to its end in this thread (or to a `Later`); `error` is
    thrown into a resumed sequence: the app failed."""
    value: Any = None
    result: Any = None
    send = steps.send
    while True:
        try:
            need = send(value) if error is None else steps.throw(error)
        except StopIteration:
            return result
        value = error = None
        # Dispatch on the exact class (no subclasses), most frequent first:
        # no isinstance calls. (So `need` is Any: mypy cannot follow it.)
        kind = type(need)
        try:
            if kind is Statement:
                value = need.store.run(need)  # an operation of the ledger's steps, on the store that built it
            elif kind is ResolvePrincipal:
                value = door.principal()
            elif kind is ReadBody:
                value = door.read_body(need.limit, need.declared)
            elif kind is Send:
                delivery = need.delivery
                result = door.send(delivery, gate.sweep_after(delivery))
            elif kind is Run:
                if door.run(need) is LATER:
                    return Later(steps, need)
            elif kind is PassThrough:
                result = door.pass_through()
            elif kind is Pause:
                time.sleep(need.seconds)  # an in-progress duplicate's wait
            else:  # the store's other operations (a Turn, Tables)
                value = need.store.run(need)
        except BaseException as exc:  # the sequence decides what a failure means
            error = exc


async def drive_async(
    gate: Gate, steps: Exchange, door: AsyncDoor, error: BaseException | None = None, *, resumed: bool = False
) -> Any:
    """`drive` on an event loop: the store's work awaited on the ledger's
    asynchronous store, or handed to a worker thread (SQLite). A request
    cancelled while its claim is under way releases the claim once it lands;
    `resumed` says the sequence is past its claim already (a `Later`)."""
    value: Any = None
    result: Any = None
    store: Any = _UNKNOWN
    claiming = not resumed
    orphaned = None
    pending: Any = None
    while True:
        if pending is None:
            try:
                need = steps.send(value) if error is None else steps.throw(error)
            except StopIteration:
                return result
        else:
            need, pending = pending, None
        value = error = None
        kind = type(need)
        if kind in _STORE_WORK:
            if store is _UNKNOWN:
                store = gate.ledger.async_store()
                if claiming:
                    orphaned = functools.partial(_release_orphan, gate)
            # Up to the door's next need; raises what the sequence raised.
            need = await decision.through_async(steps, need, door.in_thread, store, orphaned)
            kind = type(need)
            if kind is End:
                return result
        if kind is Run:
            claiming, orphaned = False, None  # claimed: what follows is not released for a cancelled request
            keep = door.keep
            if keep is not None:
                # Not thrown back: the shielded task owns the sequence until it asks to send.
                pending = await _shielded(gate, steps, need, door, keep, store)
                if pending is None:
                    return result
                continue
        try:
            if kind is Send:
                delivery = need.delivery
                result = await door.send(delivery, _sweep_after(gate, delivery, door.in_thread, store))
            elif kind is ResolvePrincipal:
                value = door.principal()
                if value.__class__ is not str and inspect.isawaitable(value):
                    value = await value
            elif kind is ReadBody:
                value = await door.read_body(need.limit, need.declared)
            elif kind is Run:
                if await door.run(need) is LATER:
                    return Later(steps, need)
            else:
                result = await door.pass_through()
        except BaseException as exc:  # the sequence decides what a failure means
            error = exc


def _release_orphan(gate: Gate, landed: object) -> decision.Steps[None] | None:
    """A request cancelled while its claim was under way: nobody will run
    the app, so the claim goes at once instead of blocking its key (the
    release's steps, run by the driver that ran the claim)."""
    if type(landed) is Run:
        return gate.ledger.abandon_steps(landed.ticket, release=True)
    return None


def _sweep_after(
    gate: Gate, delivery: Delivery, in_thread: InThread, store: Any
) -> Callable[[], Awaitable[None]] | None:
    """The gate's post-response sweep, for an event loop: awaited on the
    asynchronous store, or handed to a worker thread."""
    sweep = gate.sweep_after(delivery)
    if sweep is None:
        return None
    if store is _UNKNOWN:
        store = gate.ledger.async_store()
    if store is None:
        # A coroutine function, whatever `in_thread` is (it may return a
        # plain future): Starlette's background tasks await only those.
        async def sweep_in_thread() -> None:
            await in_thread(sweep)

        return sweep_in_thread
    steps = gate.ledger.after_response_steps(delivery.answer)
    log = gate.log

    async def sweep_on_loop() -> None:
        running = asyncio.current_task()
        if running is not None:
            decision.outlive(running)  # Ledger.aclose lets it finish before closing the connections
        if store.closed:
            return  # the loop's connections were closed since the answer: no sweep this time
        try:
            await decision.run_async(steps, in_thread, store=store)
        except Exception:  # the answer is out; a failed sweep must not turn into a 500
            log.exception("post-response housekeeping failed")

    return sweep_on_loop


async def _shielded(
    gate: Gate, steps: Exchange, run: Run, door: AsyncDoor, keep: Callable[[asyncio.Future[Any]], None], store: Any
) -> Any:
    work = asyncio.ensure_future(_run_and_store(gate, steps, run, door, store))
    keep(work)
    try:
        return await Outlasting(work)  # as asyncio.shield, a turn of the loop cheaper
    except asyncio.CancelledError:
        work.add_done_callback(functools.partial(_log_orphan_failure, gate.log))
        raise


async def _run_and_store(gate: Gate, steps: Exchange, run: Run, door: AsyncDoor, store: Any) -> Any:
    """The app, then the ledger's work the sequence asks for after it, up to
    the answer to send (returned; None if the sequence ended); the app's
    exception once its reservation is abandoned."""
    error: BaseException | None = None
    try:
        await door.run(run)
    except BaseException as exc:
        error = exc
    try:
        need = steps.send(None) if error is None else steps.throw(error)
    except StopIteration:
        return None
    if type(need) in _STORE_WORK:
        if store is _UNKNOWN:
            store = gate.ledger.async_store()
        need = await decision.through_async(steps, need, door.in_thread, store, shielded=True)
    return None if type(need) is End else need


def _log_orphan_failure(log: logging.Logger, future: asyncio.Future[Any]) -> None:
    # Nobody awaits a shielded mutation whose request was cancelled.
    if not future.cancelled() and future.exception() is not None:
        exc = future.exception()
        log.error("idempotent request failed after its client left: %r", exc, exc_info=exc)


__all__ = ["LATER", "AsyncDoor", "Later", "SyncDoor", "drive", "drive_async"]
