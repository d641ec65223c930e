"""The request path's methods of :class:`~idemctl.Ledger`, declared with
their signatures and documentation: decide a request (``begin``), store
its answer (``finish``) or give up (``abandon``), the three around a
callable (``handle``), the decision loop (``decide``), the adapters'
refusals (``refuse``, ``shape``), the post-response sweep
(``after_response``, ``sweep_due``) and the single steps (``claim``,
``lookup``, ``takeover``, ``complete``, ``release``).

Every ledger carries each part's own method under these names (bound in
``Ledger.__init__``), and an instance's attribute shadows its class's
function: a request calls the part directly, and these are what
``help()``, documentation generators and type checkers read. So on an
instance ``self.<name>`` is the part's method, and each body here calls
it; a body runs only when reached through the class
(``Ledger.handle(ledger, ...)``). tests/ledger/test_ledger_face.py holds
their signatures to the parts'."""

from __future__ import annotations

from .. import decision, responses
from ..fingerprint import HeadersLike
from ..outcomes import Answer, Completion, Outcome, Reservation, StoredRow, SweepResult, Ticket
from .requests import Mutation


class RequestFace:
    """What apps and adapters call on a ledger to run a request (see the
    module's docstring): documentation and types, no state.

    >>> from idemctl import Ledger
    >>> [name for name in ("begin", "finish", "handle", "claim") if name in vars(RequestFace)]
    ['begin', 'finish', 'handle', 'claim']
    """

    def begin_steps(
        self,
        principal: str | None,
        key: str | None,
        method: str,
        path_and_query: str,
        headers: HeadersLike | None,
        body: bytes | bytearray | memoryview,
    ) -> decision.Steps[Answer | Ticket]:
        """:meth:`begin` as steps, for a driver that does its I/O its own
        way: they yield the store operations they need and the pauses
        between the polls of an in-progress wait. :meth:`begin` runs them
        in the calling thread (`idemctl.decision.run`);
        `idemctl.decision.run_async` from an event loop.

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> decision.run(ledger.begin_steps("acct_1", "k9", "POST", "/orders", {}, b"")).outcome
        <Outcome.EXECUTED: 'executed'>
        """
        return self.begin_steps(principal, key, method, path_and_query, headers, body)

    def begin(
        self,
        principal: str | None,
        key: str | None,
        method: str,
        path_and_query: str,
        headers: HeadersLike | None,
        body: bytes | bytearray | memoryview,
    ) -> Answer | Ticket:
        """Decide one request (SPEC §1 and §4): an :class:`Answer` to send as it
        is (a replay, 400, 401, 409), or a :class:`Ticket` that says: run the
        mutation once with ``ticket.body``, then call :meth:`finish` (or
        :meth:`abandon` if it raised).

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> ticket = ledger.begin("acct_1", "k1", "POST", "/orders", {}, b'{"sku":"x"}')
        >>> ticket.outcome, ticket.reservation.generation
        (<Outcome.EXECUTED: 'executed'>, 1)
        >>> ledger.finish(ticket, 201, {"content-type": "application/json"}, b'{"id":7}').status
        201
        >>> ledger.begin("acct_1", "k1", "POST", "/orders", {}, b'{"sku":"x"}').outcome
        <Outcome.REPLAYED: 'replayed'>
        """
        return self.begin(principal, key, method, path_and_query, headers, body)

    def finish_steps(
        self,
        ticket: Ticket,
        status: int,
        headers: HeadersLike | None,
        body: bytes | bytearray | memoryview | str | responses.OversizeBody,
    ) -> decision.Steps[Answer]:
        """:meth:`finish` as steps, for a driver that does its I/O its own
        way (see :meth:`begin_steps`).

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> ticket = ledger.begin("acct_1", "k1", "POST", "/orders", {}, b"")
        >>> decision.run(ledger.finish_steps(ticket, 201, {}, b"ok")).body
        b'ok'
        """
        return self.finish_steps(ticket, status, headers, body)

    def finish(
        self,
        ticket: Ticket,
        status: int,
        headers: HeadersLike | None,
        body: bytes | bytearray | memoryview | str | responses.OversizeBody,
    ) -> Answer:
        """Store the mutation's answer with one fenced statement and return the
        answer built from what was stored (equal to every later replay). A
        late owner is fenced out: it still gets the answer it computed, and
        the event is recorded. If the store fails, AnswerNotStoredError
        carries the answer the app computed, shaped as a stored one.

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> ticket = ledger.begin("acct_1", "k2", "POST", "/orders", {}, b"{}")
        >>> answer = ledger.finish(ticket, 201, {"location": "/orders/8"}, b"ok")
        >>> answer.outcome, answer.header("location"), answer.body
        (<Outcome.EXECUTED: 'executed'>, '/orders/8', b'ok')
        """
        return self.finish(ticket, status, headers, body)

    def abandon_steps(self, ticket: Ticket, *, release: bool = False) -> decision.Steps[None]:
        """:meth:`abandon` as steps, for a driver that does its I/O its own
        way (see :meth:`begin_steps`).

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> ticket = ledger.begin("acct_1", "k3", "POST", "/orders", {}, b"{}")
        >>> decision.run(ledger.abandon_steps(ticket, release=True)), ledger.lookup("acct_1", "k3")
        (None, None)
        """
        return self.abandon_steps(ticket, release=release)

    def abandon(self, ticket: Ticket, *, release: bool = False) -> None:
        """The mutation raised. By default the reservation stays pending and a
        retry takes it over after the TTL; ``release=True`` (for mutations
        known to have rolled back) deletes it so a retry runs at once. Never
        raises: a failed release is logged.

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> ticket = ledger.begin("acct_1", "k3", "POST", "/orders", {}, b"{}")
        >>> ledger.abandon(ticket, release=True)
        >>> ledger.lookup("acct_1", "k3") is None
        True
        """
        return self.abandon(ticket, release=release)

    def handle(
        self,
        principal: str | None,
        key: str | None,
        method: str,
        path_and_query: str,
        headers: HeadersLike | None,
        body: bytes,
        run: Mutation,
        *,
        release_on_error: bool = False,
    ) -> Answer:
        """Run one request under the Idempotency-Key contract: :meth:`begin`,
        then `run(body)` at most once when this caller owns the reservation,
        then :meth:`finish`. `run` returns ``(status, headers, body)``. Call
        :meth:`after_response` once the answer has been sent.

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> order = lambda body: (201, {"content-type": "application/json"}, b'{"id":7}')
        >>> answer = ledger.handle("acct_1", "k1", "POST", "/orders", {}, b'{"sku":"x"}', order)
        >>> answer.status, answer.outcome
        (201, <Outcome.EXECUTED: 'executed'>)
        >>> ledger.handle("acct_1", "k1", "POST", "/orders", {}, b'{"sku":"x"}', order).outcome
        <Outcome.REPLAYED: 'replayed'>
        """
        return self.handle(
            principal, key, method, path_and_query, headers, body, run, release_on_error=release_on_error
        )

    def decide(self, principal: str, key: str, fingerprint: str) -> decision.Steps[decision.Decision]:
        """The decision loop itself, for integrations with their own request
        shape (idempotent functions): claim, or look up and branch, with the
        policy's in-progress wait. Drive it with `idemctl.decision.run` (or
        `run_async`); a :class:`~idemctl.decision.Claimed` result owns the
        reservation.

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> decision.run(ledger.decide("billing", "pay_1", "fp")).outcome
        <Outcome.EXECUTED: 'executed'>
        >>> type(decision.run(ledger.decide("billing", "pay_1", "other"))).__name__
        'Reused'
        """
        return self.decide(principal, key, fingerprint)

    def refuse(
        self,
        refusal: tuple[int, responses.Headers, bytes],
        outcome: Outcome,
        *,
        principal: str | None,
        key: str | None,
        method: str,
        path: str,
    ) -> Answer:
        """An answer an adapter makes before the ledger is asked (401, a body
        it cannot read, a repeated key field), published as an event like
        every decision of the ledger's own.

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> seen = []; _ = ledger.subscribe(seen.append)
        >>> ledger.refuse(responses.unauthenticated(), Outcome.UNAUTHENTICATED,
        ...               principal=None, key="k1", method="POST", path="/orders").status
        401
        >>> seen[0].outcome.value, seen[0].key
        ('unauthenticated', 'k1')
        """
        return self.refuse(refusal, outcome, principal=principal, key=key, method=method, path=path)

    def shape(self, answer: tuple[int, responses.Headers, bytes]) -> tuple[int, responses.Headers, bytes]:
        """One of idemctl's own error answers as the policy wants it: the
        recipe's ``{"error": ...}`` JSON, or RFC 9457 problem details with
        ``Policy(problem_details=True)``.

        >>> from idemctl import Ledger, Policy
        >>> Ledger.open(":memory:", policy=Policy(problem_details=True)).shape(responses.key_required())[1]
        (('content-type', 'application/problem+json'),)
        """
        return self.shape(answer)

    def sweep_due(self, answer: Answer) -> bool:
        """Whether `after_response(answer)` would run a statement: only for
        answers that ran the mutation, and not while the last probe showed
        nothing can expire yet. No I/O, so an async adapter can skip the
        hand-off to a thread.

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> first = ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b""))
        >>> ledger.sweep_due(first), ledger.after_response(first).quiet_for_ms > 0, ledger.sweep_due(first)
        (True, True, False)
        """
        return self.sweep_due(answer)

    def after_response_steps(self, answer: Answer) -> decision.Steps[SweepResult | None]:
        """:meth:`after_response` as steps, for a driver that does its I/O
        its own way (see :meth:`begin_steps`).

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:", clock=lambda: 1_700_000_000_000); _ = ledger.init()
        >>> answer = ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b""))
        >>> decision.run(ledger.after_response_steps(answer)).deleted
        0
        """
        return self.after_response_steps(answer)

    def after_response(self, answer: Answer) -> SweepResult | None:
        """The post-response housekeeping of SPEC §4.9: one bounded sweep batch
        at the request's own `now`. Call it after the answer has been sent.
        It never raises: a failed sweep is logged and retried by the next request.

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:", clock=lambda: 1_700_000_000_000); _ = ledger.init()
        >>> answer = ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b""))
        >>> ledger.after_response(answer).deleted
        0
        """
        return self.after_response(answer)

    def claim(self, principal: str, key: str, fingerprint: str, *, now: int | None = None) -> Reservation | None:
        """Atomically claim (principal, key) as generation 1; None if it exists.

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> ledger.claim("acct_1", "k1", "fp").generation, ledger.claim("acct_1", "k1", "fp")
        (1, None)
        """
        return self.claim(principal, key, fingerprint, now=now)

    def lookup(self, principal: str, key: str) -> StoredRow | None:
        """The stored row, or None.

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> _ = ledger.claim("acct_1", "k1", "fp")
        >>> ledger.lookup("acct_1", "k1").status
        <Status.PENDING: 'pending'>
        """
        return self.lookup(principal, key)

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
        return self.takeover(principal, key, fingerprint, now=now)

    def complete_steps(
        self,
        reservation: Reservation,
        status: int,
        headers: HeadersLike | None,
        body: bytes | bytearray | memoryview | str,
        *,
        now: int | None = None,
    ) -> decision.Steps[Completion]:
        """:meth:`complete` as steps, for a driver that does its I/O its own
        way (see :meth:`begin_steps`).

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> reservation = ledger.claim("acct_1", "k1", "fp")
        >>> decision.run(ledger.complete_steps(reservation, 201, {}, b"ok")).stored
        True
        """
        return self.complete_steps(reservation, status, headers, body, now=now)

    def complete(
        self,
        reservation: Reservation,
        status: int,
        headers: HeadersLike | None,
        body: bytes | bytearray | memoryview | str,
        *,
        now: int | None = None,
    ) -> Completion:
        """Store the answer if `reservation` still holds the current generation.
        When fenced out, the event is recorded and logged at ERROR, and the
        caller still gets the answer it computed.

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> reservation = ledger.claim("acct_1", "k1", "fp")
        >>> ledger.complete(reservation, 201, {"content-type": "text/plain"}, b"ok").stored
        True
        >>> ledger.complete(reservation, 201, {}, b"again").stored  # already completed
        False
        """
        return self.complete(reservation, status, headers, body, now=now)

    def release_steps(self, reservation: Reservation) -> decision.Steps[bool]:
        """:meth:`release` as steps, for a driver that does its I/O its own
        way (see :meth:`begin_steps`).

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> decision.run(ledger.release_steps(ledger.claim("acct_1", "k1", "fp")))
        True
        """
        return self.release_steps(reservation)

    def release(self, reservation: Reservation) -> bool:
        """Opt-in: delete a pending reservation whose mutation is known to have
        rolled back, so the client's retry runs again at once. Fenced like a
        completion: it deletes the row only while it is still this
        reservation's (generation and token), never a newer owner's.

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> reservation = ledger.claim("acct_1", "k1", "fp")
        >>> ledger.release(reservation), ledger.release(reservation)
        (True, False)
        """
        return self.release(reservation)
