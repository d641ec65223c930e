"""The Store: every statement idemctl runs, over one engine.

The store is the one SQL core: request-path steps are one auto-committed
statement each, operator reads and the sweep are bounded statements, and
the schema decision of `init` is made here. An engine (storage/sqlite/,
storage/postgres/, storage/mysql.py) only runs statements: its connections,
its locking and its error classes. Its parts, one job each: statements.py
(the texts), rows.py (a row's state and every decoding), store_base.py (the
plumbing and the schema), copy_statements.py (`idemctl copy`),
operator_statements.py (listings, stats, purge); here the request path,
renewals and the sweep."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

from ..errors import InvalidPrincipalError
from ..outcomes import FencedEvent, StoredRow, SweepResult
from .copy_statements import CopyStatements
from .engine import Rows
from .operator_statements import OperatorStatements
from .rows import LedgerRow, all_rows, any_row, decode_row, derive_state, fenced_event, first_int
from .statements import (
    CLAIM,
    CLAIM_OR_READ,
    COMPLETE,
    COMPLETED_AS,
    FENCED_EVENT,
    FENCED_TABLE,
    FROM_THE_START,
    OLDEST,
    OLDEST_WITH_FENCED,
    RECORD_FENCED,
    RELEASE,
    RENEW_MAX,
    RENEW_ONE,
    SWEEP_FENCED,
    TAKEOVER,
    new_token,
    renew_text,
)
from .store_base import Statement, StoreBase, StoreOp, StoreSteps, SweepSteps, Tables, Turn

R = TypeVar("R")
S = TypeVar("S", bound=StoreBase)
P = ParamSpec("P")

#: A reservation's row as a statement finds it: principal, key, generation, token.
Held = tuple[str, str, int, int | None]
#: An answer as it is stored: status, body, headers as JSON.
Answer = tuple[int, str | bytes | None, str]


def runs(build: Callable[Concatenate[S, P], Statement[R]]) -> Callable[Concatenate[S, P], R]:
    """A thin synchronous method over a `*_statement` builder, for the CLI,
    operators and scripts: ``store.claim(...)`` is ``store.run(store.claim_statement(...))``.
    The request path yields the statements themselves to its driver. The
    builder is looked up on the store, so a subclass's own (RedisStore's) is
    the one its wrapper runs."""
    name = build.__name__

    def step(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.run(getattr(self, name)(*args, **kwargs))  # type: ignore[no-any-return]

    return _named_after(step, build, "_statement")


def runs_steps(build: Callable[Concatenate[S, P], StoreSteps[R]]) -> Callable[Concatenate[S, P], R]:
    """A thin synchronous method over a `*_steps` builder (an operation of
    several statements), its steps run by `Store.run_steps`; the builder is
    looked up on the store, as in `runs`."""
    name = build.__name__

    def step(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.run_steps(getattr(self, name)(*args, **kwargs))  # type: ignore[no-any-return]

    return _named_after(step, build, "_steps")


def _named_after(
    step: Callable[Concatenate[S, P], R], build: Callable[..., object], suffix: str
) -> Callable[Concatenate[S, P], R]:
    # The wrapper carries its builder's documentation, under the step's own name.
    step.__doc__ = build.__doc__
    step.__name__ = step.__qualname__ = build.__name__.removesuffix(suffix)
    return step


class Store(CopyStatements, OperatorStatements):
    """The ledger's statements over one engine.

    >>> from idemctl.storage import open_engine
    >>> store = Store(open_engine(":memory:"))
    >>> store.init(0, dry_run=False).action.value
    'created'
    >>> store.claim("acct", "k", "fp", 1, 1000)
    1
    """

    # -- request path -----------------------------------------------------------------
    # Each step: `*_statement` builds it (or `*_steps` for several statements);
    # the method of the step's own name is a thin synchronous wrapper for operators.
    def _claim_params(self, principal: str, key: str, fingerprint: str, token: int, now: int) -> dict[str, Any]:
        limit = self.dialect.max_principal_bytes
        if limit is not None and len(principal.encode("utf-8")) > limit:
            # Refused before any statement, as for the principals no engine can store.
            raise InvalidPrincipalError(
                f"principal is {len(principal.encode('utf-8'))} bytes in UTF-8; "
                f"a {self.dialect.name} ledger stores principals of up to {limit} bytes"
            )
        return {"principal": principal, "key": key, "fingerprint": fingerprint, "token": token, "now": now}

    def claim_statement(
        self, principal: str, key: str, fingerprint: str, token: int, now: int
    ) -> Statement[int | None]:
        params = self._claim_params(principal, key, fingerprint, token, now)
        return Statement(self, self.sql(CLAIM), params, first_int, True)

    claim = runs(claim_statement)

    def claim_or_read_statement(
        self, principal: str, key: str, fingerprint: str, token: int, now: int
    ) -> Statement[int | StoredRow | None]:
        """The claim, one statement: where `dialect.claim_reads_row`, the
        claim and the row that stands in its way (CLAIM_OR_READ, PostgreSQL's
        one round trip for a replay); elsewhere the claim alone (CLAIM), and
        a lost claim gives None."""
        params = self._claim_params(principal, key, fingerprint, token, now)
        if self.dialect.claim_reads_row:
            return Statement(self, self.sql(CLAIM_OR_READ), params, self._claimed_or_row, True)
        return Statement(self, self.sql(CLAIM), params, first_int, True)

    def _claimed_or_row(self, rows: Rows) -> int | StoredRow | None:
        if not rows:
            return None
        first = rows[0]
        return int(first[0]) if first[0] is not None else decode_row(self.dialect, first[1:])

    def claim_or_read(self, principal: str, key: str, fingerprint: str, token: int, now: int) -> int | StoredRow | None:
        """The generation claimed; else, where the engine reads it in the
        claim's own statement (`dialect.claim_reads_row`), the row that holds
        the key. None: the claim was lost and no row was read with it (the
        engine cannot, or the row was committed while the claim waited), so
        the caller looks the key up (decision.decide).

        >>> from idemctl.storage import open_engine
        >>> store = Store(open_engine(":memory:"))
        >>> _ = store.init(0, dry_run=False)
        >>> store.claim_or_read("acct", "k", "fp", 1, 1000)
        1
        >>> store.claim_or_read("acct", "k", "fp", 2, 1001) is None  # SQLite: the lookup is the caller's
        True
        """
        return self.run(self.claim_or_read_statement(principal, key, fingerprint, token, now))

    def takeover_statement(
        self, principal: str, key: str, fingerprint: str, token: int, now: int, stale_before: int, expired_before: int
    ) -> Statement[int | None]:
        """A stale reservation of this request, or any row past retention,
        as the next generation (see TAKEOVER); None when neither."""
        params = {
            "principal": principal,
            "key": key,
            "fingerprint": fingerprint,
            "token": token,
            "now": now,
            "stale_before": stale_before,
            "expired_before": expired_before,
        }
        return Statement(self, self.sql(TAKEOVER), params, first_int, True)

    takeover = runs(takeover_statement)

    def complete_statement(self, held: Held, answer: Answer, now: int) -> Statement[bool]:
        """Store `answer` (status, body, headers as JSON) at `now` in the row
        `held` (principal, key, generation, token) while it is still pending
        under that generation and token (COMPLETE): whether it was stored."""
        return self.answer_statement(COMPLETE, held, answer, now)

    complete = runs(complete_statement)

    def completed_as_statement(self, held: Held, answer: Answer) -> Statement[bool]:
        """Whether the row holds this very answer, completed under this
        generation and token (COMPLETED_AS): a completion whose connection
        was lost committed after all. Read only after COMPLETE found the row
        no longer pending under them."""
        return self.answer_statement(COMPLETED_AS, held, answer)

    completed_as = runs(completed_as_statement)

    def answer_statement(self, text: str, held: Held, answer: Answer, now: int = 0) -> Statement[bool]:
        """COMPLETE (at `now`) or COMPLETED_AS of `answer` for the row `held`
        under its generation and token: the one place a store spells an
        answer's statement (a store of another kind overrides this alone).

        >>> from idemctl.storage import open_engine
        >>> store = Store(open_engine(":memory:"))
        >>> sorted(store.answer_statement(COMPLETED_AS, ("acct", "k", 1, 7), (201, None, "{}")).params)
        ['body', 'generation', 'headers', 'key', 'no_body', 'principal', 'status', 'token']
        """
        principal, key, generation, token = held
        status, body, headers_json = answer
        params = {
            "principal": principal,
            "key": key,
            "generation": generation,
            "token": token,
            "status": status,
            "body": self.dialect.body.bind(body),
            "headers": headers_json,
        }
        if text == COMPLETED_AS:
            params["no_body"] = 1 if body is None else 0
            return Statement(self, self.sql(COMPLETED_AS), params, any_row, False)
        params["now"] = now
        return Statement(self, self.sql(COMPLETE), params, any_row, True)

    def release_statement(self, principal: str, key: str, generation: int, token: int | None) -> Statement[bool]:
        params = {"principal": principal, "key": key, "generation": generation, "token": token}
        return Statement(self, self.sql(RELEASE), params, any_row, True)

    release = runs(release_statement)

    def record_fenced_statement(
        self, principal: str, key: str, generation: int, computed_status: int, now: int
    ) -> Statement[FencedEvent | None]:
        """Only for a ledger with the fenced-out log (`has_fenced_log`)."""
        params = {"principal": principal, "key": key, "generation": generation, "status": computed_status, "now": now}
        return Statement(self, self.sql(RECORD_FENCED), params, fenced_event, True)

    def renew(self, held: Sequence[Held], now: int) -> int:
        """Move `updated_at` to `now` for every (principal, key, generation,
        token) still pending as held; how many rows were renewed (on
        MariaDB/MySQL, rows whose `updated_at` changed). Every row is reached
        through the key's unique index (`renew_statements`): one statement per
        RENEW_MAX reservations, or on SQLite one per reservation, all in one
        transaction."""
        self._guard()
        if not held:
            return 0
        statements = self.renew_statements(held, now)
        if self.dialect.renew_form != "each":
            return sum(len(self.engine.write(sql, params)) for sql, params in statements)
        together = getattr(self.engine, "write_batch", None)
        if together is None:
            return sum(len(rows) for rows in self.engine.write_turn(statements))
        outcomes = together(statements)
        failed = next((o for o in outcomes if isinstance(o, Exception)), None)
        if failed is not None:
            raise failed  # the next tick renews them all again
        return sum(len(rows) for rows in outcomes)

    def renew_statements(self, held: Sequence[Held], now: int) -> list[tuple[str, dict[str, Any]]]:
        """The statements `renew` runs for `held`, as this engine spells
        them (what EXPLAIN should be asked about).

        >>> from idemctl.storage import open_engine
        >>> store = Store(open_engine(":memory:"))
        >>> [" ".join(sql.split())[:40] for sql, _ in store.renew_statements([("a", "k1", 1, 7), ("a", "k2", 1, 8)], 0)]
        ['UPDATE idempotency_keys SET updated_at =', 'UPDATE idempotency_keys SET updated_at =']
        """
        form = self.dialect.renew_form
        if form == "each":
            one = self.sql(RENEW_ONE)
            return [
                (one, {"now": now, "p0": principal, "k0": key, "g0": generation, "t0": token})
                for principal, key, generation, token in held
            ]
        statements: list[tuple[str, dict[str, Any]]] = []
        for start in range(0, len(held), RENEW_MAX):
            chunk = list(held[start : start + RENEW_MAX])
            size = 1 << (len(chunk) - 1).bit_length()
            chunk += [chunk[-1]] * (size - len(chunk))  # a repeated row matches once
            params: dict[str, Any] = {"now": now}
            for i, (principal, key, generation, token) in enumerate(chunk):
                params.update({f"p{i}": principal, f"k{i}": key, f"g{i}": generation, f"t{i}": token})
            statements.append((self.sql(renew_text(size, form, self.dialect.returning)), params))
        return statements

    def record_fenced_steps(
        self, principal: str, key: str, generation: int, computed_status: int, now: int
    ) -> StoreSteps[FencedEvent | None]:
        """Record a fenced-out completion in the fenced-out log; None for a
        ledger without the log (the recipe's table alone, until `init`). An
        engine without RETURNING gets the event's id from the insert and
        reads the event back by it."""
        if FENCED_TABLE not in (yield Tables(self)):
            return None
        if not self.dialect.returning:
            params = {"principal": principal, "key": key, "generation": generation}
            params.update(status=computed_status, now=now)
            rows = yield Statement(self, self.sql(RECORD_FENCED), params, all_rows, True)
            if not rows:
                return None
            event: FencedEvent | None = yield Statement(
                self, self.sql(FENCED_EVENT), {"id": rows[0][0]}, self._first_event, False
            )
            return event
        event = yield self.record_fenced_statement(principal, key, generation, computed_status, now)
        return event

    record_fenced = runs_steps(record_fenced_steps)

    def _first_event(self, rows: Rows) -> FencedEvent | None:
        return self._event(rows[0]) if rows else None

    # -- sweep ------------------------------------------------------------------------------
    def sweep_steps(self, now: int, cutoff: int, fenced_cutoff: int, limit: int) -> SweepSteps:
        """At most `limit` expired rows and `limit` expired fenced-out events,
        in one turn of the engine's writer queue, as steps (run by `sweep`
        here, by the post-response sweep's driver, sync or async).
        First one indexed read of
        the oldest timestamps: when nothing is past retention it deletes
        nothing, takes no write lock, and says in `quiet_for_ms` how long
        nothing can be (rows only get newer). While a backlog drains (the
        last batch was full) the read is skipped. Not check-then-act: each
        DELETE decides on its own."""
        fenced_log = FENCED_TABLE in (yield Tables(self))
        return (yield from self._sweep_steps(now, cutoff, fenced_cutoff, limit, fenced_log))

    sweep = runs_steps(sweep_steps)

    def _sweep_steps(self, now: int, cutoff: int, fenced_cutoff: int, limit: int, fenced_log: bool) -> SweepSteps:
        if self._draining:
            self._draining = False
            keys, _ = yield from self._delete_batch(cutoff, limit, self._sweep_from, None)
            if keys:
                return SweepResult(keys, 0, cutoff, fenced_cutoff)
        probe = self.sql(OLDEST_WITH_FENCED if fenced_log else OLDEST)
        after = self._sweep_from
        while True:
            oldest = (yield Statement(self, probe, {"after": after}, all_rows, False))[0]
            oldest_row = oldest[0]
            oldest_event = oldest[1] if fenced_log else None
            # With no row (or event), the first one to expire is one written from now on.
            row_headroom = (now if oldest_row is None else int(oldest_row)) - cutoff
            event_headroom = (now if oldest_event is None else int(oldest_event)) - fenced_cutoff
            if not fenced_log:
                event_headroom = row_headroom
            if row_headroom <= 0 or after == FROM_THE_START:
                break
            # Nothing due past the hint: one walk from the start makes sure
            # (a row written by a host whose clock lags would sit below it).
            after = self._sweep_from = FROM_THE_START
        if row_headroom > 0 and event_headroom > 0:
            return SweepResult(0, 0, cutoff, fenced_cutoff, min(row_headroom, event_headroom))
        fenced_cutoff_due = fenced_cutoff if fenced_log and event_headroom <= 0 else None
        if row_headroom > 0:
            (events,) = yield Turn(self, [self._fenced_batch(fenced_cutoff, limit)])
            return SweepResult(0, len(events), cutoff, fenced_cutoff)
        keys, fenced = yield from self._delete_batch(cutoff, limit, int(oldest_row), fenced_cutoff_due)
        return SweepResult(keys, fenced, cutoff, fenced_cutoff)

    def _fenced_batch(self, cutoff: int, limit: int) -> tuple[str, Mapping[str, Any]]:
        return self.sql(SWEEP_FENCED), {"cutoff": cutoff, "limit": limit}

    def _delete_batch(
        self, cutoff: int, limit: int, after: int, fenced_cutoff: int | None
    ) -> StoreSteps[tuple[int, int]]:
        """One batch of expired rows from `after` on, and one of the
        fenced-out log's when `fenced_cutoff` is given, in one turn; it
        remembers where the rows' batch ended."""
        batch = {"after": after, "cutoff": cutoff, "limit": limit}
        statements: list[tuple[str, Mapping[str, Any]]] = [(self.sql(self.dialect.sweep.statement), batch)]
        if fenced_cutoff is not None:
            statements.append(self._fenced_batch(fenced_cutoff, limit))
        results = yield Turn(self, statements)
        keys, newest = self.dialect.sweep.tally(results[0])
        if newest is not None:
            self._sweep_from = newest
        self._draining = keys >= limit
        return keys, len(results[1]) if fenced_cutoff is not None else 0


# What other modules import from here, where they live now.
__all__ = [
    "LedgerRow",
    "Statement",
    "Store",
    "StoreOp",
    "StoreSteps",
    "SweepSteps",
    "Tables",
    "Turn",
    "derive_state",
    "new_token",
]
