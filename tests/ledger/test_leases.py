"""Leases a live owner renews (Policy(lease_renewal=True)): a slow but live
mutation is never taken over, a dead owner's key is taken over about one
TTL after its last renewal, renewal stops after lease_max_ms, and a renewal
never wins over a newer owner. Real clocks and threads: renewal is a thread
of the ledger's own."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import threading
import time

import pytest

from idemctl import Outcome, Policy, Reservation, Status
from tests.helpers import ROOT, STEADY_EPOCH_MS, steady_ms

# The PostgreSQL tests run through PgBouncer (session and transaction pooling) too.
THROUGH_PGBOUNCER = True

TTL = 1000  # with renewal every third of it; margins are several ticks wide


def lease_ledger(make_ledger, **policy):  # type: ignore[no-untyped-def]
    return make_ledger(policy=Policy(pending_ttl_ms=TTL, **policy), clock_fn=steady_ms)


def slow_owner(ledger, key: str, seconds: float, runs: list[int]) -> tuple[threading.Thread, list, threading.Event]:  # type: ignore[no-untyped-def]
    answers: list = []
    started = threading.Event()

    def run(body: bytes):  # type: ignore[no-untyped-def]
        runs.append(1)
        started.set()
        time.sleep(seconds)
        return 201, {"content-type": "text/plain"}, b"made once"

    thread = threading.Thread(
        target=lambda: answers.append(ledger.handle("acct_A", key, "POST", "/orders", {}, b"{}", run))
    )
    thread.start()
    assert started.wait(10)
    return thread, answers, started


def renewals_of(ledger) -> list:  # type: ignore[no-untyped-def]
    """Every renewal (and watchdog report) of `ledger` from now on: what a
    failed timing assertion shows, so it tells a late or missed renewal from
    one that ran on time."""
    ticks: list = []
    ledger.leases.subscribe(ticks.append)
    return ticks


def duplicate(ledger, key: str, runs: list[int]):  # type: ignore[no-untyped-def]
    def run(body: bytes):  # type: ignore[no-untyped-def]
        runs.append(1)
        return 201, {}, b"made twice"

    return ledger.handle("acct_A", key, "POST", "/orders", {}, b"{}", run)


def test_a_live_mutation_three_ttls_long_is_answered_409_and_runs_once(make_ledger):
    ledger = lease_ledger(make_ledger, lease_renewal=True)
    ticks = renewals_of(ledger)
    runs: list[int] = []
    thread, answers, _ = slow_owner(ledger, "k-slow", 3.0, runs)
    claimed = time.monotonic()
    seen = []
    for at in (1.3, 2.0, 2.6):  # each past the TTL since the claim
        time.sleep(max(0.0, claimed + at - time.monotonic()))
        seen.append(duplicate(ledger, "k-slow", runs).outcome)
    thread.join(10)
    assert seen == [Outcome.IN_PROGRESS] * 3, ticks
    assert answers[0].outcome is Outcome.EXECUTED
    assert duplicate(ledger, "k-slow", runs).body == b"made once"
    assert len(runs) == 1
    assert ledger.leases is not None and ledger.leases.held() == 0


def test_without_renewal_the_same_slow_mutation_is_taken_over_and_runs_twice(make_ledger):
    ledger = lease_ledger(make_ledger)
    runs: list[int] = []
    thread, _, _ = slow_owner(ledger, "k-slow", 2.0, runs)
    time.sleep(1.3)
    assert duplicate(ledger, "k-slow", runs).outcome is Outcome.TAKEN_OVER
    thread.join(10)
    assert len(runs) == 2


def test_renewal_stops_after_lease_max_and_a_hung_mutation_is_taken_over(make_ledger):
    ledger = lease_ledger(make_ledger, lease_renewal=True, lease_max_ms=1500)
    ticks = renewals_of(ledger)
    runs: list[int] = []
    thread, _, _ = slow_owner(ledger, "k-hung", 4.0, runs)
    time.sleep(1.3)
    try:
        assert duplicate(ledger, "k-hung", runs).outcome is Outcome.IN_PROGRESS, ticks  # still renewed
        time.sleep(1.9)  # renewals stopped at 1.5 s; the row is stale one TTL after the last one
        assert duplicate(ledger, "k-hung", runs).outcome is Outcome.TAKEN_OVER, ticks
    finally:
        thread.join(10)  # before the ledger's table goes
    assert len(runs) == 2


def test_a_renewal_racing_a_takeover_never_wins_over_the_new_owner(make_ledger):
    ledger = lease_ledger(make_ledger, lease_renewal=True)
    first = ledger.claim("acct_A", "k-race", "fp")
    assert first is not None
    stop = threading.Event()
    renewed_after: list[int] = []

    def renew_forever() -> None:
        while not stop.is_set():
            renewed_after.append(
                ledger.store.renew([(first.principal, first.key, first.generation, first.token)], steady_ms())
            )

    renewer = threading.Thread(target=renew_forever)
    renewer.start()
    try:
        time.sleep(0.05)
        # Another owner takes the row over (as a retry past the TTL would).
        # Its `now` lies ahead of every renewal's, so a renewal that touched
        # the new owner's row would show in updated_at.
        now = steady_ms() + 5000
        generation = ledger.store.takeover("acct_A", "k-race", "fp", 4242, now, now + 1, now - Policy().retention_ms)
        assert generation == 2
        mark = len(renewed_after)
        time.sleep(0.2)
    finally:
        stop.set()
        renewer.join(10)
    row = ledger.lookup("acct_A", "k-race")
    assert (row.generation, row.status) == (2, Status.PENDING)
    assert row.updated_at == now  # no renewal touched the new owner's row
    assert set(renewed_after[mark + 1 :]) == {0}
    assert ledger.release(first) is False


def test_many_live_reservations_cost_one_statement_a_tick(make_ledger):
    ledger = lease_ledger(make_ledger, lease_renewal=True)
    tickets = [ledger.begin("acct_A", f"k-{i}", "POST", "/orders", {}, b"") for i in range(600)]
    calls: list[int] = []
    renew = ledger.store.renew

    def counting(held, now):  # type: ignore[no-untyped-def]
        calls.append(len(held))
        return renew(held, now)

    ledger.store.renew = counting  # type: ignore[method-assign]
    time.sleep(1.1)  # three ticks or so
    ledger.store.renew = renew  # type: ignore[method-assign]
    assert calls and set(calls) == {600}
    for ticket in tickets:
        ledger.finish(ticket, 201, {}, b"")
    assert ledger.leases.held() == 0


CHILD = f"""
import sys, time
from idemctl import Ledger, Policy
def steady_ms():  # the parent's clock (tests.helpers.steady_ms)
    return {STEADY_EPOCH_MS} + time.monotonic_ns() // 1_000_000
ledger = Ledger.open(sys.argv[1], policy=Policy(pending_ttl_ms={TTL}, lease_renewal=True), clock=steady_ms)
ticket = ledger.begin("acct_A", "k-killed", "POST", "/orders", {{}}, b"{{}}")
print(ticket.outcome.value, flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_a_killed_owner_is_taken_over_about_one_ttl_after_its_last_renewal(make_ledger, ledger_target):
    ledger = lease_ledger(make_ledger)
    child = subprocess.Popen([sys.executable, "-c", CHILD, ledger_target], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "executed"
        runs: list[int] = []
        time.sleep(1.6)  # past the TTL since the claim: only renewal keeps it
        assert duplicate(ledger, "k-killed", runs).outcome is Outcome.IN_PROGRESS
        child.kill()
        child.wait(10)
        killed = time.monotonic()
        while (answer := duplicate(ledger, "k-killed", runs)).outcome is Outcome.IN_PROGRESS:
            assert time.monotonic() - killed < 3 * TTL / 1000, "not taken over within about one TTL"
            time.sleep(0.05)
        assert answer.outcome is Outcome.TAKEN_OVER
        assert len(runs) == 1
    finally:
        child.kill()
        child.wait(10)


def test_an_idempotent_function_keeps_its_lease_while_it_runs(make_ledger):
    from idemctl import CallInProgressError

    ledger = lease_ledger(make_ledger, lease_renewal=True)
    runs: list[int] = []

    @ledger.idempotent(key=lambda order: order, principal="billing")
    def charge(order: str) -> str:
        runs.append(1)
        time.sleep(2.0)
        return "charged"

    worker = threading.Thread(target=charge, args=("o-1",))
    worker.start()
    time.sleep(1.4)
    try:
        with pytest.raises(CallInProgressError):
            charge("o-1")
    finally:
        worker.join(10)
    assert charge("o-1") == "charged"
    assert len(runs) == 1


def test_renewal_works_under_sqlite_group_commit(tmp_path):
    from idemctl import Ledger

    ledger = Ledger.open(
        tmp_path / "group.db",
        policy=Policy(pending_ttl_ms=TTL, lease_renewal=True),
        clock=steady_ms,
        group_commit=True,
    )
    ledger.init()
    try:
        runs: list[int] = []
        thread, answers, _ = slow_owner(ledger, "k-group", 2.0, runs)
        time.sleep(1.4)
        assert duplicate(ledger, "k-group", runs).outcome is Outcome.IN_PROGRESS
        thread.join(10)
        assert (answers[0].outcome, len(runs)) == (Outcome.EXECUTED, 1)
    finally:
        ledger.close()


def test_inspect_shows_when_a_reservation_was_claimed_and_last_renewed(
    make_ledger, ledger_target, monkeypatch, tmp_path
):
    from typer.testing import CliRunner

    from idemctl.cli import app
    from tests.helpers import clean_env

    clean_env(monkeypatch, tmp_path, columns="200")
    ledger = lease_ledger(make_ledger, lease_renewal=True)
    ticket = ledger.begin("acct_A", "k-shown", "POST", "/orders", {}, b"{}")
    time.sleep(1.2)  # a few renewals
    result = CliRunner().invoke(app, ["--db", ledger_target, "inspect", "k-shown", "--principal", "acct_A"])
    ledger.finish(ticket, 201, {}, b"")
    assert result.exit_code == 0, result.output
    assert re.search(r"pending, claimed [1-9]\d* s ago, lease last renewed \d+ (ms|s) ago", result.stdout), (
        result.stdout
    )


# -- a renewal that runs late is seen long before the TTL passes ---------------------------------


def _reservation(key: str) -> Reservation:
    return Reservation("acct_A", key, 1, "fp", 42)


def test_a_stuck_renewal_is_reported_while_it_runs_well_before_the_ttl_then_at_the_ttl_then_when_it_lands(caplog):
    from idemctl.leases import LeaseKeeper, LeaseTick

    ttl_s = 1.5
    release = threading.Event()
    calls: list[int] = []

    def stuck_renew(held: list[Reservation]) -> int:  # a statement waiting on a lock
        calls.append(len(held))
        release.wait(10)
        return len(held)

    keeper = LeaseKeeper(stuck_renew, interval_s=ttl_s / 3, max_s=60, ttl_s=ttl_s)
    ticks: list[tuple[float, LeaseTick]] = []
    keeper.subscribe(lambda tick: ticks.append((time.monotonic(), tick)))
    try:
        with caplog.at_level(logging.WARNING, logger="idemctl"):
            held_at = time.monotonic()
            keeper.hold(_reservation("k-stuck"))
            while len(ticks) < 2 and time.monotonic() - held_at < 10:
                time.sleep(0.02)
            release.set()
            while len(ticks) < 3 and time.monotonic() - held_at < 10:
                time.sleep(0.02)
    finally:
        release.set()
        keeper.close()
    assert calls and calls[0] == 1
    (first_at, first), (_, second), (_, landed) = ticks[:3]
    # While the renewal still runs, past half the TTL: reported before the TTL is out.
    assert (first.done, first.late, first.expired, first.renewed, first.reservations) == (False, True, False, None, 1)
    assert first_at - held_at < ttl_s, "the late renewal was not seen before the TTL passed"
    assert ttl_s * 500 < first.lapse_ms < ttl_s * 1000 and first.seconds > 0
    # Then once the TTL itself has passed: a retry may take it over now.
    assert (second.done, second.expired, second.renewed) == (False, True, None)
    # And when it lands: late, and how late.
    assert (landed.done, landed.late, landed.renewed, landed.error) == (True, True, 1, None)
    assert landed.lapse_ms >= ttl_s * 1000
    # (The renewal right after it may be late too: the rows aged while it ran.)
    assert keeper.late_ticks >= 3
    records = [(r.levelname, r.getMessage()) for r in caplog.records if "lease renewal" in r.getMessage()]
    assert [level for level, _ in records[:3]] == ["WARNING", "ERROR", "ERROR"]
    assert re.fullmatch(
        r"lease renewal is late: 1 reservation\(s\) have gone \d+ ms without renewal \(TTL 1500 ms, due every 500 ms\);"
        r" the renewal in progress has run \d+ ms",
        records[0][1],
    ), records[0][1]
    assert records[1][1].endswith(": a retry may take them over now")
    assert re.fullmatch(
        r"lease renewal ran late: 1 reservation\(s\) went \d+ ms without renewal \(TTL 1500 ms, due every 500 ms\);"
        r" the renewal took \d+ ms",
        records[2][1],
    ), records[2][1]


def test_renewals_on_time_report_every_tick_and_nothing_late(make_ledger):
    ledger = lease_ledger(make_ledger, lease_renewal=True)
    assert ledger.leases is not None
    ticks = renewals_of(ledger)
    ticket = ledger.begin("acct_A", "k-ticks", "POST", "/orders", {}, b"")
    time.sleep(1.2)  # three ticks or so
    ledger.finish(ticket, 201, {}, b"")
    assert ticks and all(t.done and t.error is None and t.renewed == t.reservations == 1 for t in ticks)
    assert all(not t.late for t in ticks) and ledger.leases.late_ticks == 0


@pytest.mark.engines("sqlite")  # the renewal itself is replaced: the engine plays no part
def test_failing_renewals_are_reported_as_late_before_the_ttl_passes(make_ledger, caplog):
    from idemctl.errors import DatabaseLockedError

    ledger = lease_ledger(make_ledger, lease_renewal=True)
    assert ledger.leases is not None
    ticks = renewals_of(ledger)

    def locked(held, now):  # type: ignore[no-untyped-def]
        raise DatabaseLockedError("the ledger is locked")

    ledger.store.renew = locked  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="idemctl"):
        claimed = time.monotonic()
        ticket = ledger.begin("acct_A", "k-failing", "POST", "/orders", {}, b"")
        while not any(t.late for t in ticks) and time.monotonic() - claimed < 10:
            time.sleep(0.02)
        seen_at = time.monotonic()
    ledger.abandon(ticket, release=True)
    failed = [t for t in ticks if t.done]
    assert failed and all((t.renewed, t.error) == (None, "the ledger is locked") for t in failed)
    late = next(t for t in ticks if t.late)
    assert (late.done, late.error) == (False, "the ledger is locked")
    assert seen_at - claimed < TTL / 1000
    assert any(
        m.startswith("lease renewal is late: 1 reservation(s) have gone")
        and m.endswith("the last renewal failed: the ledger is locked")
        for m in caplog.messages
    ), caplog.messages


def test_prometheus_counts_lease_renewals_lapses_and_late_ones(make_ledger):
    from prometheus_client import CollectorRegistry

    from idemctl.prometheus import instrument

    ledger = lease_ledger(make_ledger, lease_renewal=True)
    registry = CollectorRegistry()
    metrics = instrument(ledger, registry=registry)
    assert metrics.leases is not None
    renew = ledger.store.renew
    slow = threading.Event()

    def sometimes_slow(held, now):  # type: ignore[no-untyped-def]
        if slow.is_set():
            slow.clear()
            time.sleep(0.7)  # past half the 1 s TTL
        return renew(held, now)

    ledger.store.renew = sometimes_slow  # type: ignore[method-assign]
    ticket = ledger.begin("acct_A", "k-metrics", "POST", "/orders", {}, b"")
    time.sleep(0.8)
    slow.set()
    time.sleep(1.6)
    held = registry.get_sample_value("idemctl_leases_held")
    ledger.finish(ticket, 201, {}, b"")
    value = registry.get_sample_value
    renewals = value("idemctl_lease_renewal_seconds_count")
    assert renewals is not None and renewals >= 3
    assert value("idemctl_lease_lapse_seconds_count") == renewals
    # The slow renewal was seen while it ran and when it landed (and the one
    # right after it may count too: the rows aged while the slow one ran).
    assert (value("idemctl_lease_late_total", {"stage": "done"}) or 0) >= 1
    assert (value("idemctl_lease_late_total", {"stage": "running"}) or 0) >= 1
    assert value("idemctl_lease_failures_total") == 0
    assert held == 1
    on_time = value("idemctl_lease_lapse_seconds_bucket", {"le": "0.5"})
    assert on_time is not None and 1 <= on_time < renewals
    assert value("idemctl_lease_lapse_seconds_bucket", {"le": "+Inf"}) == renewals
