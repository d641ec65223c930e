"""The ledger: the Idempotency-Key contract on top of the SQL store.

The ledger decides; the store only runs single atomic statements. Nothing
here checks a row in Python and then writes based on what it saw: every
decision that matters is inside the WHERE clause of one statement."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, Union

from . import responses
from .errors import (
    IdemctlError,
    InvalidKeyError,
    InvalidPrincipalError,
    InvalidRequestError,
    MalformedRowError,
    PolicyError,
    SchemaMissingError,
    SchemaOutdatedError,
)
from .fingerprint import HeadersLike, as_body_bytes, fingerprint, header_pairs, is_valid_key
from .storage import DEFAULT_FILE_MODE, Store, open_engine
from .storage.store import derive_state, new_token
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

    def __init__(self, store: Store, *, policy: Policy | None = None, clock: Clock | None = None) -> None:
        self.store = store
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
        file_mode: int = DEFAULT_FILE_MODE,
    ) -> "Ledger":
        """Open a ledger: a SQLite file path or a ``postgresql://`` URL.

        Opening never creates anything: :meth:`init` creates the schema (and
        a SQLite file, with permission bits ``file_mode``: owner-only 0o600
        by default, 0o660 to share it with the group; SQLite gives its -wal
        and -shm files the same bits). ``create=False`` refuses a missing
        SQLite file at once (LedgerNotFoundError); ``readonly=True`` never
        writes. On SQLite, ``synchronous`` is the PRAGMA of that name and
        ``write_queue=False`` turns off the fair writer queue
        (docs/performance.md).

        >>> ledger = Ledger.open("idempotency.db", policy=Policy(pending_ttl_ms=60_000))  # doctest: +SKIP
        """
        engine = open_engine(
            target,
            create=create,
            readonly=readonly,
            busy_timeout_ms=busy_timeout_ms,
            synchronous=synchronous,
            write_queue=write_queue,
            file_mode=file_mode,
        )
        store = Store(engine)
        if not is_remote(target):
            # A file's schema is checked at open (it costs no connection):
            # a ledger written by a newer idemctl is refused before any use.
            try:
                store.check_not_newer()
            except BaseException:
                store.close()
                raise
        return cls(store, policy=policy, clock=clock)

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.store.close()

    def describe(self) -> str:
        """Where the ledger lives, safe to print (a URL without its password).

        >>> Ledger.open(":memory:").describe()
        ':memory:'
        """
        return self.store.describe()

    def now(self) -> int:
        return int(self.clock())

    # -- schema ---------------------------------------------------------------------
    def init(self, *, dry_run: bool = False) -> InitResult:
        """Create or upgrade the schema; safe to run any number of times.

        >>> Ledger.open("idempotency.db").init().describe()  # doctest: +SKIP
        'created (schema version 1)'
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
        if principal is None or principal == "":
            return Answer(*responses.unauthenticated(), Outcome.UNAUTHENTICATED)
        check_principal(principal)
        if key is None or key == "":
            return Answer(*responses.key_required(), Outcome.KEY_REQUIRED)
        if not is_valid_key(key):
            return Answer(*responses.key_invalid(), Outcome.KEY_INVALID)
        check_request_line(method, path_and_query)

        now = self.now()
        fp = fingerprint(method, path_and_query, headers, raw, policy.fingerprint_headers)
        store = self.store
        outcome = Outcome.EXECUTED
        token = new_token()
        generation = store.claim(principal, key, fp, token, now)
        if generation is None:
            row = store.lookup(principal, key)
            if row is None:
                # Swept between our failed claim and the lookup: the next try wins the claim.
                return Answer(*responses.retry(), Outcome.RETRY, None, now)
            if row.fingerprint != fp:
                return Answer(*responses.reused(policy), Outcome.REUSED, row.generation, now)
            if row.status is Status.COMPLETED:
                status, out_headers, out_body = responses.from_stored(
                    row.response_status, row.response_body, row.response_headers, row=(principal, key)
                )
                return Answer(status, out_headers, out_body, Outcome.REPLAYED, row.generation, now)
            generation = store.takeover(principal, key, fp, token, now, now - policy.pending_ttl_ms)
            if generation is None:
                return Answer(*responses.in_progress(policy), Outcome.IN_PROGRESS, row.generation, now)
            outcome = Outcome.TAKEN_OVER
            log.warning(
                "took over stale reservation principal=%s key=%s as generation %d", principal, key, generation
            )

        reservation = Reservation(principal, key, generation, fp, token)
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
        check_principal(principal)
        self._check_key(key)
        now = self.now() if now is None else now
        token = new_token()
        generation = self.store.claim(principal, key, fingerprint, token, now)
        return None if generation is None else Reservation(principal, key, generation, fingerprint, token)

    def lookup(self, principal: str, key: str) -> StoredRow | None:
        """The stored row, or None.

        >>> ledger.lookup("acct_1", "k1").status  # doctest: +SKIP
        <Status.PENDING: 'pending'>
        """
        return self.store.lookup(principal, key)

    def takeover(self, principal: str, key: str, fingerprint: str, *, now: int | None = None) -> Reservation | None:
        """Take over a pending row older than the TTL, as the next generation;
        None if it is fresh, completed, gone or for another request.

        >>> ledger.takeover("acct_1", "k1", fp).generation  # doctest: +SKIP
        2
        """
        check_principal(principal)
        self._check_key(key)
        now = self.now() if now is None else now
        token = new_token()
        generation = self.store.takeover(principal, key, fingerprint, token, now, now - self.policy.pending_ttl_ms)
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

        >>> ledger.complete(reservation, 201, {"content-type": "text/plain"}, b"ok").stored  # doctest: +SKIP
        True
        """
        where = (reservation.principal, reservation.key)
        stored = responses.to_store(status, headers, body, self.policy, row=where)
        if stored.oversize:
            log.warning(
                "response for principal=%s key=%s exceeds %d bytes: stored as a 500 sentinel",
                reservation.principal,
                reservation.key,
                self.policy.body_cap_bytes,
            )
        answer = responses.from_stored(stored.status, stored.body, stored.headers_json, row=where)
        stamp = self.now() if now is None else now
        ok = self.store.complete(
            reservation.principal,
            reservation.key,
            reservation.generation,
            reservation.token,
            stored.status,
            stored.body,
            stored.headers_json,
            stamp,
        )
        event = None
        if not ok:
            event = self.store.record_fenced(
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
        completion: it deletes the row only while it is still this
        reservation's (generation and token), never a newer owner's.

        >>> ledger.release(reservation)  # doctest: +SKIP
        True
        """
        return self.store.release(reservation.principal, reservation.key, reservation.generation, reservation.token)

    def _release_quietly(self, reservation: Reservation) -> None:
        try:
            self.release(reservation)
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

        >>> ledger.sweep(batch=500).keys_deleted  # doctest: +SKIP
        500
        """
        now = self.now() if now is None else now
        batch = self.policy.sweep_batch if batch is None else batch
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise PolicyError(f"sweep batch must be >= 1, got {batch}")
        return self.store.sweep(now - self._retention(retention_ms), now - self._fenced_retention(fenced_retention_ms), batch)

    @property
    def drain_batch(self) -> int:
        """The batch size this storage engine drains a backlog with (the
        CLI's `sweep` default): 250 on SQLite, where each batch holds the
        database-wide write lock that claims wait for; 1000 on PostgreSQL,
        where it locks only the expired rows it deletes.

        >>> Ledger.open("idempotency.db").drain_batch  # doctest: +SKIP
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

    # -- operator side --------------------------------------------------------------------
    def view(self, row: StoredRow, *, now: int | None = None) -> RowView:
        """A row with its derived state at `now`."""
        now = self.now() if now is None else now
        p = self.policy
        state = derive_state(row, now - p.pending_ttl_ms, now - p.retention_ms)
        return RowView(row, state, now, p.pending_ttl_ms, p.retention_ms)

    def get(self, principal: str, key: str, *, now: int | None = None) -> RowView | None:
        """One row with its derived state, or None.

        >>> ledger.get("acct_1", "k1").state  # doctest: +SKIP
        <State.PENDING_FRESH: 'pending_fresh'>
        """
        row = self.store.lookup(principal, key)
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

        >>> [v.row.key for v in ledger.pending(stale_only=True)]  # doctest: +SKIP
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

        >>> next(ledger.fenced(principal="acct_1")).superseded_generation  # doctest: +SKIP
        1
        """
        return self.store.iter_fenced(principal, key, since, limit)

    def stats(self, *, now: int | None = None) -> Stats:
        """Rows by derived state, takeovers, fenced-out events, sweep backlog.

        >>> ledger.stats().expired  # doctest: +SKIP
        0
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

        >>> ledger.purge("acct_1", "k1").outcome  # doctest: +SKIP
        <PurgeOutcome.PURGED: 'purged'>
        """
        now = self.now() if now is None else now
        return self.store.purge(principal, key, None if force else now - self.policy.pending_ttl_ms)

    @staticmethod
    def _check_key(key: Any) -> None:
        if not is_valid_key(key):
            raise InvalidKeyError(f"invalid Idempotency-Key {key!r}: must be 1-255 printable ASCII characters")


def is_remote(target: object) -> bool:
    return isinstance(target, str) and target.startswith(("postgresql://", "postgres://"))


def check_principal(principal: object) -> None:
    """A principal is stored and compared exactly: it must be a non-empty
    str that encodes as UTF-8 and holds no NUL (PostgreSQL text cannot).

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
        principal.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidPrincipalError(f"principal {principal!r} is not valid UTF-8 (it holds a lone surrogate)") from None
    if "\x00" in principal:
        raise InvalidPrincipalError(f"principal {principal!r} holds a NUL character")


def _has_control(text: str) -> bool:
    return any(ord(c) < 0x20 or ord(c) == 0x7F for c in text)


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
