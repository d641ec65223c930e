"""The app bench/soak.py serves under `uvicorn --workers N`: one FastAPI
route under idemctl's route class, whose mutation writes one line per run
to a file of its worker's own ($SOAK_RUNS_DIR/runs-<pid>.log), so that the
soak counts runs per key without asking the database whose connections it
keeps ending. Each run answers a body of its own (the run's id): an answer
replayed from the ledger is byte for byte the first, a run again is not."""

from __future__ import annotations

import os
import uuid
from typing import Any

from fastapi import APIRouter, FastAPI, Header

from idemctl import Ledger, Policy
from idemctl.fastapi import idempotent_route

URL = os.environ["SOAK_URL"]
RUNS_DIR = os.environ["SOAK_RUNS_DIR"]
PENDING_TTL_MS = int(os.environ.get("SOAK_PENDING_TTL_MS", "2000"))

ledger = Ledger.open(URL, policy=Policy(pending_ttl_ms=PENDING_TTL_MS))
_runs = open(os.path.join(RUNS_DIR, f"runs-{os.getpid()}.log"), "a", buffering=1)  # noqa: SIM115 (the worker's life)


def principal(x_account: str = Header(default="")) -> str | None:
    return x_account or None


router = APIRouter(route_class=idempotent_route(ledger, principal=principal))


@router.post("/orders", status_code=201)
async def create_order(order: dict[str, Any], idempotency_key: str = Header(default="")) -> dict[str, str]:
    run = uuid.uuid4().hex
    _runs.write(f"{idempotency_key} {run}\n")
    return {"key": idempotency_key, "run": run}


app = FastAPI()
app.include_router(router)
