"""The bounded sweep: batch size, order, retention and the fenced-out log."""

from __future__ import annotations

import sqlite3

import pytest

from idemctl import Ledger, Outcome, Policy, PolicyError
from idemctl.storage.dialect import SQLITE
from idemctl.storage.statements import OLDEST, OLDEST_WITH_FENCED, SWEEP_FENCED
from idemctl.storage.store import Statement

SQL_SWEEP, SQL_SWEEP_FENCED = SQLITE.sweep.statement, SWEEP_FENCED

DAY = 86_400_000


def fill(ledger, clock, n, *, prefix="k", step=1):
    for i in range(n):
        r = ledger.claim("acct", f"{prefix}{i:04d}", "fp")
        ledger.complete(r, 200, {}, b"ok")
        clock.advance(step)


def test_sweep_deletes_at_most_the_batch_per_call_oldest_first(ledger, clock):
    fill(ledger, clock, 50)
    clock.advance(DAY + 100)
    first = ledger.operator.sweep(batch=20)
    assert first.keys_deleted == 20
    remaining = sorted(v.row.key for v in ledger.operator.pending()) + [
        k for k in (f"k{i:04d}" for i in range(50)) if ledger.lookup("acct", k) is not None
    ]
    assert remaining == [f"k{i:04d}" for i in range(20, 50)]
    assert ledger.operator.sweep(batch=20).keys_deleted == 20
    assert ledger.operator.sweep(batch=20).keys_deleted == 10
    assert ledger.operator.sweep(batch=20).keys_deleted == 0
    assert ledger.operator.stats().total == 0


def test_sweep_never_deletes_a_row_inside_retention(ledger, clock):
    fill(ledger, clock, 10, prefix="old")
    clock.advance(DAY)
    fill(ledger, clock, 5, prefix="new")
    # old rows are now between 1 day - 10ms and 1 day + 5 ms old.
    result = ledger.operator.sweep(batch=1000)
    kept_old = [k for k in (f"old{i:04d}" for i in range(10)) if ledger.lookup("acct", k)]
    assert result.keys_deleted == 10 - len(kept_old)
    for key in kept_old:
        assert ledger.operator.get("acct", key).age_ms <= DAY
    assert all(ledger.lookup("acct", f"new{i:04d}") for i in range(5))


def test_a_row_written_below_a_draining_sweeps_starting_point_is_still_swept(make_ledger, clock):
    # A drain starts each batch's index walk at the oldest row it last saw.
    # A host whose clock lags a day behind writes a row older than that
    # point: the drain must still find it before it reports nothing left.
    ledger = make_ledger()
    fill(ledger, clock, 30)
    clock.advance(DAY + 100)
    assert ledger.operator.sweep(batch=10).keys_deleted == 10
    lagging = make_ledger(clock_fn=lambda: clock() - DAY - 50, init=False)
    lagging.complete(lagging.claim("acct", "from-the-past", "fp"), 200, {}, b"ok")
    drained = ledger.operator.drain(batch=10)
    assert (drained.keys_deleted, drained.stopped.value) == (21, "drained")
    assert ledger.lookup("acct", "from-the-past") is None
    assert ledger.operator.stats().total == 0


def test_once_a_sweep_finds_nothing_due_it_walks_from_the_start_again(make_ledger, clock):
    ledger = make_ledger()
    fill(ledger, clock, 5)
    clock.advance(DAY + 100)
    assert ledger.operator.drain(batch=2).keys_deleted == 5
    lagging = make_ledger(clock_fn=lambda: clock() - 2 * DAY, init=False)
    lagging.complete(lagging.claim("acct", "late", "fp"), 200, {}, b"ok")
    assert ledger.operator.sweep(batch=10).keys_deleted == 1


def test_sweep_also_removes_abandoned_pending_rows(ledger, clock):
    ledger.claim("acct", "abandoned", "fp")
    clock.advance(DAY + 1)
    assert ledger.operator.sweep().keys_deleted == 1


def test_default_batch_is_the_policy_batch(make_ledger, clock):
    ledger = make_ledger(policy=Policy(sweep_batch=7))
    fill(ledger, clock, 10)
    clock.advance(DAY + 100)
    assert ledger.operator.sweep().keys_deleted == 7


def test_the_fenced_out_log_outlives_the_rows_it_is_about_for_its_own_retention(ledger, clock):
    owners = [ledger.claim("acct", f"f{i}", "fp") for i in range(3)]
    clock.advance(30_001)
    for i, a in enumerate(owners):
        b = ledger.takeover("acct", f"f{i}", "fp")
        ledger.complete(b, 200, {}, b"B")
        assert ledger.complete(a, 200, {}, b"A").stored is False
    assert len(list(ledger.operator.fenced())) == 3
    clock.advance(DAY + 1)
    rows = ledger.operator.sweep(batch=2)
    assert (rows.keys_deleted, rows.fenced_deleted) == (2, 0)
    assert (ledger.operator.sweep(batch=2).keys_deleted, ledger.operator.count_fenced_expired()) == (1, 0)
    # The events stay 30 days (Policy.fenced_retention_ms), then go in bounded batches.
    clock.advance(30 * DAY - DAY - 1)
    assert (ledger.operator.count_fenced_expired(), ledger.operator.sweep(batch=2).fenced_deleted) == (0, 0)
    clock.advance(1)
    assert ledger.operator.count_fenced_expired() == 3
    first = ledger.operator.sweep(batch=2)
    assert (first.keys_deleted, first.fenced_deleted, first.fenced_cutoff) == (0, 2, clock.now - 30 * DAY)
    assert ledger.operator.sweep(batch=2).fenced_deleted == 1
    assert list(ledger.operator.fenced()) == []


def test_a_shorter_fenced_out_log_retention_is_a_policy_choice(make_ledger, clock):
    ledger = make_ledger(policy=Policy(fenced_retention_ms=DAY))
    a = ledger.claim("acct", "k", "fp")
    clock.advance(30_001)
    ledger.complete(ledger.takeover("acct", "k", "fp"), 200, {}, b"B")
    assert ledger.complete(a, 200, {}, b"A").event is not None
    clock.advance(DAY + 1)
    assert (ledger.operator.sweep().keys_deleted, list(ledger.operator.fenced())) == (1, [])
    assert list(ledger.operator.fenced()) == []


def test_after_response_runs_one_batch_at_the_requests_own_time(make_ledger, clock):
    ledger = make_ledger(policy=Policy(sweep_batch=3))
    fill(ledger, clock, 5)
    clock.advance(DAY + 10)
    answer = ledger.handle("acct", "fresh", "POST", "/", {}, b"", lambda b: (200, {}, b""))
    clock.advance(DAY * 5)  # the sweep must use answer.started_at, not a later clock
    result = ledger.after_response(answer)
    assert result.keys_deleted == 3
    assert result.cutoff == answer.started_at - DAY
    assert ledger.lookup("acct", "fresh") is not None


def test_after_response_skips_answers_that_never_touched_the_ledger(ledger):
    answer = ledger.handle("acct", None, "POST", "/", {}, b"", lambda b: (200, {}, b""))
    assert answer.outcome is Outcome.KEY_REQUIRED
    assert ledger.after_response(answer) is None


def test_after_response_logs_and_swallows_storage_errors(ledger, clock, caplog, monkeypatch):
    answer = ledger.handle("acct", "k", "POST", "/", {}, b"", lambda b: (200, {}, b""))
    from idemctl.errors import DatabaseLockedError

    real_run = ledger.store.run

    def locked(op):
        # The sweep's first statement, its probe of the oldest timestamps (a
        # Tables question before it is the schema's, not the sweep's own).
        if type(op) is Statement and op.sql in (ledger.store.sql(OLDEST), ledger.store.sql(OLDEST_WITH_FENCED)):
            raise DatabaseLockedError("database x is locked")
        return real_run(op)

    monkeypatch.setattr(ledger.store, "run", locked)
    assert ledger.after_response(answer) is None
    assert "post-response sweep failed: database x is locked" in caplog.text


def test_sweep_retention_override_must_exceed_the_pending_ttl(ledger):
    with pytest.raises(PolicyError, match="must be longer than the pending TTL"):
        ledger.operator.sweep(retention_ms=30_000)
    with pytest.raises(PolicyError, match="sweep batch must be >= 1"):
        ledger.operator.sweep(batch=0)


def test_sweep_with_shorter_retention_override(ledger, clock):
    fill(ledger, clock, 4)
    clock.advance(60_000)
    assert ledger.operator.count_expired(retention_ms=45_000) == 4
    assert ledger.operator.sweep(retention_ms=45_000, batch=100).keys_deleted == 4


def test_sweep_statements_walk_the_updated_at_index(tmp_path):
    ledger = Ledger.open(tmp_path / "plan.db")
    ledger.init()
    conn = sqlite3.connect(tmp_path / "plan.db")
    params = {"after": 0, "cutoff": 0, "limit": 20}
    plan = " | ".join(row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + SQL_SWEEP, params))
    assert "USING COVERING INDEX idx_idempotency_keys_updated_at (updated_at>? AND updated_at<?)" in plan
    assert "SCAN idempotency_keys" not in plan
    plan = " | ".join(
        row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + SQL_SWEEP_FENCED, {"cutoff": 0, "limit": 20})
    )
    assert "idx_idemctl_fenced_out_fenced_at (fenced_at<?)" in plan
    conn.close()
    ledger.close()


def test_the_post_response_sweep_rests_while_nothing_can_expire_then_drains(make_ledger, clock):
    ledger = make_ledger(policy=Policy(pending_ttl_ms=1_000, retention_ms=10_000))

    def request(key: str):
        return ledger.handle("acct", key, "POST", "/", {}, b"", lambda b: (201, {}, b""))

    first = ledger.after_response(request("k1"))
    # The oldest row was just written: nothing can expire for a whole retention.
    assert (first.deleted, first.quiet_for_ms) == (0, 10_000)
    clock.advance(9_000)
    resting = ledger.after_response(request("k2"))
    assert (resting.deleted, resting.quiet_for_ms) == (0, 0)  # no statement ran
    clock.advance(1_001)
    swept = ledger.after_response(request("k3"))
    assert (swept.keys_deleted, swept.quiet_for_ms) == (1, None)
    assert ledger.lookup("acct", "k1") is None and ledger.lookup("acct", "k2") is not None
    again = ledger.after_response(request("k4"))
    # k2 was written 1 001 ms after k1's expiry began: it expires 8 999 ms from now.
    assert (again.deleted, again.quiet_for_ms) == (0, 8_999)


def test_a_resting_post_response_sweep_runs_no_statement_at_all(tmp_path, clock):
    ledger = Ledger.open(tmp_path / "l.db", clock=clock)
    ledger.init()
    answer = ledger.handle("acct", "k", "POST", "/", {}, b"", lambda b: (201, {}, b""))
    ledger.after_response(answer)
    statements: list[str] = []
    ledger.store.engine.admin().conn.set_trace_callback(statements.append)
    ledger.after_response(ledger.handle("acct", "k2", "POST", "/", {}, b"", lambda b: (201, {}, b"")))
    # The request's own claim and completion; nothing from the sweep.
    assert [s.split()[0] for s in statements] == ["INSERT", "UPDATE"]
    ledger.close()
