"""One protected request, in the contract's order, with no I/O of its own.

:func:`sequence` is the whole exchange of one request with the ledger,
written once for every door: passthrough (a method the policy does not
protect, an exempt request, a keyless one that `key_optional` lets by),
the key fields (400 for several), the principal (401), the body rules
(400, 411, 413, or a client gone mid-body), the decision (replay, 409, 4xx,
503), the app's run, its answer stored (or, when storing fails, the app's
own answer sent with an ERROR line), the reservation abandoned or released
when the app fails, and the answer sent with the sweep that may follow it.

It is a generator, and the ledger's own steps (`Ledger.begin_steps`,
`finish_steps`, `abandon_steps`) are part of it (``yield from``): it
yields the store operations and pauses those steps need, and what only
the door can do (the small classes below), and is sent what each
produced. A driver (:mod:`idemctl.exchange.drive`, one for threads, one
for an event loop) runs the store's work itself and hands the rest to
the door: a small object that knows its framework (see :class:`Door`).
What each refusal answers (401, 503, ...) is the
:class:`~idemctl.exchange.gate.Gate`'s. A door only turns its framework's
request into a :class:`Request` and its answers into the framework's
response.

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
from typing import Any, Protocol

from ..errors import AnswerNotStoredError, InvalidPrincipalError, InvalidRequestError, StorageError
from ..outcomes import Answer, Ticket
from .body import BodyRefused, ClientGone, check_complete, check_read, declared_length, length_required
from .capture import Capture
from .gate import Delivery, Gate, replied


class Request:
    """What the sequence needs to know of a request, as the door parsed it:
    the method (upper case), the target the fingerprint covers, every
    ``Idempotency-Key`` field the door can see, the fingerprint headers
    (lower-case names, as sent), the Content-Length field as received
    (None without one), and whether a body is coming that nothing
    delimits (a Transfer-Encoding the server does not de-chunk: 411)."""

    __slots__ = ("content_length", "exact_length", "headers", "key_fields", "method", "target", "unbounded")

    def __init__(
        self,
        method: str,
        target: str,
        key_fields: Sequence[str],
        headers: Sequence[tuple[str, str]],
        content_length: str | None,
        unbounded: bool,
        exact_length: bool = True,
    ) -> None:
        self.method, self.target, self.key_fields = method, target, key_fields
        self.headers, self.content_length = headers, content_length
        self.unbounded, self.exact_length = unbounded, exact_length


class Door(Protocol):
    """The per-request questions a door answers synchronously, without I/O
    (its framework's options: `exempt`, `key_optional`, `release_on_error`)."""

    def exempt(self) -> bool: ...
    def key_optional(self) -> bool: ...
    def release(self) -> bool: ...


class EveryRequestProtected:
    """The :class:`Door` answers of a door wrapped around chosen views
    (Flask's decorator, FastAPI's route): nothing is exempt, a key is never
    optional, and `release_on_error` is one flag for the whole door."""

    __slots__ = ()
    release_on_error: bool

    def exempt(self) -> bool:
        return False

    def key_optional(self) -> bool:
        return False

    def release(self) -> bool:
        return self.release_on_error


# -- what the sequence needs ------------------------------------------------------------
# Plain classes with slots, not frozen dataclasses: a frozen dataclass pays an
# object.__setattr__ per field, and every request makes several of these.
class _Need:
    __slots__ = ()

    def __repr__(self) -> str:
        names: tuple[str, ...] = self.__slots__
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in names)
        return f"{type(self).__name__}({fields})"


class PassThrough(_Need):
    """Run the app as if idemctl were not there; nothing more follows."""

    __slots__ = ()


class ResolvePrincipal(_Need):
    """The principal the app's auth layer resolves (a str, or None)."""

    __slots__ = ()


class ReadBody(_Need):
    """The whole request body, at most `limit` bytes; `declared` is its
    Content-Length (None when unknown). May raise BodyRefused or ClientGone."""

    __slots__ = ("declared", "limit")

    def __init__(self, limit: int, declared: int | None) -> None:
        self.limit, self.declared = limit, declared


class Run(_Need):
    """Run the app once on `body` with `principal`, its answer into `capture`.
    Raising means the app failed. `ticket` is the reservation it runs under."""

    __slots__ = ("body", "capture", "principal", "ticket")

    def __init__(self, principal: str, body: bytes, capture: Capture, ticket: Ticket) -> None:
        self.principal, self.body = principal, body
        self.capture, self.ticket = capture, ticket


class Send(_Need):
    """Send this answer, with the post-response sweep the gate allows after it."""

    __slots__ = ("delivery",)

    def __init__(self, delivery: Delivery) -> None:
        self.delivery = delivery


#: What only a door can do; the sequence also yields the store's operations
#: and pauses (`idemctl.decision`), which the drivers run themselves.
Need = PassThrough | ResolvePrincipal | ReadBody | Run | Send
Exchange = Generator[Any, Any, None]

PASS_THROUGH = PassThrough()
RESOLVE_PRINCIPAL = ResolvePrincipal()
_GONE = "client disconnected before its request body was complete; nothing was claimed"


def sequence(gate: Gate, request: Request, door: Door) -> Exchange:
    """One request, from its method to the answer sent (see the module)."""
    # Each request pays for every call made here: the common path inlines
    # the gate's checks and leaves the gate only the refusals.
    method = request.method
    ledger = gate.ledger
    if method not in ledger.policy.protected_methods or door.exempt():
        yield PASS_THROUGH
        return
    target = request.target
    fields = request.key_fields
    if len(fields) > 1:
        yield Send(replied(gate.key_repeated(method, target)))
        return
    key = fields[0] if fields else None
    if key is None and door.key_optional():
        yield PASS_THROUGH
        return

    who = yield RESOLVE_PRINCIPAL
    if who.__class__ is not str or not who:
        refused = gate.principal(who, key=key, method=method, target=target)
        if isinstance(refused, Answer):
            yield Send(replied(refused))
            return
        who = refused
    limit = gate.max_body_bytes
    try:
        length = request.content_length
        if length is None:
            declared = None
        elif length.__class__ is str and length.isdigit() and length.isascii() and int(length) <= limit:
            declared = int(length)  # the usual field: declared_length's answer without its call
        else:
            declared = declared_length(length, limit)
        if declared is None and request.unbounded:
            # A body is coming but nothing says where it ends.
            raise length_required()
        body: bytes = yield ReadBody(limit, declared)
        received = len(body)
        if received > limit:
            check_read(received, limit)
        if declared is not None and received != declared and request.exact_length:
            check_complete(received, declared)
    except BodyRefused as refused_body:
        yield Send(replied(gate.refused(refused_body, principal=who, key=key, method=method, target=target)))
        return
    except ClientGone:
        gate.log.info(_GONE)
        return

    try:
        decided = yield from ledger.begin_steps(who, key, method, target, request.headers, body)
    except StorageError as exc:
        decided = gate.unavailable(exc, method, target)
    except (InvalidPrincipalError, InvalidRequestError) as exc:
        decided = gate.unacceptable(exc, who, key, method, target)
    if not isinstance(decided, Ticket):
        yield Send(Delivery(decided, True))
        return
    capture = Capture(ledger.policy.body_cap_bytes)
    try:
        yield Run(who, decided.body, capture, decided)
    except GeneratorExit:
        raise  # closed by a driver that released the claim itself (its request was cancelled)
    except BaseException:
        yield from ledger.abandon_steps(decided, release=door.release())
        raise
    status, headers, answer_body = capture.answer()
    try:
        answer = yield from ledger.finish_steps(decided, status, headers, answer_body)
    except AnswerNotStoredError as exc:
        yield Send(gate.not_stored(exc, decided))
        return
    yield Send(Delivery(answer, True))


__all__ = [
    "PASS_THROUGH",
    "RESOLVE_PRINCIPAL",
    "Door",
    "EveryRequestProtected",
    "Exchange",
    "Need",
    "PassThrough",
    "ReadBody",
    "Request",
    "ResolvePrincipal",
    "Run",
    "Send",
    "sequence",
]
