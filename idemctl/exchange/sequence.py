"""One protected request, in the contract's order, with no I/O of its own.

:func:`sequence` is the whole exchange of one request with the ledger,
written once for every door: passthrough (a method the policy does not
protect, an exempt request, a keyless one that `key_optional` lets by),
the key fields (400 for several), the principal (401), the body rules
(400, 411, 413, or a client gone mid-body), the decision (replay, 409, 4xx,
503), the app's run, its answer stored (or, when storing fails, the app's
own answer sent with an ERROR line), the reservation abandoned or released
when the app fails, and the answer sent with the sweep that may follow it.

It is a generator: it yields what it needs (the frozen dataclasses below)
and is sent what each one produced. A driver (:mod:`idemctl.exchange.drive`,
one for threads, one for an event loop) fulfils the ledger's needs through
the :class:`~idemctl.exchange.gate.Gate` and hands the others to the door:
a small object that knows its framework (see :class:`Door`). A door only
turns its framework's request into a :class:`Request` and its answers into
the framework's response.

>>> from idemctl import Ledger
>>> from idemctl.exchange.gate import Gate
>>> gate = Gate(Ledger.open(":memory:"))
>>> _ = gate.ledger.init()
>>> class Anonymous:  # a door whose caller has no principal
...     def exempt(self): return False
...     def key_optional(self): return False
...     def release(self): return False
>>> request = Request("POST", "/orders", ("k1",), (), None, False)
>>> steps = sequence(gate, request, Anonymous())
>>> next(steps)
ResolvePrincipal()
>>> steps.send(None).delivery.answer.status
401
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..outcomes import Answer, Ticket
from .body import BodyRefused, ClientGone, check_complete, check_read, declared_length, length_required
from .capture import Capture
from .gate import Delivery, Gate, replied


@dataclass(frozen=True, slots=True)
class Request:
    """What the sequence needs to know of a request, as the door parsed it:
    the method (upper case), the target the fingerprint covers, every
    ``Idempotency-Key`` field the door can see, the fingerprint headers
    (lower-case names, as sent), the Content-Length field as received
    (None without one), and whether a body is coming that nothing
    delimits (a Transfer-Encoding the server does not de-chunk: 411)."""

    method: str
    target: str
    key_fields: Sequence[str]
    headers: Sequence[tuple[str, str]]
    content_length: str | None
    unbounded: bool
    exact_length: bool = True


class Door(Protocol):
    """The per-request questions a door answers synchronously, without I/O
    (its framework's options: `exempt`, `key_optional`, `release_on_error`)."""

    def exempt(self) -> bool: ...
    def key_optional(self) -> bool: ...
    def release(self) -> bool: ...


# -- what the sequence needs ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PassThrough:
    """Run the app as if idemctl were not there; nothing more follows."""


@dataclass(frozen=True, slots=True)
class ResolvePrincipal:
    """The principal the app's auth layer resolves (a str, or None)."""


@dataclass(frozen=True, slots=True)
class ReadBody:
    """The whole request body, at most `limit` bytes; `declared` is its
    Content-Length (None when unknown). May raise BodyRefused or ClientGone."""

    limit: int
    declared: int | None


@dataclass(frozen=True, slots=True)
class Begin:
    """The ledger's decision (a Ticket to run, or an Answer)."""

    principal: str
    key: str | None
    method: str
    target: str
    headers: Sequence[tuple[str, str]]
    body: bytes


@dataclass(frozen=True, slots=True)
class Run:
    """Run the app once on `body` with `principal`, its answer into `capture`.
    Raising means the app failed."""

    principal: str
    body: bytes
    capture: Capture


@dataclass(frozen=True, slots=True)
class Abandon:
    """The app failed: leave the reservation for a takeover, or release it."""

    ticket: Ticket
    release: bool


@dataclass(frozen=True, slots=True)
class Finish:
    """Store the captured answer: the Delivery to send."""

    ticket: Ticket
    capture: Capture


@dataclass(frozen=True, slots=True)
class Send:
    """Send this answer, with the post-response sweep the gate allows after it."""

    delivery: Delivery


Need = PassThrough | ResolvePrincipal | ReadBody | Begin | Run | Abandon | Finish | Send
Exchange = Generator[Need, Any, None]

PASS_THROUGH = PassThrough()
RESOLVE_PRINCIPAL = ResolvePrincipal()
_GONE = "client disconnected before its request body was complete; nothing was claimed"


def sequence(gate: Gate, request: Request, door: Door) -> Exchange:
    """One request, from its method to the answer sent (see the module)."""
    method = request.method
    if not gate.ledger.policy.protects(method) or door.exempt():
        yield PASS_THROUGH
        return
    target = request.target
    key = gate.key(request.key_fields, method=method, target=target)
    if isinstance(key, Answer):
        yield Send(replied(key))
        return
    if key is None and door.key_optional():
        yield PASS_THROUGH
        return

    who = gate.principal((yield RESOLVE_PRINCIPAL), key=key, method=method, target=target)
    if isinstance(who, Answer):
        yield Send(replied(who))
        return
    limit = gate.max_body_bytes
    try:
        declared = declared_length(request.content_length, limit)
        if declared is None and request.unbounded:
            # A body is coming but nothing says where it ends.
            raise length_required()
        body: bytes = yield ReadBody(limit, declared)
        check_read(len(body), limit)
        if request.exact_length:
            check_complete(len(body), declared)
    except BodyRefused as refused:
        yield Send(replied(gate.refused(refused, principal=who, key=key, method=method, target=target)))
        return
    except ClientGone:
        gate.log.info(_GONE)
        return

    decided: Answer | Ticket = yield Begin(who, key, method, target, request.headers, body)
    if isinstance(decided, Answer):
        yield Send(replied(decided))
        return
    capture = gate.capture()
    try:
        yield Run(who, decided.body, capture)
    except BaseException:
        yield Abandon(decided, door.release())
        raise
    delivery: Delivery = yield Finish(decided, capture)
    yield Send(delivery)


__all__ = [
    "PASS_THROUGH",
    "RESOLVE_PRINCIPAL",
    "Abandon",
    "Begin",
    "Door",
    "Exchange",
    "Finish",
    "Need",
    "PassThrough",
    "ReadBody",
    "Request",
    "ResolvePrincipal",
    "Run",
    "Send",
    "sequence",
]
