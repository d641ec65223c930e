"""The ledger: the Idempotency-Key contract on top of a storage backend.

The ledger decides; the backend only runs single atomic statements. Nothing
here checks a row in Python and then writes based on what it saw: every
decision that matters is inside the WHERE clause of one statement."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, Union

from . import responses
from .backends import Backend, open_backend
from .errors import IdemctlError, InvalidKeyError, PolicyError
from .fingerprint import HeadersLike, as_body_bytes, fingerprint, header_pairs, is_valid_key
from .outcomes import (
    Answer,
    Completion,
    FencedEvent,
    InitResult,
    Outcome,
    PurgeResult,
    Reservation,
    RowView,
    State,
    Stats,
    Status,
    StoredRow,
    SweepResult,
)
from .policy import Policy

log = logging.getLogger("idemctl")

Clock = Callable[[], int]
RunResult = tuple[int, Union[HeadersLike, None], Union[bytes, bytearray, memoryview, str]]
Mutation = Callable[[bytes], RunResult]


def wall_clock_ms() -> int:
    """Milliseconds since the epoch, the unit of every timestamp in the ledger."""
    return time.time_ns() // 1_000_000


class Ledger:
    """An idempotency ledger. Safe to share between threads; each thread (and
    each forked process) gets its own database connection.

    >>> ledger = Ledger.open("idempotency.db"); ledger.init()  # doctest: +SKIP
    >>> ledger.handle("acct_1", "key-1", "POST", "/orders", {}, b"{}",
    ...               lambda body: (201, {"content-type": "application/json"}, b'{"id":1}'))  # doctest: +SKIP
    Answer(status=201, ...)
    """

    def __init__(self, backend: Backend, *, policy: Policy | None = None, clock: Clock | None = None) -> None:
        self.backend = backend
        self.policy = policy if policy is not None else Policy()
        self.clock: Clock = clock if clock is not None else wall_clock_ms

    @classmethod
    def open(
        cls,
        target: str | os.PathLike[str],
        *,
        policy: Policy | None = None,
        clock: Clock | None = None,
        create: bool = True,
        readonly: bool = False,
        busy_timeout_ms: int = 5000,
        synchronous: str = "FULL",
        write_queue: bool = True,
    ) -> "Ledger":
        """Open a ledger: a SQLite file path or a ``postgresql://`` URL.

        ``create=False`` refuses to create a missing SQLite file
        (LedgerNotFoundError); ``readonly=True`` never writes. On SQLite,
        ``synchronous`` is the PRAGMA of that name and ``write_queue=False``
        turns off the fair writer queue (see README, Performance).

        >>> ledger = Ledger.open("idempotency.db", policy=Policy(pending_ttl_ms=60_000))  # doctest: +SKIP
        """
        backend = open_backend(
            target,
            create=create,
            readonly=readonly,
            busy_timeout_ms=busy_timeout_ms,
            synchronous=synchronous,
            write_queue=write_queue,
        )
        return cls(backend, policy=policy, clock=clock)

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.backend.close()

    def now(self) -> int:
        return int(self.clock())

    # -- schema ---------------------------------------------------------------------
    def init(self, *, dry_run: bool = False) -> InitResult:
        """Create or upgrade the schema; safe to run any number of times.

        >>> Ledger.open("idempotency.db").init().describe()  # doctest: +SKIP
        'created (schema version 1)'
        """
        return self.backend.init(self.now(), dry_run)

    def schema_version(self) -> int | None:
        return self.backend.schema_version()

    # -- the request flow ------------------------------------------------------------
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
        """Run one request under the Idempotency-Key contract (SPEC §1 and §4).

        `run(body)` is called at most once, only when this caller owns the
        reservation, and returns ``(status, headers, body_bytes)``. The answer
        is built from what was stored, so it equals every later replay. Call
        :meth:`after_response` once the answer has been sent.

        >>> answer = ledger.handle("acct_1", "k1", "POST", "/orders", {"content-type": "application/json"},
        ...                        b'{"sku":"x"}', lambda b: (201, {"content-type": "application/json"}, b'{"id":7}'))  # doctest: +SKIP
        >>> answer.status, answer.outcome  # doctest: +SKIP
        (201, <Outcome.EXECUTED: 'executed'>)
        """
        policy = self.policy
        if not policy.protects(method):
            status, out_headers, out_body = run(as_body_bytes(body, "request body"))
            if isinstance(out_body, str):
                out_body = out_body.encode("utf-8")
            return Answer(status, tuple(header_pairs(out_headers)), as_body_bytes(out_body, "response body"), Outcome.PASSTHROUGH)
        raw = as_body_bytes(body, "request body")
        if not principal:
            return Answer(*responses.unauthenticated(), Outcome.UNAUTHENTICATED)
        if key is None or key == "":
            return Answer(*responses.key_required(), Outcome.KEY_REQUIRED)
        if not is_valid_key(key):
            return Answer(*responses.key_invalid(), Outcome.KEY_INVALID)

        now = self.now()
        fp = fingerprint(method, path_and_query, headers, raw, policy.fingerprint_headers)
        backend = self.backend
        outcome = Outcome.EXECUTED
        generation = backend.claim(principal, key, fp, now)
        if generation is None:
            row = backend.lookup(principal, key)
            if row is None:
                # Swept between our failed claim and the lookup: the next try wins the claim.
                return Answer(*responses.retry(), Outcome.RETRY, None, now)
            if row.fingerprint != fp:
                return Answer(*responses.reused(policy), Outcome.REUSED, row.generation, now)
            if row.status is Status.COMPLETED:
                status, out_headers, out_body = responses.from_stored(
                    row.response_status, row.response_body, row.response_headers
                )
                return Answer(status, out_headers, out_body, Outcome.REPLAYED, row.generation, now)
            generation = backend.takeover(principal, key, fp, now, now - policy.pending_ttl_ms)
            if generation is None:
                return Answer(*responses.in_progress(policy), Outcome.IN_PROGRESS, row.generation, now)
            outcome = Outcome.TAKEN_OVER
            log.warning(
                "took over stale reservation principal=%s key=%s as generation %d", principal, key, generation
            )

        reservation = Reservation(principal, key, generation, fp)
        try:
            status, out_headers, out_body = run(raw)
        except BaseException:
            if release_on_error:
                self._release_quietly(reservation)
            raise
        done = self.complete(reservation, status, out_headers, out_body)
        return Answer(
            done.status,
            done.headers,
            done.body,
            outcome if done.stored else Outcome.FENCED_OUT,
            generation,
            now,
        )

    def after_response(self, answer: Answer) -> SweepResult | None:
        """The post-response housekeeping of SPEC §4.9: one bounded sweep batch
        at the request's own `now`. Call it after the answer has been sent.
        It never raises: a failed sweep is logged and retried by the next request.

        >>> ledger.after_response(answer)  # doctest: +SKIP
        SweepResult(keys_deleted=0, fenced_deleted=0, cutoff=...)
        """
        if answer.started_at is None or answer.outcome not in (
            Outcome.EXECUTED,
            Outcome.TAKEN_OVER,
            Outcome.FENCED_OUT,
        ):
            return None
        try:
            return self.sweep(now=answer.started_at)
        except IdemctlError as exc:
            log.warning("post-response sweep failed: %s", exc)
            return None

    # -- single steps, one statement each ----------------------------------------------
    def claim(self, principal: str, key: str, fingerprint: str, *, now: int | None = None) -> Reservation | None:
        """Atomically claim (principal, key) as generation 1; None if it exists.

        >>> ledger.claim("acct_1", "k1", fingerprint("POST", "/orders", [], b""))  # doctest: +SKIP
        Reservation(principal='acct_1', key='k1', generation=1, fingerprint='fc4d...')
        """
        self._check_key(key)
        now = self.now() if now is None else now
        generation = self.backend.claim(principal, key, fingerprint, now)
        return None if generation is None else Reservation(principal, key, generation, fingerprint)

    def lookup(self, principal: str, key: str) -> StoredRow | None:
        """The stored row, or None.

        >>> ledger.lookup("acct_1", "k1").status  # doctest: +SKIP
        <Status.PENDING: 'pending'>
        """
        return self.backend.lookup(principal, key)

    def takeover(self, principal: str, key: str, fingerprint: str, *, now: int | None = None) -> Reservation | None:
        """Take over a pending row older than the TTL, as the next generation;
        None if it is fresh, completed, gone or for another request.

        >>> ledger.takeover("acct_1", "k1", fp).generation  # doctest: +SKIP
        2
        """
        now = self.now() if now is None else now
        generation = self.backend.takeover(principal, key, fingerprint, now, now - self.policy.pending_ttl_ms)
        return None if generation is None else Reservation(principal, key, generation, fingerprint)

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

        >>> ledger.complete(reservation, 201, {"content-type": "text/plain"}, b"ok").stored  # doctest: +SKIP
        True
        """
        stored = responses.to_store(status, headers, body, self.policy)
        if stored.oversize:
            log.warning(
                "response for principal=%s key=%s exceeds %d bytes: stored as a 500 sentinel",
                reservation.principal,
                reservation.key,
                self.policy.body_cap_bytes,
            )
        answer = responses.from_stored(stored.status, stored.body, stored.headers_json)
        stamp = self.now() if now is None else now
        ok = self.backend.complete(
            reservation.principal,
            reservation.key,
            reservation.generation,
            stored.status,
            stored.body,
            stored.headers_json,
            stamp,
        )
        event = None
        if not ok:
            event = self.backend.record_fenced(
                reservation.principal, reservation.key, reservation.generation, stored.status, stamp
            )
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
        completion: it only deletes the row at this reservation's generation.

        >>> ledger.release(reservation)  # doctest: +SKIP
        True
        """
        return self.backend.release(reservation.principal, reservation.key, reservation.generation)

    def _release_quietly(self, reservation: Reservation) -> None:
        try:
            self.release(reservation)
        except IdemctlError as exc:
            log.error("could not release principal=%s key=%s: %s", reservation.principal, reservation.key, exc)

    def sweep(self, *, now: int | None = None, batch: int | None = None, retention_ms: int | None = None) -> SweepResult:
        """Delete at most `batch` rows (and `batch` fenced-out events) older than
        the retention: one bounded statement per table.

        >>> ledger.sweep(batch=500).keys_deleted  # doctest: +SKIP
        500
        """
        now = self.now() if now is None else now
        batch = self.policy.sweep_batch if batch is None else batch
        if batch < 1:
            raise PolicyError(f"sweep batch must be >= 1, got {batch}")
        return self.backend.sweep(now - self._retention(retention_ms), batch)

    @property
    def drain_batch(self) -> int:
        """The batch size this storage engine drains a backlog with (the
        CLI's `sweep` default): 250 on SQLite, where each batch holds the
        database-wide write lock that claims wait for; 1000 on PostgreSQL,
        where it locks only the expired rows it deletes.

        >>> Ledger.open("idempotency.db").drain_batch  # doctest: +SKIP
        250
        """
        return self.backend.drain_batch

    def _retention(self, retention_ms: int | None) -> int:
        if retention_ms is None:
            return self.policy.retention_ms
        if retention_ms <= self.policy.pending_ttl_ms:
            # Sweeping a live reservation would let a retry run the mutation again.
            raise PolicyError(
                f"retention ({retention_ms} ms) must be longer than the pending TTL ({self.policy.pending_ttl_ms} ms)"
            )
        return retention_ms

    # -- operator side --------------------------------------------------------------------
    def view(self, row: StoredRow, *, now: int | None = None) -> RowView:
        """A row with its derived state at `now`."""
        now = self.now() if now is None else now
        p = self.policy
        if row.updated_at < now - p.retention_ms:
            state = State.EXPIRED
        elif row.status is Status.COMPLETED:
            state = State.COMPLETED
        elif row.updated_at < now - p.pending_ttl_ms:
            state = State.PENDING_STALE
        else:
            state = State.PENDING_FRESH
        return RowView(row, state, now, p.pending_ttl_ms, p.retention_ms)

    def get(self, principal: str, key: str, *, now: int | None = None) -> RowView | None:
        """One row with its derived state, or None.

        >>> ledger.get("acct_1", "k1").state  # doctest: +SKIP
        <State.PENDING_FRESH: 'pending_fresh'>
        """
        row = self.backend.lookup(principal, key)
        return None if row is None else self.view(row, now=now)

    def pending(
        self,
        *,
        stale_only: bool = False,
        principal: str | None = None,
        limit: int | None = None,
        now: int | None = None,
    ) -> Iterator[RowView]:
        """Pending rows, oldest first, streamed.

        >>> [v.row.key for v in ledger.pending(stale_only=True)]  # doctest: +SKIP
        ['k1']
        """
        now = self.now() if now is None else now
        stale_before = now - self.policy.pending_ttl_ms if stale_only else None
        for row in self.backend.iter_pending(stale_before, principal, limit):
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

        >>> next(ledger.fenced(principal="acct_1")).superseded_generation  # doctest: +SKIP
        1
        """
        return self.backend.iter_fenced(principal, key, since, limit)

    def stats(self, *, now: int | None = None) -> Stats:
        """Rows by derived state, takeovers, fenced-out events, sweep backlog.

        >>> ledger.stats().expired  # doctest: +SKIP
        0
        """
        now = self.now() if now is None else now
        p = self.policy
        return self.backend.stats(now, now - p.pending_ttl_ms, now - p.retention_ms)

    def count_expired(self, *, now: int | None = None, retention_ms: int | None = None) -> int:
        """How many rows a full sweep would delete now."""
        now = self.now() if now is None else now
        return self.backend.count_expired(now - self._retention(retention_ms))

    def purge(self, principal: str, key: str, *, force: bool = False, now: int | None = None) -> PurgeResult:
        """Delete one reservation so the client's next retry runs the mutation
        again. A fresh pending row is refused unless `force`: its owner may
        still be running.

        >>> ledger.purge("acct_1", "k1").outcome  # doctest: +SKIP
        <PurgeOutcome.PURGED: 'purged'>
        """
        now = self.now() if now is None else now
        return self.backend.purge(principal, key, None if force else now - self.policy.pending_ttl_ms)

    @staticmethod
    def _check_key(key: Any) -> None:
        if not is_valid_key(key):
            raise InvalidKeyError(f"invalid Idempotency-Key {key!r}: must be 1-255 printable ASCII characters")
