"""The seam between the ledger logic and a storage engine.

Every request-path method is exactly one SQL statement. A backend holds all
of its SQL in its own module; the ledger never sees SQL."""

from __future__ import annotations

from typing import Iterator, Protocol

from ..outcomes import FencedEvent, InitResult, PurgeResult, Stats, StoredRow, SweepResult


class Backend(Protocol):
    dialect: str
    # Rows per DELETE when an operator drains a backlog (`idemctl sweep`).
    drain_batch: int
    # True once the idemctl tables exist; a recipe-only database has just the ledger table.
    has_fenced_log: bool

    def describe(self) -> str:
        """Where the ledger lives, safe to print (no password)."""

    def close(self) -> None: ...

    # -- schema -------------------------------------------------------------
    def schema_version(self) -> int | None:
        """None: no ledger table; 0: the recipe's table only; N: idemctl schema N."""

    def init(self, now: int, dry_run: bool) -> InitResult: ...

    # -- request path: one statement each -------------------------------------
    def claim(self, principal: str, key: str, fingerprint: str, now: int) -> int | None: ...

    def lookup(self, principal: str, key: str) -> StoredRow | None: ...

    def takeover(self, principal: str, key: str, fingerprint: str, now: int, stale_before: int) -> int | None: ...

    def complete(
        self,
        principal: str,
        key: str,
        generation: int,
        status: int,
        body: str | bytes | None,
        headers_json: str,
        now: int,
    ) -> bool: ...

    def record_fenced(self, principal: str, key: str, generation: int, computed_status: int, now: int) -> FencedEvent | None: ...

    def release(self, principal: str, key: str, generation: int) -> bool: ...

    def sweep(self, cutoff: int, limit: int) -> SweepResult: ...

    # -- operator side ----------------------------------------------------------
    def count_expired(self, cutoff: int) -> int: ...

    def iter_pending(self, stale_before: int | None, principal: str | None, limit: int | None) -> Iterator[StoredRow]: ...

    def iter_fenced(
        self, principal: str | None, key: str | None, since: int | None, limit: int | None
    ) -> Iterator[FencedEvent]: ...

    def stats(self, now: int, stale_before: int, expired_before: int) -> Stats: ...

    def purge(self, principal: str, key: str, stale_before: int | None) -> PurgeResult:
        """Delete one row unless it is pending and fresh (stale_before=None: force)."""
