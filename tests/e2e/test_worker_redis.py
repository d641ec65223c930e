"""End to end: examples/worker.py consuming a real Redis stream with a
consumer group. One consumer is SIGKILLed inside the charge of a payment;
another claims the message with XAUTOCLAIM once it has been idle, takes the
ledger's reservation over, and charges it. Every payment is charged exactly
once (counted in the example's own charges database), and the ledger's
pending and fenced views tell what happened."""

from __future__ import annotations

import collections
import os
import secrets
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from idemctl import Status, wall_clock_ms
from tests.helpers import ROOT

pytestmark = pytest.mark.slow

PAYMENTS = 30
STALLED = "pay-007"
DUPLICATED = "pay-003"  # published twice by the producer
GIVE_UP_S = 90


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """The test Redis (tests/conftest.py: skips, or fails under CI, when none answers)."""
    return redis_server


@pytest.fixture
def stream(redis_url: str):
    """A stream (and its dead-letter stream) of this test's own, deleted afterwards."""
    import redis

    r = redis.Redis.from_url(redis_url, decode_responses=True)
    name = f"idemctl-test-payments-{secrets.token_hex(6)}"
    yield r, name
    r.delete(name, f"{name}:dead")
    r.close()


class Consumer:
    def __init__(self, name: str, env: dict[str, str], logs: Path, **extra: str) -> None:
        self.name = name
        self.log_path = logs / f"{name}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.redis_consumer"],
            cwd=ROOT,
            env={**env, "CONSUMER_NAME": name, **extra},
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(30)
        finally:
            self.log.close()


def charges(db: Path) -> list[tuple[str, str]]:
    if not db.exists():
        return []
    conn = sqlite3.connect(db)
    try:
        return conn.execute("SELECT payment_id, consumer FROM charges ORDER BY id").fetchall()
    except sqlite3.OperationalError:  # the first charge has not created the table yet
        return []
    finally:
        conn.close()


def wait_for(condition, what: str, *consumers: Consumer) -> None:
    deadline = time.monotonic() + GIVE_UP_S
    while not condition():
        for c in consumers:
            assert c.proc.poll() is None, f"{c.name} exited:\n{c.output()}"
        assert time.monotonic() < deadline, f"gave up waiting for {what}\n" + "\n".join(c.output() for c in consumers)
        time.sleep(0.05)


def test_a_consumer_killed_mid_charge_is_claimed_by_another_and_every_payment_is_charged_once(
    stream, redis_url, ledger_target, make_ledger, tmp_path
):
    r, name = stream
    ledger = make_ledger(clock_fn=wall_clock_ms)
    charges_db = tmp_path / "charges.db"
    mark = tmp_path / "stalled"
    env = {k: v for k, v in os.environ.items() if not k.startswith("IDEMCTL_")}
    env.update(
        IDEMCTL_DB=ledger_target,
        IDEMCTL_PENDING_TTL="500ms",
        CLAIM_IDLE="1s",
        REDIS_URL=redis_url,
        PAYMENTS_STREAM=name,
        PAYMENTS_GROUP="billing",
        CHARGES_DB=str(charges_db),
    )
    ids = [f"pay-{i:03d}" for i in range(PAYMENTS)]
    for pid in [*ids, DUPLICATED]:
        r.xadd(name, {"payment_id": pid, "account": "acct_A", "amount": "1250", "currency": "EUR"})
    last_entry = r.xrevrange(name, count=1)[0][0]

    # Consumer A charges in stream order and stops inside the charge of pay-007.
    a = Consumer("consumer-a", env, tmp_path, TEST_STALL_ON=STALLED, TEST_STALLED_MARK=str(mark))
    wait_for(mark.exists, "consumer-a to stall", a)
    assert [p for p, _ in charges(charges_db)] == ids[:7]
    # The ledger's view at this moment: one reservation in progress, of the stalled charge.
    assert [(v.row.key, v.row.generation, v.row.status) for v in ledger.operator.pending()] == [
        (STALLED, 1, Status.PENDING)
    ]
    assert a.stop(signal.SIGKILL) == -signal.SIGKILL

    # Two more consumers: they read the rest, and claim what A had read but never acknowledged.
    b = Consumer("consumer-b", env, tmp_path)
    c = Consumer("consumer-c", env, tmp_path)

    def all_handled() -> bool:
        group = r.xinfo_groups(name)[0]
        return group["last-delivered-id"] == last_entry and group["pending"] == 0

    wait_for(all_handled, "every message to be acknowledged", b, c)
    assert (b.stop(), c.stop()) == (0, 0)

    # Every payment charged exactly once, the stalled one by a consumer that claimed it.
    done = charges(charges_db)
    assert collections.Counter(p for p, _ in done) == {pid: 1 for pid in ids}
    assert dict(done)[STALLED] in ("consumer-b", "consumer-c")
    # The ledger tells the story: pay-007's reservation was taken over once,
    # nothing is left in progress, and no late completion was fenced out
    # (the killed consumer never came back).
    rows = {pid: ledger.lookup("billing", pid) for pid in ids}
    assert {pid: (row.status, row.generation) for pid, row in rows.items()} == {
        pid: (Status.COMPLETED, 2 if pid == STALLED else 1) for pid in ids
    }
    assert ledger.operator.get("billing", STALLED).takeovers == 1
    assert list(ledger.operator.pending()) == []
    assert list(ledger.operator.fenced()) == []
    stats = ledger.operator.stats()
    assert (stats.total, stats.completed, stats.taken_over, stats.fenced_out_events) == (PAYMENTS, PAYMENTS, 1, 0)
    # Redis agrees: nothing pending for anyone, nothing dead-lettered.
    assert {x["name"]: x["pending"] for x in r.xinfo_consumers(name, "billing")}.get("consumer-a") == 0
    assert r.xlen(f"{name}:dead") == 0
    logs = b.output() + c.output()
    assert "Traceback" not in logs
    assert "claimed from a consumer that stopped acknowledging it" in logs
