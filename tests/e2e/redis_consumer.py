"""examples/worker.py as the Redis end-to-end test runs it, plus the test
scaffolding the example itself must not carry: when TEST_STALL_ON names a
payment_id, the charge of that payment stops inside the idempotent function,
before the payment provider is called, writes its pid to TEST_STALLED_MARK,
and hangs until the test SIGKILLs the process.

    python -m tests.e2e.redis_consumer
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import examples.worker as example

STALL_ON = os.environ.get("TEST_STALL_ON")
STALLED_MARK = os.environ.get("TEST_STALLED_MARK")
_charge_card = example.charge_card


def charge_card(payment: dict[str, str]) -> dict[str, Any]:
    if STALL_ON is not None and STALLED_MARK and payment["payment_id"] == STALL_ON:
        Path(STALLED_MARK).write_text(str(os.getpid()))
        time.sleep(3600)
    return _charge_card(payment)


example.charge_card = charge_card

if __name__ == "__main__":
    example.main()
