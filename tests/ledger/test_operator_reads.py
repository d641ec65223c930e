"""The read side operators use: derived state, pending, fenced, stats, purge."""

from __future__ import annotations

from dataclasses import replace

import pytest

from idemctl import State, Status
from idemctl.outcomes import PurgeOutcome

TTL = 30_000
DAY = 86_400_000


def test_get_pending_fresh_reports_time_left_until_takeover(ledger, clock):
    ledger.claim("acct", "k", "fp")
    clock.advance(12_000)
    view = ledger.operator.get("acct", "k")
    assert view.state is State.PENDING_FRESH
    assert view.age_ms == 12_000
    assert view.takeover_in_ms == 18_001
    assert view.takeover_at == clock.now - 12_000 + TTL + 1
    assert view.replay_until is None
    assert view.takeovers == 0


def test_get_pending_stale_and_takeover_count(ledger, clock):
    ledger.claim("acct", "k", "fp")
    clock.advance(TTL + 1)
    ledger.takeover("acct", "k", "fp")
    clock.advance(TTL + 5)
    view = ledger.operator.get("acct", "k")
    assert view.state is State.PENDING_STALE
    assert view.takeover_in_ms == 0
    assert (view.row.generation, view.takeovers) == (2, 1)


def test_get_completed_reports_replay_until_and_sweep_after(ledger, clock):
    r = ledger.claim("acct", "k", "fp")
    clock.advance(100)
    ledger.complete(r, 201, {}, b"x")
    done_at = clock.now
    clock.advance(3_600_000)
    view = ledger.operator.get("acct", "k")
    assert view.state is State.COMPLETED
    assert view.replay_until == done_at + DAY
    assert view.sweep_after == done_at + DAY + 1
    assert view.takeover_at is None
    clock.advance(DAY)
    assert ledger.operator.get("acct", "k").state is State.EXPIRED
    assert ledger.operator.get("acct", "nope") is None


def test_pending_lists_oldest_first_and_filters_stale_and_principal(ledger, clock):
    ledger.claim("acct_A", "a1", "fp")
    clock.advance(10)
    ledger.claim("acct_B", "b1", "fp")
    clock.advance(10)
    done = ledger.claim("acct_A", "a-done", "fp")
    ledger.complete(done, 200, {}, b"")
    clock.advance(TTL - 15)  # a1 is now TTL + 5 ms old (stale), b1 TTL - 5 ms (fresh)
    ledger.claim("acct_A", "a2", "fp")
    assert [v.row.key for v in ledger.operator.pending()] == ["a1", "b1", "a2"]
    assert [v.row.key for v in ledger.operator.pending(principal="acct_A")] == ["a1", "a2"]
    assert [v.row.key for v in ledger.operator.pending(stale_only=True)] == ["a1"]
    assert [v.state for v in ledger.operator.pending()] == [
        State.PENDING_STALE,
        State.PENDING_FRESH,
        State.PENDING_FRESH,
    ]
    assert [v.row.key for v in ledger.operator.pending(limit=2)] == ["a1", "b1"]


@pytest.mark.engines("sqlite", "postgres", "mysql")  # on D1: tests/d1/test_contract_on_d1.py
def test_pending_read_in_pages_lists_every_row_once_in_order_across_ties_limits_and_filters(ledger, clock, monkeypatch):
    pending_in_pages(ledger, clock, monkeypatch)


def pending_in_pages(ledger, clock, monkeypatch):
    """D1 answers a statement in one document, so its listing reads pages:
    here two-row pages, with page edges inside ties."""
    engine = ledger.store.engine
    monkeypatch.setattr(engine, "dialect", replace(engine.dialect, list_page=2))
    pages: list[str] = []
    read = engine.read

    def counted(sql, params):
        if "status = 'pending'" in sql:
            pages.append(sql)
        return read(sql, params)

    monkeypatch.setattr(engine, "read", counted)
    for principal, key in (("acct_B", "k1"), ("acct_A", "k3"), ("acct_A", "k2")):
        ledger.claim(principal, key, "fp")  # one instant: the principal, then the key, orders them
    clock.advance(10)
    ledger.claim("acct_C", "k0", "fp")
    ledger.claim("acct_A", "k4", "fp")
    clock.advance(10)
    ledger.claim("acct_A", "k5", "fp")

    def listed(**options):
        pages.clear()
        return [(v.row.principal, v.row.key) for v in ledger.operator.pending(**options)], len(pages)

    every = [("acct_A", "k2"), ("acct_A", "k3"), ("acct_B", "k1"), ("acct_A", "k4"), ("acct_C", "k0"), ("acct_A", "k5")]
    assert listed() == (every, 4)  # three full pages, then an empty one
    assert listed(limit=3) == (every[:3], 2)
    assert listed(limit=4) == (every[:4], 2)
    assert listed(principal="acct_A") == ([r for r in every if r[0] == "acct_A"], 3)
    clock.advance(TTL + 1)
    assert listed(stale_only=True) == (every, 4)


def test_fenced_filters_by_principal_key_and_since(ledger, clock):
    pairs = (("A", "k1"), ("A", "k2"), ("B", "k1"))
    owners = [ledger.claim(p, k, "fp") for p, k in pairs]
    clock.advance(TTL + 1)
    for (p, k), r in zip(pairs, owners):
        new = ledger.takeover(p, k, "fp")
        ledger.complete(new, 200, {}, b"")
        clock.advance(1_000)
        ledger.complete(r, 418, {}, b"")
    events = list(ledger.operator.fenced())
    assert [(e.principal, e.key) for e in events] == [("B", "k1"), ("A", "k2"), ("A", "k1")]
    assert [e.key for e in ledger.operator.fenced(principal="A")] == ["k2", "k1"]
    assert [e.principal for e in ledger.operator.fenced(key="k1")] == ["B", "A"]
    assert [e.key for e in ledger.operator.fenced(since=clock.now - 1_000)] == ["k1", "k2"]
    assert len(list(ledger.operator.fenced(limit=1))) == 1
    assert all(e.computed_status == 418 for e in events)


def test_stats_counts_every_state(ledger, clock):
    start = clock.now
    old = ledger.claim("acct", "expired", "fp")
    ledger.complete(old, 200, {}, b"")
    clock.advance(DAY + 1)
    ledger.claim("acct", "stale", "fp")
    clock.advance(TTL + 1)
    r = ledger.claim("acct", "taken", "fp")
    clock.advance(TTL + 1)
    new = ledger.takeover("acct", "taken", "fp")
    ledger.complete(new, 200, {}, b"")
    ledger.complete(r, 200, {}, b"")  # fenced out
    ledger.claim("acct", "fresh", "fp")
    s = ledger.operator.stats()
    assert (s.total, s.pending_fresh, s.pending_stale, s.completed, s.expired) == (4, 1, 1, 1, 1)
    assert (s.taken_over, s.fenced_out_events, s.schema_version) == (1, 1, 3)
    assert s.oldest_row_at == start
    assert s.oldest_completed_at == start
    assert s.oldest_pending_at == start + DAY + 1
    assert s.now == clock.now
    assert s.storage_bytes is None or s.storage_bytes > 0


def test_purge_deletes_a_completed_row_so_the_retry_runs_again(ledger):
    calls = []
    run = lambda b: (calls.append(b), (201, {}, b"x"))[1]  # noqa: E731
    ledger.handle("acct", "k", "POST", "/", {}, b"", run)
    result = ledger.operator.purge("acct", "k")
    assert result.outcome is PurgeOutcome.PURGED
    assert (result.row.key, result.row.status) == ("k", Status.COMPLETED)
    assert ledger.lookup("acct", "k") is None
    assert ledger.handle("acct", "k", "POST", "/", {}, b"", run).outcome.value == "executed"
    assert len(calls) == 2


def test_purge_refuses_a_fresh_pending_row_unless_forced(ledger, clock):
    ledger.claim("acct", "k", "fp")
    refused = ledger.operator.purge("acct", "k")
    assert refused.outcome is PurgeOutcome.REFUSED_FRESH_PENDING
    assert refused.row.status is Status.PENDING
    assert ledger.lookup("acct", "k") is not None
    forced = ledger.operator.purge("acct", "k", force=True)
    assert forced.outcome is PurgeOutcome.PURGED
    assert ledger.lookup("acct", "k") is None


def test_purge_allows_a_stale_pending_row_and_reports_missing(ledger, clock):
    ledger.claim("acct", "k", "fp")
    clock.advance(TTL + 1)
    assert ledger.operator.purge("acct", "k").outcome is PurgeOutcome.PURGED
    missing = ledger.operator.purge("acct", "k")
    assert (missing.outcome, missing.row) == (PurgeOutcome.NOT_FOUND, None)
