"""The two drivers of :func:`~idemctl.exchange.sequence.sequence`: one for a
thread (WSGI, Flask, Django), one for an event loop (ASGI, FastAPI).

A driver fulfils the ledger's needs through the gate (`Begin`, `Finish`,
`Abandon`: in this thread, or awaited on the ledger's asynchronous store
with the SQLite work handed to a worker thread) and hands every other need
to the door. What a door's `send` or `pass_through` returns is what the
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
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from .gate import Delivery, Gate, InThread
from .sequence import Abandon, Begin, Door, Exchange, Finish, Need, ReadBody, ResolvePrincipal, Run, Send

#: What a door's `run` returns when its framework runs the app after the door returned.
LATER: Any = object()


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

    async def principal(self) -> object: ...
    async def read_body(self, limit: int, declared: int | None) -> bytes: ...
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
            need: Need = send(value) if error is None else steps.throw(error)
        except StopIteration:
            return result
        value = error = None
        # Dispatch on the exact class (no subclasses), most frequent first: no isinstance calls.
        kind = need.__class__
        try:
            if kind is ResolvePrincipal:
                value = door.principal()
            elif kind is ReadBody:
                value = door.read_body(need.limit, need.declared)  # type: ignore[union-attr]
            elif kind is Begin:
                value = gate.begin(need.principal, need.key, need.method, need.target, need.headers, need.body)  # type: ignore[union-attr]
            elif kind is Send:
                delivery = need.delivery  # type: ignore[union-attr]
                result = door.send(delivery, gate.sweep_after(delivery))
            elif kind is Run:
                if door.run(need) is LATER:  # type: ignore[arg-type]
                    return Later(steps, need)  # type: ignore[arg-type]
            elif kind is Finish:
                value = gate.finish(need.ticket, need.capture)  # type: ignore[union-attr]
            elif kind is Abandon:
                gate.abandon(need.ticket, release=need.release)  # type: ignore[union-attr]
            else:
                result = door.pass_through()
        except BaseException as exc:  # the sequence decides what a failure means
            error = exc


async def drive_async(gate: Gate, steps: Exchange, door: AsyncDoor, error: BaseException | None = None) -> Any:
    """`drive` on an event loop."""
    value: Any = None
    result: Any = None
    pending: Need | None = None
    while True:
        if pending is None:
            try:
                need: Need = steps.send(value) if error is None else steps.throw(error)
            except StopIteration:
                return result
        else:
            need, pending = pending, None
        value = error = None
        if isinstance(need, Run) and door.keep is not None:
            # Not thrown back: the shielded task owns the sequence until it asks to send.
            pending = await _shielded(gate, steps, need, door, door.keep)
            continue
        try:
            if isinstance(need, Begin):
                value = await gate.begin_async(
                    need.principal, need.key, need.method, need.target, need.headers, need.body, door.in_thread
                )
            elif isinstance(need, Finish):
                value = await gate.finish_async(need.ticket, need.capture, door.in_thread)
            elif isinstance(need, Send):
                result = await door.send(need.delivery, gate.sweep_after_async(need.delivery, door.in_thread))
            elif isinstance(need, ResolvePrincipal):
                value = await door.principal()
            elif isinstance(need, ReadBody):
                value = await door.read_body(need.limit, need.declared)
            elif isinstance(need, Run):
                if await door.run(need) is LATER:
                    return Later(steps, need)
            elif isinstance(need, Abandon):
                await gate.abandon_async(need.ticket, release=need.release, in_thread=door.in_thread)
            else:
                result = await door.pass_through()
        except BaseException as exc:  # the sequence decides what a failure means
            error = exc


async def _shielded(
    gate: Gate, steps: Exchange, run: Run, door: AsyncDoor, keep: Callable[[asyncio.Future[Any]], None]
) -> Need | None:
    work = asyncio.ensure_future(_run_and_store(gate, steps, run, door))
    keep(work)
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        work.add_done_callback(functools.partial(_log_orphan_failure, gate.log))
        raise


async def _run_and_store(gate: Gate, steps: Exchange, run: Run, door: AsyncDoor) -> Need | None:
    """The app, then the ledger's work the sequence asks for after it, up to
    the answer to send (returned); the app's exception once its reservation
    is abandoned."""
    value: Any = None
    error: BaseException | None = None
    try:
        await door.run(run)
    except BaseException as exc:
        error = exc
    while True:
        try:
            need: Need = steps.send(value) if error is None else steps.throw(error)
        except StopIteration:
            return None
        value = error = None
        try:
            if isinstance(need, Abandon):
                await gate.abandon_async(need.ticket, release=need.release, in_thread=door.in_thread)
            elif isinstance(need, Finish):
                value = await gate.finish_async(need.ticket, need.capture, door.in_thread)
            else:
                return need
        except BaseException as exc:
            error = exc


def _log_orphan_failure(log: logging.Logger, future: asyncio.Future[Any]) -> None:
    # Nobody awaits a shielded mutation whose request was cancelled.
    if not future.cancelled() and future.exception() is not None:
        exc = future.exception()
        log.error("idempotent request failed after its client left: %r", exc, exc_info=exc)


__all__ = ["LATER", "AsyncDoor", "Later", "SyncDoor", "drive", "drive_async"]
