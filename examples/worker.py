"""A Redis Streams consumer that charges each payment once, however often
the stream delivers it.

A consumer group delivers every message at least once: a consumer that dies
between charging and XACK leaves the message pending, and another consumer
takes it over with XAUTOCLAIM and processes it again. `charge` is an
idempotent function keyed by the payment's id, so the second delivery (or a
producer that published the same payment twice) gets the stored receipt
instead of a second charge. Run any number of these, on any hosts that share
the ledger:

    pip install -e '.[worker]'
    IDEMCTL_DB=idempotency.db CHARGES_DB=charges.db python examples/worker.py

    redis-cli XADD payments '*' payment_id pay_1 account acct_A amount 1250 currency EUR

Settings come from the environment: IDEMCTL_DB, IDEMCTL_PENDING_TTL and the
rest of idemctl.config; REDIS_URL (default redis://127.0.0.1:6379/0),
PAYMENTS_STREAM (payments), PAYMENTS_GROUP (billing), CONSUMER_NAME (host and
pid), CLAIM_IDLE (how long a message sits unacknowledged before another
consumer claims it; default the pending TTL, and never less: a claim earlier
than that only finds the dead consumer's reservation still in progress) and
CHARGES_DB (charges.db, where the stand-in payment provider records charges).
Messages that can never succeed go to the stream PAYMENTS_STREAM:dead.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sqlite3
from collections.abc import Callable
from typing import Any

import redis

from idemctl import CallInProgressError, KeyReusedError
from idemctl.config import Settings, env_duration
from idemctl.errors import ResultNotStoredError, UnserializableArgumentsError

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
STREAM = os.environ.get("PAYMENTS_STREAM", "payments")
GROUP = os.environ.get("PAYMENTS_GROUP", "billing")
DEAD_LETTERS = f"{STREAM}:dead"
CONSUMER = os.environ.get("CONSUMER_NAME") or f"{socket.gethostname()}-{os.getpid()}"
CHARGES_DB = os.environ.get("CHARGES_DB", "charges.db")
BATCH = 10

log = logging.getLogger("worker")

# One ledger per process, shared with the HTTP side if there is one.
ledger = Settings.from_env().open_ledger()
CLAIM_IDLE_MS = max(env_duration(os.environ, "CLAIM_IDLE") or 0, ledger.policy.pending_ttl_ms)


def charge_card(payment: dict[str, str]) -> dict[str, Any]:
    """The side effect: stands in for the payment provider's API (a real one
    would also get payment_id as its own idempotency key)."""
    db = sqlite3.connect(CHARGES_DB, timeout=30, isolation_level=None)
    try:
        db.execute(
            "CREATE TABLE IF NOT EXISTS charges (id INTEGER PRIMARY KEY, payment_id TEXT NOT NULL,"
            " account TEXT NOT NULL, amount INTEGER NOT NULL, currency TEXT NOT NULL, consumer TEXT NOT NULL)"
        )
        cursor = db.execute(
            "INSERT INTO charges (payment_id, account, amount, currency, consumer) VALUES (?, ?, ?, ?, ?)",
            (payment["payment_id"], payment["account"], int(payment["amount"]), payment["currency"], CONSUMER),
        )
    finally:
        db.close()
    return {"charge_id": cursor.lastrowid, "amount": int(payment["amount"]), "currency": payment["currency"]}


@ledger.idempotent(
    key=lambda payment: payment["payment_id"],
    principal="billing",
    # What the payment means; fields a producer adds in transit (a trace id,
    # a timestamp) must not turn a redelivery into a "reused key" error.
    args=lambda payment: {f: payment[f] for f in ("account", "amount", "currency")},
)
def charge(payment: dict[str, str]) -> dict[str, Any]:
    return charge_card(payment)


def process(r: redis.Redis, entry_id: str, fields: dict[str, str] | None) -> None:
    if not fields:  # deleted from the stream while it was pending
        r.xack(STREAM, GROUP, entry_id)
        return
    try:
        receipt = charge(fields)
    except CallInProgressError as busy:
        # Another consumer is charging it right now, or one died doing so less
        # than a TTL ago: leave it unacknowledged; XAUTOCLAIM brings it back.
        log.info("%s payment_id=%s in progress elsewhere; retry in %.1fs", entry_id, busy.key, busy.retry_after)
        return
    except (KeyReusedError, ResultNotStoredError, UnserializableArgumentsError, KeyError, ValueError) as exc:
        # Retrying can never help: park it for a human and move on.
        log.error("%s dead-lettered: %s", entry_id, exc)
        r.xadd(DEAD_LETTERS, {**fields, "entry_id": entry_id, "error": str(exc)})
        r.xack(STREAM, GROUP, entry_id)
        return
    except Exception:
        # The provider failed: the reservation stays pending and the message
        # unacknowledged; after CLAIM_IDLE a consumer takes both over and retries.
        log.exception("%s payment_id=%s failed; it will be retried", entry_id, fields.get("payment_id"))
        return
    # Acknowledge only after the receipt is stored in the ledger: a crash
    # before this line means a redelivery, which replays the receipt.
    r.xack(STREAM, GROUP, entry_id)
    log.info("%s payment_id=%s done: %s", entry_id, fields["payment_id"], receipt)


def run(r: redis.Redis, should_stop: Callable[[], bool] = lambda: False) -> None:
    try:
        r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
    cursor = "0-0"
    while not should_stop():
        # Messages of consumers that stopped acknowledging (dead, or stuck
        # longer than CLAIM_IDLE): this consumer takes them over.
        claimed = r.xautoclaim(STREAM, GROUP, CONSUMER, min_idle_time=CLAIM_IDLE_MS, start_id=cursor, count=BATCH)
        cursor = claimed[0]
        for entry_id, fields in claimed[1]:
            log.warning("%s claimed from a consumer that stopped acknowledging it", entry_id)
            process(r, entry_id, fields)
        # Then new messages.
        for _stream, entries in r.xreadgroup(GROUP, CONSUMER, {STREAM: ">"}, count=BATCH, block=1000) or []:
            for entry_id, fields in entries:
                process(r, entry_id, fields)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {CONSUMER} %(levelname)s %(message)s")
    ledger.init()  # creates or upgrades the schema; safe in every process
    stopping: list[int] = []

    def stop(signum: int, frame: object) -> None:
        stopping.append(signum)  # finish the message in hand, then leave

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    r = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    log.info("consuming %s as %s in group %s; claiming messages idle for %d ms", STREAM, CONSUMER, GROUP, CLAIM_IDLE_MS)
    run(r, lambda: bool(stopping))
    ledger.close()


if __name__ == "__main__":
    main()
