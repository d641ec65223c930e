"""The ledger: the Idempotency-Key contract on top of the SQL store.

The ledger decides; the store only runs single atomic statements. Nothing
here checks a row in Python and then writes based on what it saw: every
decision that matters is inside the WHERE clause of one statement."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from email.utils import formatdate

from . import copying, decision, functions, responses
from .errors import (
    AnswerNotStoredError,
    IdemctlError,
    InvalidPrincipalError,
    InvalidRequestError,
    InvalidResponseError,
    MalformedRowError,
    PolicyError,
    SchemaMissingError,
    StorageError,
)
from .fingerprint import (
    HeadersLike,
    as_body_bytes,
    check_key,
    fingerprint,
    fingerprint_body,
    header_pairs,
    parse_key,
)
from .leases import LeaseKeeper
from .outcomes import (
    Answer,
    Completion,
    Drained,
    DrainStop,
    Event,
    FencedEvent,
    InitResult,
    Outcome,
    Prediction,
    PurgeResult,
    Reservation,
    RowView,
    State,
    Stats,
    Status,
    StoredRow,
    SweepResult,
    Ticket,
    Verdict,
)
from .policy import Policy
from .storage import DEFAULT_FILE_MODE, SqliteOptions, Store, is_server_url, open_engine
from .storage.aio import AsyncStore
from .storage.store import derive_state, new_token

log = logging.getLogger("idemctl")
# One structured line per non-trivial decision; the fields ride in `extra`
# (idemctl_outcome, idemctl_principal, ...) for JSON log formatters.
events_log = logging.getLogger("idemctl.events")

Clock = Callable[[], int]
RunResult = tuple[int, HeadersLike | None, bytes | bytearray | memoryview | str]
Mutation = Callable[[bytes], RunResult]


def wall_clock_ms() -> int:
    """Milliseconds since the epoch, the unit of every timestamp in the ledger."""
    return time.time_ns() // 1_000_000


class Ledger:
    """An idempotency ledger. Safe to share between threads; each thread (and
    each forked process) gets its own database connection.

    >>> ledger = Ledger.open(":memory:")  # a file path or a postgresql:// URL
    >>> ledger.init().describe()
    'created (schema version 2)'
    >>> ledger.handle("acct_1", "key-1", "POST", "/orders", {}, b"{}",
    ...               lambda body: (201, {"content-type": "application/json"}, b'{"id":1}')).status
    201
    """

    def __init__(self, store: Store, *, policy: Policy | None = None, clock: Clock | str | None = None) -> None:
        self.store = store
        self.policy = policy if policy is not None else Policy()
        if clock == "database":
            # Every host sharing the ledger asks the database what time it is,
            # so skewed host clocks still agree on TTL, takeover and sweep.
            self.clock: Clock = store.database_now
        elif isinstance(clock, str):
            raise PolicyError(f"clock must be a callable or 'database', got {clock!r}")
        else:
            self.clock = clock if clock is not None else wall_clock_ms
        #: This process's live reservations, renewed together (Policy.lease_renewal), or None.
        self.leases: LeaseKeeper | None = None
        if self.policy.lease_renewal:
            self.leases = LeaseKeeper(
                self._renew, interval_s=self.policy.pending_ttl_ms / 3000, max_s=self.policy.lease_max_ms / 1000
            )
        self._listeners: tuple[Callable[[Event], object], ...] = ()
        self._listeners_lock = threading.Lock()
        # Until when this process's post-response sweep has nothing to do.
        self._sweep_rests_until = 0
        # The asynchronous request path, one store per event loop (see async_store).
        self._async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncStore] = weakref.WeakKeyDictionary()
        self._async_lock = threading.Lock()

    # -- events -------------------------------------------------------------------------
    def subscribe(self, listener: Callable[[Event], object]) -> Callable[[], None]:
        """Call `listener(event)` for every decision; returns the function that
        unsubscribes it. A listener that raises is logged and never fails a
        request. Listeners run in the request's thread: keep them quick.

        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> seen = []
        >>> stop = ledger.subscribe(seen.append)
        >>> _ = ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b""))
        >>> _ = ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b""))
        >>> [e.outcome.value for e in seen]
        ['executed', 'replayed']
        >>> stop()
        """
        with self._listeners_lock:
            self._listeners = (*self._listeners, listener)

        def unsubscribe() -> None:
            with self._listeners_lock:
                self._listeners = tuple(x for x in self._listeners if x is not listener)

        return unsubscribe

    def publish(self, event: Event) -> None:
        """Deliver an event to the listeners and the `idemctl.events` log: for
        integrations that decide outside `begin`/`finish` (idempotent
        functions use it). Never raises because of a listener."""
        self._emit(event)

    def _heard(self, outcome: Outcome) -> bool:
        """Whether an event of this outcome reaches anyone: a listener, or
        the `idemctl.events` log. When not, the request path builds no Event
        at all (most requests of an app without metrics)."""
        return bool(self._listeners) or (outcome not in _QUIET and events_log.isEnabledFor(logging.INFO))

    def _emit(self, event: Event) -> None:
        if event.outcome not in _QUIET and events_log.isEnabledFor(logging.INFO):
            level = logging.ERROR if event.outcome in _LOUD else logging.INFO
            events_log.log(
                level,
                "%s %s %s principal=%s key=%s generation=%s status=%s ledger=%.1fms app=%s",
                event.outcome.value,
                event.method,
                event.path,
                event.principal,
                event.key,
                event.generation,
                event.status,
                event.ledger_ms,
                "-" if event.app_ms is None else f"{event.app_ms:.1f}ms",
                extra={f"idemctl_{name}": value for name, value in _event_fields(event).items()},
            )
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a listener must never fail the request it observes
                log.exception("an idemctl event listener failed on %s", event.outcome.value)

    @classmethod
    def open(
        cls,
        target: str | os.PathLike[str],
        *,
        policy: Policy | None = None,
        clock: Clock | str | None = None,
        create: bool = True,
        readonly: bool = False,
        busy_timeout_ms: int = 5000,
        synchronous: str = "FULL",
        write_queue: bool = True,
        file_mode: int = DEFAULT_FILE_MODE,
        group_commit: bool = False,
    ) -> Ledger:
        """Open a ledger: a SQLite file path, a ``postgresql://`` or a ``mysql://`` URL.

        Opening never creates anything: :meth:`init` creates the schema (and
        a SQLite file, with permission bits ``file_mode``: owner-only 0o600
        by default, 0o660 to share it with the group; SQLite gives its -wal
        and -shm files the same bits). ``create=False`` refuses a missing
        SQLite file at once (LedgerNotFoundError); ``readonly=True`` never
        writes. On SQLite, ``synchronous`` is the PRAGMA of that name and
        ``write_queue=False`` turns off the fair writer queue
        (docs/performance.md); ``group_commit=True`` lets concurrent
        threads of this process share one commit, and so one fsync, each
        returning once the commit holding its own write is durable
        (docs/library.md).

        >>> Ledger.open(":memory:", policy=Policy(pending_ttl_ms=60_000)).policy.retry_after_seconds
        60
        """
        sqlite = SqliteOptions(
            create=create, synchronous=synchronous, write_queue=write_queue, file_mode=file_mode,
            group_commit=group_commit,
        )
        engine = open_engine(target, readonly=readonly, busy_timeout_ms=busy_timeout_ms, sqlite=sqlite)
        store = Store(engine)
        if not is_server_url(target):
            # A file's schema is checked at open (it costs no connection):
            # a ledger written by a newer idemctl is refused before any use.
            try:
                store.check_not_newer()
            except BaseException:
                store.close()
                raise
        return cls(store, policy=policy, clock=clock)

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.leases is not None:
            self.leases.close()
        with self._async_lock:
            stores = list(self._async.items())
            self._async.clear()
        for loop, store in stores:
            if loop.is_closed() or not loop.is_running():
                store.abandon()
            else:  # its loop runs in another thread: close it there, the asynchronous way
                asyncio.run_coroutine_threadsafe(store.aclose(), loop)
        self.store.close()

    def _renew(self, held: list[Reservation]) -> int:
        return self.store.renew([(r.principal, r.key, r.generation, r.token) for r in held], self.now())

    def _hold(self, made: decision.Decision) -> decision.Decision:
        if self.leases is not None and isinstance(made, decision.Claimed):
            self.leases.hold(made.reservation)
        return made

    def _drop(self, reservation: Reservation | None) -> None:
        if self.leases is not None and reservation is not None:
            self.leases.drop(reservation)

    def async_store(self) -> AsyncStore | None:
        """The asynchronous request path for the running event loop, opened
        on first use: on PostgreSQL, psycopg's asynchronous connections in
        a pool of this loop's own, running the same statements as the
        synchronous path (the ASGI middleware, the FastAPI route class and
        async idempotent functions use it). None on SQLite, whose driver
        has no asynchronous I/O: there they run in worker threads. Close it
        with :meth:`aclose` (say in the app's lifespan shutdown).

        >>> import asyncio
        >>> asyncio.run(Ledger.open(":memory:").aclose()) is None
        True
        """
        open_async = getattr(self.store.engine, "open_async", None)
        if open_async is None:
            return None
        loop = asyncio.get_running_loop()
        store = self._async.get(loop)
        if store is not None:
            return store
        with self._async_lock:
            store = self._async.get(loop)
            if store is None:
                # Pools of loops that have ended cannot be closed by them any more.
                for gone in [other for other in self._async if other.is_closed()]:
                    self._async.pop(gone).abandon()
                store = self._async[loop] = AsyncStore(self.store, open_async())
            return store

    async def aclose(self) -> None:
        """Close the running event loop's asynchronous connections (see
        :meth:`async_store`); the next request on this loop opens them again."""
        with self._async_lock:
            store = self._async.pop(asyncio.get_running_loop(), None)
        if store is not None:
            await store.aclose()

    def describe(self) -> str:
        """Where the ledger lives, safe to print (a URL without its password).

        >>> Ledger.open(":memory:").describe()
        ':memory:'
        """
        return self.store.describe()

    def now(self) -> int:
        return int(self.clock())

    def _now_steps(self) -> decision.Steps[int]:
        return (yield from decision.now_steps(self.store, self.clock))

    # -- schema ---------------------------------------------------------------------
    def init(self, *, dry_run: bool = False) -> InitResult:
        """Create or upgrade the schema; safe to run any number of times.

        >>> ledger = Ledger.open(":memory:")
        >>> ledger.init().describe(), ledger.init().describe()
        ('created (schema version 2)', 'already up to date (schema version 2)')
        """
        return self.store.init(self.now(), dry_run)

    def schema_version(self) -> int | None:
        """None: no ledger; 0: the recipe's table only; N: idemctl schema N."""
        return self.store.schema_version()

    def has_fenced_log(self) -> bool:
        """Whether the ledger records fenced-out events (a ledger with only
        the recipe's table does not, until :meth:`init` upgrades it)."""
        return self.store.has_fenced_log()

    # -- the request flow ------------------------------------------------------------
    # Two phases, so that every adapter (WSGI, ASGI, Django, functions) runs the
    # app itself between them and the contract lives here alone: `begin`
    # decides (one claim, and at most a lookup and a takeover), `finish`
    # stores the answer with one fenced statement and returns what was stored.

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

        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> ticket = ledger.begin("acct_1", "k1", "POST", "/orders", {}, b'{"sku":"x"}')
        >>> ticket.outcome, ticket.reservation.generation
        (<Outcome.EXECUTED: 'executed'>, 1)
        >>> ledger.finish(ticket, 201, {"content-type": "application/json"}, b'{"id":7}').status
        201
        >>> ledger.begin("acct_1", "k1", "POST", "/orders", {}, b'{"sku":"x"}').outcome
        <Outcome.REPLAYED: 'replayed'>
        """
        return decision.run(self.begin_steps(principal, key, method, path_and_query, headers, body))

    def begin_steps(
        self,
        principal: str | None,
        key: str | None,
        method: str,
        path_and_query: str,
        headers: HeadersLike | None,
        body: bytes | bytearray | memoryview,
    ) -> decision.Steps[Answer | Ticket]:
        """:meth:`begin` as steps, for a driver that does its I/O its own way:
        it yields the store operations it needs and the pauses between the
        polls of an in-progress wait, and returns what `begin` returns.
        `idemctl.decision.run` runs them in the calling thread; `run_async`
        from an event loop.

        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> decision.run(ledger.begin_steps("acct_1", "k9", "POST", "/orders", {}, b"")).outcome
        <Outcome.EXECUTED: 'executed'>
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
            refusal = Answer(*responses.key_invalid(), Outcome.KEY_INVALID)
            return self._decided(refusal, principal, None, method, path_and_query, 0.0)
        key = parsed  # "abc" (an sf-string, as the IETF draft sends it) and abc are one key
        check_request_line(method, path_and_query)

        fp_body, _ = fingerprint_body(raw, headers, policy.fingerprint_body, policy.fingerprint_ignore_fields)
        fp = fingerprint(method, path_and_query, headers, fp_body, policy.fingerprint_headers)
        mark = time.perf_counter()
        try:
            made = self._hold((yield from decision.decide(self.store, policy, self.clock, principal, key, fp)))
        except StorageError:
            ms = (time.perf_counter() - mark) * 1000
            at = wall_clock_ms()  # the database clock, if that is the clock, cannot be asked either
            self._emit(Event(Outcome.UNAVAILABLE, principal, key, None, method, path_and_query, 503, ms, None, at))
            raise
        spent_ms = (time.perf_counter() - mark) * 1000
        if isinstance(made, decision.Claimed):
            return Ticket(
                made.reservation, made.outcome, raw, made.now, method, path_and_query, spent_ms, time.perf_counter()
            )
        return self._decided(self._answer_for(made, principal, key), principal, key, method, path_and_query, spent_ms)

    def decide(self, principal: str, key: str, fingerprint: str) -> decision.Steps[decision.Decision]:
        """The decision loop itself, for integrations with their own request
        shape (idempotent functions): claim, or look up and branch, with the
        policy's in-progress wait. Drive it with `idemctl.decision.run` (or
        `run_async`); a :class:`~idemctl.decision.Claimed` result owns the
        reservation.

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
        made = yield from decision.decide(self.store, self.policy, self.clock, principal, key, fingerprint)
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
        status, out_headers, out_body = responses.from_stored(
            row.response_status, row.response_body, row.response_headers, row=(principal, key)
        )
        out_headers = self._with_expiry(out_headers, row.updated_at)
        return Answer(status, out_headers, out_body, Outcome.REPLAYED, row.generation, made.now)

    def _with_expiry(self, headers: tuple[tuple[str, str], ...], updated_at: int) -> tuple[tuple[str, str], ...]:
        name = self.policy.expires_header
        if name is None:
            return headers
        until = (updated_at + self.policy.retention_ms) / 1000
        return (*headers, (name, formatdate(until, usegmt=True)))

    def _decided(
        self, answer: Answer, principal: str | None, key: str | None, method: str, path: str, ledger_ms: float
    ) -> Answer:
        if self._heard(answer.outcome):
            at = answer.started_at if answer.started_at is not None else self.now()
            status, generation = answer.status, answer.generation
            self._emit(Event(answer.outcome, principal, key, generation, method, path, status, ledger_ms, None, at))
        if self.policy.problem_details and answer.outcome in _OWN_ANSWERS:
            shaped = responses.as_problem((answer.status, answer.headers, answer.body))
            return Answer(*shaped, answer.outcome, answer.generation, answer.started_at)
        return answer

    def shape(self, answer: tuple[int, responses.Headers, bytes]) -> tuple[int, responses.Headers, bytes]:
        """One of idemctl's own error answers as the policy wants it: the
        recipe's ``{"error": ...}`` JSON, or RFC 9457 problem details with
        ``Policy(problem_details=True)``.

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

        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> seen = []; _ = ledger.subscribe(seen.append)
        >>> ledger.refuse(responses.unauthenticated(), Outcome.UNAUTHENTICATED,
        ...               principal=None, key="k1", method="POST", path="/orders").status
        401
        >>> seen[0].outcome.value, seen[0].key
        ('unauthenticated', 'k1')
        """
        answer = Answer(*self.shape(refusal), outcome)
        if self._heard(outcome):
            event = Event(outcome, principal, key, None, method, path, answer.status, 0.0, None, wall_clock_ms())
            self._emit(event)
        return answer

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

        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> ticket = ledger.begin("acct_1", "k2", "POST", "/orders", {}, b"{}")
        >>> answer = ledger.finish(ticket, 201, {"location": "/orders/8"}, b"ok")
        >>> answer.outcome, answer.header("location"), answer.body
        (<Outcome.EXECUTED: 'executed'>, '/orders/8', b'ok')
        """
        return decision.run(self.finish_steps(ticket, status, headers, body))

    def finish_steps(
        self,
        ticket: Ticket,
        status: int,
        headers: HeadersLike | None,
        body: bytes | bytearray | memoryview | str | responses.OversizeBody,
    ) -> decision.Steps[Answer]:
        """:meth:`finish` as steps (see :meth:`begin_steps`)."""
        reservation = ticket.reservation
        if reservation is None:
            if isinstance(body, responses.OversizeBody):
                raise InvalidResponseError("an unprotected answer is passed through whole, never as its size")
            raw = body.encode("utf-8") if isinstance(body, str) else as_body_bytes(body, "response body")
            return Answer(status, tuple(header_pairs(headers)), raw, Outcome.PASSTHROUGH)
        self._drop(reservation)
        app_ms = (time.perf_counter() - ticket.issued) * 1000 if ticket.issued else None
        mark = time.perf_counter()
        stored, computed = self._prepare(reservation, status, headers, body)
        keep = self.policy.keep_answer
        # keep_answer judges what the app answered: an oversize answer's 500
        # sentinel is the ledger's own, and is stored like any kept answer.
        if keep is not None and not keep(status, computed[1]):
            # Not an answer to keep (say a 503): release, so the retry runs again.
            yield from self._release_quietly(reservation)
            answer = Answer(*computed, Outcome.NOT_KEPT, reservation.generation, ticket.started_at)
            self._finished(ticket, answer.outcome, answer.status, mark, app_ms)
            return answer
        try:
            # Inside the guard: with clock="database", reading the clock is a
            # statement too, and any storage failure after the mutation ran
            # must hand back the answer it computed.
            stamp = yield from self._now_steps()
            done = yield from self._store_answer(reservation, stored, computed, stamp)
        except StorageError as exc:
            answer = Answer(*computed, ticket.outcome, reservation.generation, ticket.started_at)
            self._finished(ticket, Outcome.NOT_STORED, answer.status, mark, app_ms)
            raise AnswerNotStoredError(answer, exc) from exc
        outcome = ticket.outcome if done.stored else Outcome.FENCED_OUT
        out_headers = self._with_expiry(done.headers, stamp) if done.stored else done.headers
        answer = Answer(done.status, out_headers, done.body, outcome, reservation.generation, ticket.started_at)
        self._finished(ticket, outcome, answer.status, mark, app_ms)
        return answer

    def _finished(
        self, ticket: Ticket, outcome: Outcome, status: int | None, mark: float, app_ms: float | None
    ) -> None:
        if not self._heard(outcome):
            return
        reservation = ticket.reservation
        ledger_ms = ticket.ledger_ms + (time.perf_counter() - mark) * 1000
        self._emit(
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
                ticket.started_at if ticket.started_at is not None else self.now(),
            )
        )

    def abandon(self, ticket: Ticket, *, release: bool = False) -> None:
        """The mutation raised. By default the reservation stays pending and a
        retry takes it over after the TTL; ``release=True`` (for mutations
        known to have rolled back) deletes it so a retry runs at once. Never
        raises: a failed release is logged.

        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> ticket = ledger.begin("acct_1", "k3", "POST", "/orders", {}, b"{}")
        >>> ledger.abandon(ticket, release=True)
        >>> ledger.lookup("acct_1", "k3") is None
        True
        """
        decision.run(self.abandon_steps(ticket, release=release))

    def abandon_steps(self, ticket: Ticket, *, release: bool = False) -> decision.Steps[None]:
        """:meth:`abandon` as steps (see :meth:`begin_steps`)."""
        reservation = ticket.reservation
        if reservation is None:
            return
        self._drop(reservation)
        app_ms = (time.perf_counter() - ticket.issued) * 1000 if ticket.issued else None
        mark = time.perf_counter()
        if release:
            yield from self._release_quietly(reservation)
        self._finished(ticket, Outcome.FAILED, None, mark, app_ms)

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

        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> order = lambda body: (201, {"content-type": "application/json"}, b'{"id":7}')
        >>> answer = ledger.handle("acct_1", "k1", "POST", "/orders", {}, b'{"sku":"x"}', order)
        >>> answer.status, answer.outcome
        (201, <Outcome.EXECUTED: 'executed'>)
        >>> ledger.handle("acct_1", "k1", "POST", "/orders", {}, b'{"sku":"x"}', order).outcome
        <Outcome.REPLAYED: 'replayed'>
        """
        decision = self.begin(principal, key, method, path_and_query, headers, body)
        if isinstance(decision, Answer):
            return decision
        try:
            status, out_headers, out_body = run(decision.body)
        except BaseException:
            self.abandon(decision, release=release_on_error)
            raise
        return self.finish(decision, status, out_headers, out_body)

    def sweep_due(self, answer: Answer) -> bool:
        """Whether `after_response(answer)` would run a statement: only for
        answers that ran the mutation, and not while the last probe showed
        nothing can expire yet. No I/O, so an async adapter can skip the
        hand-off to a thread.

        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> first = ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b""))
        >>> ledger.sweep_due(first), ledger.after_response(first).quiet_for_ms > 0, ledger.sweep_due(first)
        (True, True, False)
        """
        now = answer.started_at
        return now is not None and answer.outcome in _SWEEPS_AFTER and now >= self._sweep_rests_until

    def after_response(self, answer: Answer) -> SweepResult | None:
        """The post-response housekeeping of SPEC §4.9: one bounded sweep batch
        at the request's own `now`. Call it after the answer has been sent.
        It never raises: a failed sweep is logged and retried by the next request.

        >>> ledger = Ledger.open(":memory:", clock=lambda: 1_700_000_000_000); _ = ledger.init()
        >>> answer = ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b""))
        >>> ledger.after_response(answer).deleted
        0
        """
        return decision.run(self.after_response_steps(answer))

    def after_response_steps(self, answer: Answer) -> decision.Steps[SweepResult | None]:
        """:meth:`after_response` as steps (see :meth:`begin_steps`)."""
        now = answer.started_at
        if now is None or answer.outcome not in _SWEEPS_AFTER:
            return None
        if now < self._sweep_rests_until:
            # The last probe showed nothing can expire before then: no statement at all.
            return SweepResult(0, 0, now - self.policy.retention_ms, now - self.policy.fenced_retention_ms, 0)
        try:
            result: SweepResult = yield decision.Call(self.store, "sweep", self._sweep_args(now, None, None, None))
        except IdemctlError as exc:
            log.warning("post-response sweep failed: %s", exc)
            return None
        if result.quiet_for_ms:
            self._sweep_rests_until = now + result.quiet_for_ms
        return result

    # -- single steps, one statement each ----------------------------------------------
    def claim(self, principal: str, key: str, fingerprint: str, *, now: int | None = None) -> Reservation | None:
        """Atomically claim (principal, key) as generation 1; None if it exists.

        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> ledger.claim("acct_1", "k1", fingerprint("POST", "/orders", [], b"")).generation
        1
        >>> ledger.claim("acct_1", "k1", fingerprint("POST", "/orders", [], b"")) is None
        True
        """
        check_principal(principal)
        key = check_key(key)
        now = self.now() if now is None else now
        token = new_token()
        generation = self.store.claim(principal, key, fingerprint, token, now)
        return None if generation is None else Reservation(principal, key, generation, fingerprint, token)

    def lookup(self, principal: str, key: str) -> StoredRow | None:
        """The stored row, or None.

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
        now = self.now() if now is None else now
        token = new_token()
        p = self.policy
        generation = self.store.takeover(
            principal, key, fingerprint, token, now, now - p.pending_ttl_ms, now - p.retention_ms
        )
        return None if generation is None else Reservation(principal, key, generation, fingerprint, token)

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

        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> reservation = ledger.claim("acct_1", "k1", "fp")
        >>> ledger.complete(reservation, 201, {"content-type": "text/plain"}, b"ok").stored
        True
        >>> ledger.complete(reservation, 201, {}, b"again").stored  # already completed
        False
        """
        return decision.run(self.complete_steps(reservation, status, headers, body, now=now))

    def complete_steps(
        self,
        reservation: Reservation,
        status: int,
        headers: HeadersLike | None,
        body: bytes | bytearray | memoryview | str,
        *,
        now: int | None = None,
    ) -> decision.Steps[Completion]:
        """:meth:`complete` as steps (see :meth:`begin_steps`)."""
        self._drop(reservation)
        stored, answer = self._prepare(reservation, status, headers, body)
        stamp = (yield from self._now_steps()) if now is None else now
        return (yield from self._store_answer(reservation, stored, answer, stamp))

    def _prepare(
        self,
        reservation: Reservation,
        status: int,
        headers: HeadersLike | None,
        body: bytes | bytearray | memoryview | str | responses.OversizeBody,
    ) -> tuple[responses.ToStore, tuple[int, responses.Headers, bytes]]:
        """What will be stored for this answer, and the answer built from it."""
        where = (reservation.principal, reservation.key)
        stored = responses.to_store(status, headers, body, self.policy, row=where)
        if stored.oversize:
            cap = self.policy.header_cap_bytes if stored.over_cap == "headers" else self.policy.body_cap_bytes
            log.warning(
                "response for principal=%s key=%s: its %s exceed %d bytes: stored as a 500 sentinel",
                reservation.principal,
                reservation.key,
                "headers" if stored.over_cap == "headers" else "body bytes",
                cap,
            )
        return stored, stored.answer

    def _store_answer(
        self,
        reservation: Reservation,
        stored: responses.ToStore,
        answer: tuple[int, responses.Headers, bytes],
        stamp: int,
    ) -> decision.Steps[Completion]:
        who = (reservation.principal, reservation.key, reservation.generation)
        args = (*who, reservation.token, stored.status, stored.body, stored.headers_json, stamp)
        ok = yield decision.Call(self.store, "complete", args)
        event = None
        if not ok:
            event = yield decision.Call(self.store, "record_fenced", (*who, stored.status, stamp))
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
        return Completion(ok, answer[0], answer[1], answer[2], stored.oversize, event)

    def release(self, reservation: Reservation) -> bool:
        """Opt-in: delete a pending reservation whose mutation is known to have
        rolled back, so the client's retry runs again at once. Fenced like a
        completion: it deletes the row only while it is still this
        reservation's (generation and token), never a newer owner's.

        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> reservation = ledger.claim("acct_1", "k1", "fp")
        >>> ledger.release(reservation), ledger.release(reservation)
        (True, False)
        """
        return decision.run(self.release_steps(reservation))

    def release_steps(self, reservation: Reservation) -> decision.Steps[bool]:
        """:meth:`release` as steps (see :meth:`begin_steps`)."""
        self._drop(reservation)
        args = (reservation.principal, reservation.key, reservation.generation, reservation.token)
        return bool((yield decision.Call(self.store, "release", args)))

    def _release_quietly(self, reservation: Reservation) -> decision.Steps[None]:
        try:
            yield from self.release_steps(reservation)
        except IdemctlError as exc:
            log.error("could not release principal=%s key=%s: %s", reservation.principal, reservation.key, exc)

    def sweep(
        self,
        *,
        now: int | None = None,
        batch: int | None = None,
        retention_ms: int | None = None,
        fenced_retention_ms: int | None = None,
    ) -> SweepResult:
        """Delete at most `batch` rows older than the retention and `batch`
        fenced-out events older than the fenced-out log's own retention: one
        bounded statement per table.

        >>> t = [0]; ledger = Ledger.open(":memory:", clock=lambda: t[0]); _ = ledger.init()
        >>> for i in range(3): _ = ledger.claim("acct_1", f"k{i}", "fp")
        >>> t[0] += ledger.policy.retention_ms + 1
        >>> ledger.sweep(batch=2).keys_deleted, ledger.sweep(batch=2).keys_deleted
        (2, 1)
        """
        now = self.now() if now is None else now
        return self.store.sweep(*self._sweep_args(now, batch, retention_ms, fenced_retention_ms))

    def _sweep_args(
        self, now: int, batch: int | None, retention_ms: int | None, fenced_retention_ms: int | None
    ) -> tuple[int, int, int, int]:
        batch = self.policy.sweep_batch if batch is None else batch
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise PolicyError(f"sweep batch must be >= 1, got {batch}")
        cutoff = now - self._retention(retention_ms)
        return now, cutoff, now - self._fenced_retention(fenced_retention_ms), batch

    def drain(
        self,
        *,
        batch: int | None = None,
        max_batches: int | None = None,
        retention_ms: int | None = None,
        fenced_retention_ms: int | None = None,
        pause_ms: int = 0,
        should_stop: Callable[[], bool] = lambda: False,
        on_batch: Callable[[SweepResult], None] | None = None,
    ) -> Drained:
        """Sweep batch after batch until one deletes nothing, `max_batches`
        have run, or `should_stop()` is true between two batches. Each batch
        is one bounded statement per table (:meth:`sweep`); ``pause_ms``
        leaves the write lock to the request path between them. The default
        batch is the engine's :attr:`drain_batch`.

        >>> ledger = Ledger.open(":memory:", clock=lambda: 0); _ = ledger.init()
        >>> ledger.drain(retention_ms=60_000)
        Drained(keys_deleted=0, fenced_deleted=0, batches=1, stopped=<DrainStop.DRAINED: 'drained'>)
        """
        size = self.drain_batch if batch is None else batch
        keys = fenced = batches = 0
        while True:
            if should_stop():
                return Drained(keys, fenced, batches, DrainStop.INTERRUPTED)
            if max_batches is not None and batches >= max_batches:
                return Drained(keys, fenced, batches, DrainStop.MAX_BATCHES)
            result = self.sweep(batch=size, retention_ms=retention_ms, fenced_retention_ms=fenced_retention_ms)
            batches += 1
            keys += result.keys_deleted
            fenced += result.fenced_deleted
            if on_batch is not None:
                on_batch(result)
            if result.deleted == 0:
                return Drained(keys, fenced, batches, DrainStop.DRAINED)
            deadline = time.monotonic() + pause_ms / 1000
            while pause_ms and not should_stop() and time.monotonic() < deadline:
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    @property
    def drain_batch(self) -> int:
        """The batch size this storage engine drains a backlog with (the
        CLI's `sweep` default): 250 on SQLite, where each batch holds the
        database-wide write lock that claims wait for; 5000 on PostgreSQL,
        where it locks only the expired rows it deletes.

        >>> Ledger.open(":memory:").drain_batch
        250
        """
        return self.store.drain_batch

    def _retention(self, retention_ms: int | None) -> int:
        if retention_ms is None:
            return self.policy.retention_ms
        if retention_ms <= self.policy.pending_ttl_ms:
            # Sweeping a live reservation would let a retry run the mutation again.
            raise PolicyError(
                f"retention ({retention_ms} ms) must be longer than the pending TTL ({self.policy.pending_ttl_ms} ms)"
            )
        return retention_ms

    def _fenced_retention(self, fenced_retention_ms: int | None) -> int:
        if fenced_retention_ms is None:
            return self.policy.fenced_retention_ms
        if fenced_retention_ms <= 0:
            raise PolicyError(f"fenced-out log retention must be > 0 ms, got {fenced_retention_ms}")
        return fenced_retention_ms

    # -- moving to another ledger -----------------------------------------------------
    def copy_to(
        self,
        destination: Ledger,
        *,
        batch: int = copying.DEFAULT_COPY_BATCH,
        dry_run: bool = False,
        on_progress: Callable[[copying.CopyProgress], object] | None = None,
    ) -> copying.CopyResult:
        """Copy every row (pending and completed, with its generation, token,
        timestamps and stored answer) and the fenced-out log into
        `destination`, on any engine, `batch` rows at a time; this ledger is
        only read. A destination row that is newer is kept, one that holds
        another request under the same key is a conflict; neither is
        overwritten. Running it again writes only what changed since. The
        destination must be initialised (:meth:`init`). See docs/runbook.md
        for moving a live ledger without losing a key.

        >>> old, new = Ledger.open(":memory:"), Ledger.open(":memory:")
        >>> _ = old.init(), new.init()
        >>> _ = old.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b"made"))
        >>> result = old.copy_to(new)
        >>> result.copied, old.copy_to(new).unchanged
        (1, 1)
        >>> new.handle("acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (500, {}, b"")).body
        b'made'
        """
        for side in (self, destination):
            if not side.store.dialect.returning:
                # Its statements decide row by row through RETURNING, which MariaDB/MySQL lack.
                raise StorageError(
                    f"idemctl copy does not yet read or write {side.store.dialect.name} ledgers "
                    f"({side.describe()}); copy between SQLite and PostgreSQL ledgers"
                )
        return copying.copy_ledger(
            self.store, destination.store, batch=batch, dry_run=dry_run, on_progress=on_progress
        )

    def count_rows(self) -> int:
        """How many rows the ledger holds (one count: a progress bar's total)."""
        return self.store.count_rows()

    # -- operator side --------------------------------------------------------------------
    def view(self, row: StoredRow, *, now: int | None = None) -> RowView:
        """A row with its derived state at `now`."""
        now = self.now() if now is None else now
        p = self.policy
        state = derive_state(row, now - p.pending_ttl_ms, now - p.retention_ms)
        return RowView(row, state, now, p.pending_ttl_ms, p.retention_ms)

    def get(self, principal: str, key: str, *, now: int | None = None) -> RowView | None:
        """One row with its derived state, or None.

        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> _ = ledger.claim("acct_1", "k1", "fp")
        >>> ledger.get("acct_1", "k1").state
        <State.PENDING_FRESH: 'pending_fresh'>
        """
        row = self.store.lookup(principal, parse_key(key) or key)
        return None if row is None else self.view(row, now=now)

    def pending(
        self,
        *,
        stale_only: bool = False,
        principal: str | None = None,
        limit: int | None = None,
        now: int | None = None,
        on_malformed: Callable[[MalformedRowError], None] | None = None,
    ) -> Iterator[RowView]:
        """Rows whose status is pending, oldest first, streamed. With
        ``stale_only``, just those in state PENDING_STALE (the ones a retry
        would take over now): the same rows `stats().pending_stale` counts.
        A row written by another program that cannot be read raises
        MalformedRowError, or goes to ``on_malformed`` and the listing goes on.

        >>> t = [0]; ledger = Ledger.open(":memory:", clock=lambda: t[0]); _ = ledger.init()
        >>> _ = ledger.claim("acct_1", "k1", "fp"); t[0] += 60_000; _ = ledger.claim("acct_1", "k2", "fp")
        >>> [(v.row.key, v.state.value) for v in ledger.pending()]
        [('k1', 'pending_stale'), ('k2', 'pending_fresh')]
        >>> [v.row.key for v in ledger.pending(stale_only=True)]
        ['k1']
        """
        now = self.now() if now is None else now
        p = self.policy
        state = State.PENDING_STALE if stale_only else None
        for values in self.store.iter_pending(state, now - p.pending_ttl_ms, now - p.retention_ms, principal, limit):
            try:
                row = self.store.decode_row(values)
            except MalformedRowError as exc:
                if on_malformed is None:
                    raise
                on_malformed(exc)
                continue
            yield self.view(row, now=now)

    def fenced(
        self,
        *,
        principal: str | None = None,
        key: str | None = None,
        since: int | None = None,
        limit: int | None = None,
    ) -> Iterator[FencedEvent]:
        """Fenced-out events, newest first.

        >>> t = [0]; ledger = Ledger.open(":memory:", clock=lambda: t[0]); _ = ledger.init()
        >>> late = ledger.claim("acct_1", "k1", "fp"); t[0] += 60_000
        >>> _ = ledger.complete(ledger.takeover("acct_1", "k1", "fp"), 201, {}, b"B")
        >>> ledger.complete(late, 201, {}, b"A").stored
        False
        >>> event = next(ledger.fenced(principal="acct_1"))
        >>> event.superseded_generation, event.current_generation
        (1, 2)
        """
        return self.store.iter_fenced(principal, key, since, limit)

    def predict(self, principal: str, key: str, fingerprint: str, *, now: int | None = None) -> Prediction:
        """What a request with this fingerprint would get now, from the
        stored row alone (a read: nothing is claimed). For operators asking
        why a retry keeps getting 409.

        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> ledger.predict("acct_1", "k1", "fp").verdict
        <Verdict.NEW: 'new'>
        """
        view = self.get(principal, key, now=now)
        if view is None:
            return Prediction(Verdict.NEW, None)
        if view.state is State.EXPIRED:
            return Prediction(Verdict.NEW, view)  # past retention a row counts as absent
        if view.row.fingerprint != fingerprint:
            return Prediction(Verdict.REUSED, view)
        if view.row.status is Status.COMPLETED:
            return Prediction(Verdict.REPLAY, view)
        if view.state is State.PENDING_FRESH:
            return Prediction(Verdict.IN_PROGRESS, view)
        return Prediction(Verdict.TAKEOVER, view)

    def require_schema(self) -> None:
        """Raise SchemaMissingError unless the ledger's tables exist (they
        may be the recipe's alone): for tools that must never create one.

        >>> Ledger.open(":memory:").require_schema()
        Traceback (most recent call last):
        ...
        idemctl.errors.SchemaMissingError: :memory: has no idempotency ledger
        """
        if self.schema_version() is None:
            raise SchemaMissingError(self.describe())

    def stats(self, *, now: int | None = None) -> Stats:
        """Rows by derived state, takeovers, fenced-out events, sweep backlog.

        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> _ = ledger.claim("acct_1", "k1", "fp")
        >>> stats = ledger.stats()
        >>> stats.total, stats.pending_fresh, stats.expired
        (1, 1, 0)
        """
        now = self.now() if now is None else now
        p = self.policy
        return self.store.stats(now, now - p.pending_ttl_ms, now - p.retention_ms)

    def count_expired(self, *, now: int | None = None, retention_ms: int | None = None) -> int:
        """How many rows a full sweep would delete now."""
        now = self.now() if now is None else now
        return self.store.count_expired(now - self._retention(retention_ms))

    def count_fenced_expired(self, *, now: int | None = None, fenced_retention_ms: int | None = None) -> int:
        """How many fenced-out events a full sweep would delete now."""
        now = self.now() if now is None else now
        return self.store.count_fenced_expired(now - self._fenced_retention(fenced_retention_ms))

    def purge(self, principal: str, key: str, *, force: bool = False, now: int | None = None) -> PurgeResult:
        """Delete one reservation so the client's next retry runs the mutation
        again. A fresh pending row is refused unless `force`: its owner may
        still be running.

        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> _ = ledger.complete(ledger.claim("acct_1", "k1", "fp"), 201, {}, b"")
        >>> ledger.purge("acct_1", "k1").outcome
        <PurgeOutcome.PURGED: 'purged'>
        """
        now = self.now() if now is None else now
        key = parse_key(key) or key
        return self.store.purge(principal, key, None if force else now - self.policy.pending_ttl_ms)

    # -- functions: the contract for calls in workers, consumers and scripts ---------
    def idempotent(
        self,
        *,
        key: functions.KeySource,
        principal: functions.PrincipalSource,
        args: functions.ArgsSelector | None = None,
        name: str | None = None,
        serializer: functions.Serializer | None = None,
        release_on_error: functions.ReleasePolicy = False,
    ) -> functions.IdempotentDecorator:
        """Decorator: run a function (plain or ``async def``) once per
        (principal, key) and store its return value (JSON by default). A
        repeat with the same arguments gets the stored value without running;
        other arguments raise KeyReusedError; a duplicate while the first
        runs raises CallInProgressError (``retry_after``). `key` and
        `principal` are strings or callables of the function's arguments;
        `args` chooses the arguments the fingerprint covers (all by default).
        See docs/workers.md.

        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> runs = []
        >>> @ledger.idempotent(key=lambda payment: payment["id"], principal="billing")
        ... def charge(payment):
        ...     runs.append(payment["id"])
        ...     return {"charged": payment["amount"]}
        >>> charge({"id": "pay_1", "amount": 500}), charge({"id": "pay_1", "amount": 500}), runs
        ({'charged': 500}, {'charged': 500}, ['pay_1'])
        >>> charge({"id": "pay_1", "amount": 900})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        idemctl.errors.KeyReusedError: key 'pay_1' of principal 'billing' was used for a call with other arguments; ...
        """
        return functions.IdempotentDecorator(
            self,
            key=key,
            principal=principal,
            args=args,
            name=name,
            serializer=serializer,
            release_on_error=release_on_error,
        )

    def idempotent_call(
        self,
        *,
        principal: str,
        key: str,
        args: object,
        name: str | None = None,
        serializer: functions.Serializer | None = None,
        release_on_error: functions.ReleasePolicy = False,
    ) -> functions.IdempotentCall:
        """One idempotent call as a context manager (``with`` or ``async
        with``), for code that is not one function: `args` is the JSON value
        the fingerprint covers. Skip the work when ``call.replayed``; hand the
        result to ``call.store()``; after the block ``call.value`` is what
        every repeat returns.

        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> for attempt in (1, 2):
        ...     with ledger.idempotent_call(principal="billing", key="pay_1", args={"amount": 500}) as call:
        ...         if not call.replayed:
        ...             call.store({"charged": 500})
        ...     print(attempt, call.outcome.value, call.value)
        1 executed {'charged': 500}
        2 replayed {'charged': 500}
        """
        return functions.IdempotentCall(
            self,
            principal=principal,
            key=key,
            args=args,
            name=name,
            serializer=serializer,
            release_on_error=release_on_error,
        )


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
        Outcome.UNAVAILABLE,
    }
)
# Requests that ran the mutation sweep one batch after their answer.
_SWEEPS_AFTER = frozenset({Outcome.EXECUTED, Outcome.TAKEN_OVER, Outcome.FENCED_OUT})
# Routine decisions are counted (listeners, metrics), not logged line by line.
_QUIET = frozenset({Outcome.EXECUTED, Outcome.REPLAYED, Outcome.PASSTHROUGH})
_LOUD = frozenset({Outcome.FENCED_OUT, Outcome.NOT_STORED, Outcome.UNAVAILABLE})


def _event_fields(event: Event) -> dict[str, object]:
    return {
        "outcome": event.outcome.value,
        "principal": event.principal,
        "key": event.key,
        "generation": event.generation,
        "method": event.method,
        "path": event.path,
        "status": event.status,
        "ledger_ms": round(event.ledger_ms, 3),
        "app_ms": None if event.app_ms is None else round(event.app_ms, 3),
        "at": event.at,
    }


# One limit for every engine, checked before any statement: the primary key
# (principal, key) must fit PostgreSQL's btree entry (about 2.7 kB, whatever
# compression does) and a 4-bytes-a-character VARCHAR index, so that no
# engine turns a long principal into a storage error that a client retries.
MAX_PRINCIPAL_BYTES = 512
# Paths are hashed, never stored; the bound keeps log lines and events sane.
MAX_PATH_BYTES = 65_536


def check_principal(principal: object) -> None:
    """A principal is stored and compared exactly: it must be a non-empty
    str that encodes as UTF-8 in at most MAX_PRINCIPAL_BYTES (512) bytes and
    holds no NUL (PostgreSQL text cannot).

    >>> check_principal("acct_1")
    >>> check_principal(5)
    Traceback (most recent call last):
    ...
    TypeError: principal must be a str, got int
    """
    if not isinstance(principal, str):
        raise TypeError(f"principal must be a str, got {type(principal).__name__}")
    if principal == "":
        raise InvalidPrincipalError("principal must not be empty")
    try:
        size = len(principal.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidPrincipalError(f"principal {principal!r} is not valid UTF-8 (it holds a lone surrogate)") from None
    if size > MAX_PRINCIPAL_BYTES:
        raise InvalidPrincipalError(
            f"principal {principal[:40]!r}... is {size} bytes in UTF-8; the most is {MAX_PRINCIPAL_BYTES}"
        )
    if "\x00" in principal:
        raise InvalidPrincipalError(f"principal {principal!r} holds a NUL character")


# C0 controls and DEL: one regex scan, not a Python step per character.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _has_control(text: str) -> bool:
    return _CONTROL.search(text) is not None


def check_request_line(method: object, path_and_query: object) -> None:
    """HTTP cannot carry a control character in a method or path; refusing
    them keeps two different requests from sharing a fingerprint (the
    fingerprint joins its lines with newlines).

    >>> check_request_line("POST", "/orders?x=1")
    >>> check_request_line("POST", "/a\\ncontent-type:x")
    Traceback (most recent call last):
    ...
    idemctl.errors.InvalidRequestError: path '/a\\ncontent-type:x' holds a control character
    """
    if not isinstance(method, str) or not method or _has_control(method) or " " in method:
        raise InvalidRequestError(f"method {method!r} is not an HTTP method token")
    if not isinstance(path_and_query, str):
        raise InvalidRequestError(f"path must be a str, got {type(path_and_query).__name__}")
    if _has_control(path_and_query):
        raise InvalidRequestError(f"path {path_and_query!r} holds a control character")
    too_long = len(path_and_query) > MAX_PATH_BYTES // 4
    if too_long and len(path_and_query.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise InvalidRequestError(f"path {path_and_query[:40]!r}... is longer than {MAX_PATH_BYTES} bytes")
