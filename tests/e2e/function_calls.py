"""An idempotent function run by real processes, for the process tests of
`Ledger.idempotent`. Every run of the function appends one line
"<order id> <pid>" to an effects file (O_APPEND: one write per line, so lines
from racing processes never interleave), which is how the tests count runs.

    python -m tests.e2e.function_calls race  LEDGER EFFECTS GO_FILE SEED ID...
    python -m tests.e2e.function_calls stall LEDGER EFFECTS MARK_FILE ORDER_JSON
    python -m tests.e2e.function_calls call  LEDGER EFFECTS ORDER_JSON

race: create GO_FILE.<SEED>.ready, wait for GO_FILE, then fulfil every order id once in a shuffled order,
retrying in-progress ones; print {"by": {id: pid of the run whose value was
returned}, "in_progress": n}.
stall: fulfil one order, but inside the function create MARK_FILE and hang
before the effect (the test SIGKILLs the process there).
call: fulfil one order, retrying while it is in progress (a stalled owner is
taken over after the TTL); print {"value": ..., "in_progress": n}.

IDEMCTL_PENDING_TTL sets the pending TTL (idemctl.config).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from idemctl import CallInProgressError, Ledger
from idemctl.config import Settings

GIVE_UP_S = 120.0


def make_fulfil(ledger: Ledger, effects: str, stall_mark: str | None = None) -> Callable[[dict[str, Any]], Any]:
    @ledger.idempotent(key=lambda order: order["id"], principal="fulfilment")
    def fulfil(order: dict[str, Any]) -> dict[str, Any]:
        if stall_mark is not None:
            Path(stall_mark).write_text(str(os.getpid()))
            time.sleep(3600)
        fd = os.open(effects, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{order['id']} {os.getpid()}\n".encode())
        finally:
            os.close(fd)
        return {"id": order["id"], "by": os.getpid()}

    return fulfil


def until_done(fulfil: Callable[[dict[str, Any]], Any], order: dict[str, Any]) -> tuple[Any, int]:
    """Call until the call is not in progress: (value, how many in-progress answers)."""
    busy = 0
    deadline = time.monotonic() + GIVE_UP_S
    while True:
        try:
            return fulfil(order), busy
        except CallInProgressError as exc:
            busy += 1
            if time.monotonic() > deadline:
                raise
            time.sleep(min(exc.retry_after, 0.05))


def open_ledger(target: str) -> Ledger:
    return Ledger.open(target, policy=Settings.from_env().policy(), synchronous="NORMAL")


def main(argv: list[str]) -> int:
    command, target, effects, *rest = argv
    ledger = open_ledger(target)
    if command == "race":
        go, seed, *ids = rest
        fulfil = make_fulfil(ledger, effects)
        random.Random(int(seed)).shuffle(ids)
        Path(f"{go}.{seed}.ready").touch()
        while not os.path.exists(go):
            time.sleep(0.005)
        by: dict[str, int] = {}
        in_progress = 0
        for order_id in ids:
            value, busy = until_done(fulfil, {"id": order_id, "sku": "tea", "qty": 2})
            by[order_id] = value["by"]
            in_progress += busy
        print(json.dumps({"by": by, "in_progress": in_progress}))
    elif command == "stall":
        mark, order = rest
        make_fulfil(ledger, effects, stall_mark=mark)(json.loads(order))
    elif command == "call":
        (order,) = rest
        value, busy = until_done(make_fulfil(ledger, effects), json.loads(order))
        print(json.dumps({"value": value, "in_progress": busy}))
    else:
        print(f"unknown command {command!r}", file=sys.stderr)
        return 2
    ledger.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
