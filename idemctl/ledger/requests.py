"""The request flow: `begin` decides, the app runs, `finish` stores (or
`abandon` gives up); `handle` is the three around a callable.

The ledger decides; the store only runs single atomic statements. Nothing
here checks a row in Python and then writes based on what it saw: every
decision that matters is inside the WHERE clause of one statement."""

from __future__ import annotations

import time
from collections.abc import Callable
from email.utils import formatdate

from .. import decision, responses
from ..errors import AnswerNotStoredError, InvalidResponseError, StorageError
from ..fingerprint import (
    HeadersLike,
    as_body_bytes,
    check_key,
    fingerprint_body,
    header_pairs,
    is_key_list,
    parse_key,
    request_digest,
)
from ..outcomes import Answer, Event, Outcome, Ticket
from .core import LedgerCore, wall_clock_ms
from .inputs import check_principal, check_request_line
from .steps import SingleSteps

RunResult = tuple[int, HeadersLike | None, bytes | bytearray | memoryview | str]
Mutation = Callable[[bytes], RunResult]

# The answers the ledger makes itself (never an app's, never a replay).
_OWN_ANSWERS = frozenset(
    {
        Outcome.KEY_REQUIRED,
        Outcome.KEY_INVALID,
        Outcome.UNAUTHENTICATED,
        Outcome.REUSED,
        Outcome.IN_PROGRESS,
        Outcome.RETRY,
        Outcome.BODY_REFUSED,
        Outcome.REQUEST_REFUSED,
        Outcome.UNAVAILABLE,
    }
)


class RequestFlow(SingleSteps):
    """Two phases, so that every adapter (WSGI, ASGI, Django, functions) runs
    the app itself between them and the contract lives here alone: `begin`
    decides (one claim, and at most a lookup and a takeover), `finish`
    stores the answer with one fenced statement and returns what was stored.
    Built on a ledger's core and its single steps; :class:`~idemctl.Ledger`
    is one, so these methods are the ledger's own.

    >>> from idemctl import Ledger
    >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
    >>> flow = RequestFlow(ledger.core)
    >>> flow.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b"")).status
    201
    """

    def __init__(self, core: LedgerCore) -> None:
        super().__init__(core)
        # Fixed at opening: read straight off this object on the request path.
        self.events, self._hold = core.events, core.hold

    def begin_steps(
        self,
        principal: str | None,
        key: str | None,
        method: str,
        path_and_query: str,
        headers: HeadersLike | None,
        body: bytes | bytearray | memoryview,
    ) -> decision.Steps[Answer | Ticket]:
        """Decide one request (SPEC §1 and §4): an :class:`Answer` to send as it
        is (a replay, 400, 401, 409), or a :class:`Ticket` that says: run the
        mutation once with ``ticket.body``, then call :meth:`finish` (or
        :meth:`abandon` if it raised). :meth:`begin` runs these steps in the
        calling thread (`idemctl.decision.run`); a driver that does its I/O
        its own way runs them itself (`idemctl.decision.run_async` from an
        event loop): they yield the store operations they need and the
        pauses between the polls of an in-progress wait.

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> ticket = ledger.begin("acct_1", "k1", "POST", "/orders", {}, b'{"sku":"x"}')
        >>> ticket.outcome, ticket.reservation.generation
        (<Outcome.EXECUTED: 'executed'>, 1)
        >>> ledger.finish(ticket, 201, {"content-type": "application/json"}, b'{"id":7}').status
        201
        >>> decision.run(ledger.begin_steps("acct_1", "k1", "POST", "/orders", {}, b'{"sku":"x"}')).outcome
        <Outcome.REPLAYED: 'replayed'>
        """
        policy = self.policy
        raw = as_body_bytes(body, "request body")
        if not policy.protects(method):
            return Ticket(None, Outcome.PASSTHROUGH, raw, None, method, path_and_query, 0.0, time.perf_counter())
        if principal is None or principal == "":
            refusal = Answer(*responses.unauthenticated(), Outcome.UNAUTHENTICATED)
            return self._decided(refusal, None, key, method, path_and_query, 0.0)
        check_principal(principal)
        if key is None or key == "":
            refusal = Answer(*responses.key_required(), Outcome.KEY_REQUIRED)
            return self._decided(refusal, principal, None, method, path_and_query, 0.0)
        parsed = parse_key(key)
        if parsed is None:
            # A list is answered as several fields are where an adapter sees
            # them (a WSGI server joins them with commas): one rule everywhere.
            invalid = responses.key_repeated() if is_key_list(key) else responses.key_invalid()
            refusal = Answer(*invalid, Outcome.KEY_INVALID)
            return self._decided(refusal, principal, None, method, path_and_query, 0.0)
        key = parsed  # "abc" (an sf-string, as the IETF draft sends it) and abc are one key
        check_request_line(method, path_and_query)

        fp_body = raw
        if policy.fingerprint_body != "raw":
            fp_body, _ = fingerprint_body(raw, headers, policy.fingerprint_body, policy.fingerprint_ignore_fields)
        # The policy's names are lower-case already, and the body is bytes.
        fp = request_digest(method, path_and_query, headers, fp_body, policy.fingerprint_headers)
        mark = time.perf_counter()
        try:
            made = self._hold((yield from decision.decide(self.store, policy, self.core.clock, principal, key, fp)))
        except StorageError:
            ms = (time.perf_counter() - mark) * 1000
            at = wall_clock_ms()  # the database clock, if that is the clock, cannot be asked either
            event = Event(Outcome.UNAVAILABLE, principal, key, None, method, path_and_query, 503, ms, None, at)
            self.events.emit(event)
            raise
        spent_ms = (time.perf_counter() - mark) * 1000
        if isinstance(made, decision.Claimed):
            issued = time.perf_counter()  # the app's time starts here
            return Ticket(
                made.reservation, made.outcome, raw, made.now, method, path_and_query, spent_ms, issued, made.waited
            )
        answer = self._answer_for(made, principal, key)
        return self._decided(answer, principal, key, method, path_and_query, spent_ms, made.waited)

    begin = decision.blocking(begin_steps)

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
        check_principal(principal)
        key = check_key(key)
        return self._decide_and_hold(principal, key, fingerprint)

    def _decide_and_hold(self, principal: str, key: str, fingerprint: str) -> decision.Steps[decision.Decision]:
        made = yield from decision.decide(self.store, self.policy, self.core.clock, principal, key, fingerprint)
        return self._hold(made)

    def _answer_for(
        self, made: decision.Completed | decision.Reused | decision.Busy | decision.Vanished, principal: str, key: str
    ) -> Answer:
        """The answer for a decision that runs nothing."""
        if isinstance(made, decision.Vanished):
            # Swept between our failed claim and the lookup: the next try wins the claim.
            return Answer(*responses.retry(), Outcome.RETRY, None, made.now)
        row = made.row
        if isinstance(made, decision.Reused):
            return Answer(*responses.reused(self.policy), Outcome.REUSED, row.generation, made.now)
        if isinstance(made, decision.Busy):
            # The recipe tells the client to come back after a whole TTL; by policy, when the row turns stale.
            retry_ms = made.takeover_in_ms if self.policy.retry_after_from_row else self.policy.pending_ttl_ms
            answer = responses.in_progress(self.policy, retry_ms)
            return Answer(*answer, Outcome.IN_PROGRESS, row.generation, made.now)
        replayed = responses.from_stored(
            row.response_status, row.response_body, row.response_headers, row=(principal, key)
        )
        status, out_headers, out_body = self._shape_stored(replayed)
        if (expires := self.policy.expires_header) is not None:
            out_headers = self._with_expiry(out_headers, expires, row.updated_at)
        return Answer(status, out_headers, out_body, Outcome.REPLAYED, row.generation, made.now)

    def _shape_stored(self, answer: tuple[int, responses.Headers, bytes]) -> tuple[int, responses.Headers, bytes]:
        """An answer built from a stored row: the app's, untouched, or the
        oversize sentinel's, which is the ledger's own error and shaped as
        the other refusals are."""
        return self.shape(answer) if self.policy.problem_details and responses.is_not_stored(answer) else answer

    def _with_expiry(
        self, headers: tuple[tuple[str, str], ...], name: str, updated_at: int
    ) -> tuple[tuple[str, str], ...]:
        """The answer's headers and `name`: when its row expires from the ledger."""
        until = (updated_at + self.policy.retention_ms) / 1000
        return (*headers, (name, formatdate(until, usegmt=True)))

    def _decided(
        self,
        answer: Answer,
        principal: str | None,
        key: str | None,
        method: str,
        path: str,
        ledger_ms: float,
        waited: bool = False,
    ) -> Answer:
        if self.events.heard(answer.outcome):
            at = answer.started_at if answer.started_at is not None else self.core.now()
            status, generation = answer.status, answer.generation
            event = Event(answer.outcome, principal, key, generation, method, path, status, ledger_ms, None, at, waited)
            self.events.emit(event)
        if self.policy.problem_details and answer.outcome in _OWN_ANSWERS:
            shaped = responses.as_problem((answer.status, answer.headers, answer.body))
            return Answer(*shaped, answer.outcome, answer.generation, answer.started_at)
        return answer

    def shape(self, answer: tuple[int, responses.Headers, bytes]) -> tuple[int, responses.Headers, bytes]:
        """One of idemctl's own error answers as the policy wants it: the
        recipe's ``{"error": ...}`` JSON, or RFC 9457 problem details with
        ``Policy(problem_details=True)``.

        >>> from idemctl import Ledger, Policy
        >>> Ledger.open(":memory:", policy=Policy(problem_details=True)).shape(responses.key_required())[1]
        (('content-type', 'application/problem+json'),)
        """
        return responses.as_problem(answer) if self.policy.problem_details else answer

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
        answer = Answer(*self.shape(refusal), outcome)
        if self.events.heard(outcome):
            event = Event(outcome, principal, key, None, method, path, answer.status, 0.0, None, wall_clock_ms())
            self.events.emit(event)
        return answer

    def finish_steps(
        self,
        ticket: Ticket,
        status: int,
        headers: HeadersLike | None,
        body: bytes | bytearray | memoryview | str | responses.OversizeBody,
    ) -> decision.Steps[Answer]:
        """Store the mutation's answer with one fenced statement and return the
        answer built from what was stored (equal to every later replay). A
        late owner is fenced out: it still gets the answer it computed, and
        the event is recorded. If the store fails, AnswerNotStoredError
        carries the answer the app computed, shaped as a stored one.
        :meth:`finish` runs these steps in the calling thread (see
        :meth:`begin_steps`).

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> ticket = ledger.begin("acct_1", "k2", "POST", "/orders", {}, b"{}")
        >>> answer = ledger.finish(ticket, 201, {"location": "/orders/8"}, b"ok")
        >>> answer.outcome, answer.header("location"), answer.body
        (<Outcome.EXECUTED: 'executed'>, '/orders/8', b'ok')
        >>> ticket = ledger.begin("acct_1", "k3", "POST", "/orders", {}, b"{}")
        >>> decision.run(ledger.finish_steps(ticket, 201, {}, b"ok")).body
        b'ok'
        """
        reservation = ticket.reservation
        if reservation is None:
            if isinstance(body, responses.OversizeBody):
                raise InvalidResponseError("an unprotected answer is passed through whole, never as its size")
            raw = body.encode("utf-8") if isinstance(body, str) else as_body_bytes(body, "response body")
            return Answer(status, tuple(header_pairs(headers)), raw, Outcome.PASSTHROUGH)
        self._drop(reservation)
        app_ms = (time.perf_counter() - ticket.issued) * 1000 if ticket.issued else None
        mark = time.perf_counter()
        stored = self._prepare(reservation, status, headers, body)
        computed = self._shape_stored(stored.answer)
        keep = self.policy.keep_answer
        # keep_answer judges what the app answered (its status and the
        # headers kept of it): an oversize answer's 500 sentinel is the
        # ledger's own, and is stored like any kept answer.
        if keep is not None and not keep(status, stored.wire_headers):
            # Not an answer to keep (say a 503): release, so the retry runs again.
            yield from self._release_quietly(reservation)
            answer = Answer(*computed, Outcome.NOT_KEPT, reservation.generation, ticket.started_at)
            self._finished(ticket, answer.outcome, answer.status, mark, app_ms)
            return answer
        try:
            # Inside the guard: with clock="database", reading the clock is a
            # statement too, and any storage failure after the mutation ran
            # must hand back the answer it computed.
            clock = self.core.clock
            stamp = int(clock()) if clock != self.store.database_now else (yield from self._stamp_steps(reservation))
            stored_ok, _ = yield from self._store_answer(reservation, stored, stamp)
        except StorageError as exc:
            answer = Answer(*computed, ticket.outcome, reservation.generation, ticket.started_at)
            self._finished(ticket, Outcome.NOT_STORED, answer.status, mark, app_ms)
            raise AnswerNotStoredError(answer, exc) from exc
        status, out_headers, out_body = computed
        if stored_ok:
            outcome = ticket.outcome
            if (expires := self.policy.expires_header) is not None:
                out_headers = self._with_expiry(out_headers, expires, stamp)
        else:
            outcome = Outcome.FENCED_OUT
        answer = Answer(status, out_headers, out_body, outcome, reservation.generation, ticket.started_at)
        self._finished(ticket, outcome, status, mark, app_ms)
        return answer

    finish = decision.blocking(finish_steps)

    def _finished(
        self, ticket: Ticket, outcome: Outcome, status: int | None, mark: float, app_ms: float | None
    ) -> None:
        if not self.events.heard(outcome):
            return
        reservation = ticket.reservation
        ledger_ms = ticket.ledger_ms + (time.perf_counter() - mark) * 1000
        self.events.emit(
            Event(
                outcome,
                reservation.principal if reservation else None,
                reservation.key if reservation else None,
                reservation.generation if reservation else None,
                ticket.method,
                ticket.path,
                status,
                ledger_ms,
                app_ms,
                ticket.started_at if ticket.started_at is not None else self.core.now(),
                ticket.waited,
            )
        )

    def abandon_steps(self, ticket: Ticket, *, release: bool = False) -> decision.Steps[None]:
        """The mutation raised. By default the reservation stays pending and a
        retry takes it over after the TTL; ``release=True`` (for mutations
        known to have rolled back) deletes it so a retry runs at once. Never
        raises: a failed release is logged. :meth:`abandon` runs these steps
        in the calling thread (see :meth:`begin_steps`).

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> ticket = ledger.begin("acct_1", "k3", "POST", "/orders", {}, b"{}")
        >>> ledger.abandon(ticket, release=True)
        >>> ledger.lookup("acct_1", "k3") is None
        True
        """
        reservation = ticket.reservation
        if reservation is None:
            return
        self._drop(reservation)
        app_ms = (time.perf_counter() - ticket.issued) * 1000 if ticket.issued else None
        mark = time.perf_counter()
        if release:
            yield from self._release_quietly(reservation)
        self._finished(ticket, Outcome.FAILED, None, mark, app_ms)

    abandon = decision.blocking(abandon_steps)

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
        decided = self.begin(principal, key, method, path_and_query, headers, body)
        if isinstance(decided, Answer):
            return decided
        try:
            status, out_headers, out_body = run(decided.body)
        except BaseException:
            self.abandon(decided, release=release_on_error)
            raise
        return self.finish(decided, status, out_headers, out_body)
