"""examples/fastapi_app.py as the uvicorn end-to-end tests serve it, plus
the test scaffolding the example itself must not carry:

- a hold: when the file $TEST_HOLD_DIR/<Idempotency-Key> exists, the next
  attempt with that key stops inside the mutation (before the order is
  written), renames the file to <key>.<pid>.held so the test learns the
  worker, and waits until the test deletes it (or kills the worker);
- a streaming endpoint, to show that a streamed answer is stored whole and
  replayed byte for byte.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import StreamingResponse

import examples.fastapi_app as example
from idemctl.fastapi import idempotent_route
from tests.e2e.server import hold_here

HOLD_DIR = os.environ.get("TEST_HOLD_DIR") or None
_key: contextvars.ContextVar[str] = contextvars.ContextVar("idempotency_key", default="")
_insert_order = example.insert_order


def held_insert_order(account: str, order: example.Order) -> dict[str, object]:
    hold_here(HOLD_DIR, _key.get())
    return _insert_order(account, order)


example.insert_order = held_insert_order  # the endpoint looks it up at call time

stream = APIRouter(route_class=idempotent_route(example.ledger, principal=example.api_account))


@stream.post("/stream")
async def streamed(account: str | None = Depends(example.api_account)) -> StreamingResponse:
    async def pieces() -> AsyncIterator[bytes]:
        for i in range(5):
            yield bytes([i, 0xFF, 0x00]) * 100

    return StreamingResponse(pieces(), status_code=201, media_type="application/octet-stream")


example.app.include_router(stream)


class _RememberKey:
    """Puts the request's Idempotency-Key where the hold can read it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") == "http":
            for name, value in scope.get("headers", ()):
                if name == b"idempotency-key":
                    _key.set(value.decode("latin-1"))
        await self.app(scope, receive, send)


app = _RememberKey(example.app)
