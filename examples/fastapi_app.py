"""A small orders API on FastAPI, every POST and DELETE under idemctl.

The principal comes from FastAPI's own auth dependency (`current_account`),
so the routes use idemctl's route class rather than ASGI middleware (which
runs before routing and cannot see dependencies). Run it under uvicorn from
the repository root; several workers share one ledger:

    pip install -e '.[asgi]'
    IDEMCTL_DB=idempotency.db ORDERS_DB=orders.db \\
        uvicorn examples.fastapi_app:app --workers 4 --port 8000

    curl -s -X POST localhost:8000/orders -H 'X-Api-Key: demo-key-A' \\
        -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' -d '{"sku":"tea","qty":2}'

`IDEMCTL_DB=postgresql://...` puts the ledger on PostgreSQL (`pip install
-e '.[asgi,postgres]'`). Endpoints (each needs `X-Api-Key`):

    POST   /orders                    {"sku": "...", "qty": 1} -> 201 + Location
    GET    /orders                    the account's orders
    GET    /orders/{id}               one order
    DELETE /orders/{id}               cancel -> 204
    POST   /orders/{id}/attachments   any bytes -> 201, the stored bytes echoed back

Settings come from the environment: IDEMCTL_DB, IDEMCTL_PENDING_TTL and the
rest of idemctl.config; ORDERS_DB (default orders.db) and ORDERS_API_KEYS
("key=account,key=account"; default two demo keys).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import sqlite_utils
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Request, Response
from pydantic import BaseModel, Field

from idemctl.config import Settings
from idemctl.fastapi import idempotent_route

DEMO_API_KEYS = "demo-key-A=acct_A,demo-key-B=acct_B"
_PAIRS = (item.split("=", 1) for item in os.environ.get("ORDERS_API_KEYS", DEMO_API_KEYS).split(",") if "=" in item)
API_KEYS = {k.strip(): v.strip() for k, v in _PAIRS}
ORDERS_DB = os.environ.get("ORDERS_DB", "orders.db")

# One ledger per process: uvicorn's workers each import this module.
settings = Settings.from_env()
ledger = settings.open_ledger()


def api_account(x_api_key: str = Header(default="")) -> str | None:
    """The stand-in auth layer: API key -> account id, None when unknown. A
    real app would look the key up in its own store (or decode a token).
    On protected routes idemctl answers 401 for None before the endpoint runs."""
    return API_KEYS.get(x_api_key)


def current_account(account: str | None = Depends(api_account)) -> str:
    """For the routes idemctl does not protect (reads)."""
    if account is None:
        raise HTTPException(status_code=401, detail="unknown API key")
    return account


def _known(account: str | None) -> str:
    # Only reached on protected routes, where idemctl already refused None with 401.
    if account is None:
        raise HTTPException(status_code=401, detail="unknown API key")
    return account


def orders_db() -> sqlite_utils.Database:
    return sqlite_utils.Database(ORDERS_DB)


def _create_tables() -> None:
    # Workers start at the same moment: BEGIN IMMEDIATE makes the creators
    # queue on the write lock instead of failing each other.
    db = orders_db()
    try:
        db.enable_wal()
        with db.conn:
            db.execute("BEGIN IMMEDIATE")
            db["orders"].create(
                {"id": int, "account": str, "sku": str, "qty": int, "status": str, "created_at": int},
                pk="id",
                if_not_exists=True,
            )
            db["attachments"].create(
                {"id": int, "order_id": int, "account": str, "content_type": str, "data": bytes},
                pk="id",
                if_not_exists=True,
            )
    finally:
        db.close()


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    ledger.init()  # idempotent: safe from every worker at once
    _create_tables()
    yield
    ledger.close()


class Order(BaseModel):
    sku: str = Field(min_length=1)
    qty: int = Field(ge=1)


def insert_order(account: str, order: Order) -> dict[str, object]:
    db = orders_db()
    try:
        now = int(time.time())
        row = {"account": account, "sku": order.sku, "qty": order.qty, "status": "placed", "created_at": now}
        row["id"] = db["orders"].insert(row).last_pk
        return row
    finally:
        db.close()


def _order_or_404(db: sqlite_utils.Database, account: str, order_id: int) -> dict[str, object]:
    rows = list(db["orders"].rows_where("id = ? AND account = ?", [order_id, account]))
    if not rows:
        raise HTTPException(status_code=404, detail="no such order")
    return rows[0]


# Every route of this router is under the Idempotency-Key contract; its
# principal is the same dependency the endpoints use.
protected = APIRouter(route_class=idempotent_route(ledger, principal=api_account))


@protected.post("/orders", status_code=201)
def create_order(order: Order, response: Response, account: str | None = Depends(api_account)) -> dict[str, object]:
    row = insert_order(_known(account), order)
    response.headers["Location"] = f"/orders/{row['id']}"
    return row


@protected.delete("/orders/{order_id}", status_code=204)
def cancel_order(order_id: int, account: str | None = Depends(api_account)) -> Response:
    db = orders_db()
    try:
        _order_or_404(db, _known(account), order_id)
        db["orders"].update(order_id, {"status": "cancelled"})
    finally:
        db.close()
    return Response(status_code=204)


@protected.post("/orders/{order_id}/attachments", status_code=201)
async def attach(order_id: int, request: Request, account: str | None = Depends(api_account)) -> Response:
    data = await request.body()
    content_type = request.headers.get("content-type", "application/octet-stream")
    owner = _known(account)
    db = orders_db()
    try:
        _order_or_404(db, owner, order_id)
        db["attachments"].insert({"order_id": order_id, "account": owner, "content_type": content_type, "data": data})
    finally:
        db.close()
    return Response(content=data, status_code=201, media_type=content_type)


reads = APIRouter()


@reads.get("/orders")
def list_orders(account: str = Depends(current_account)) -> list[dict[str, object]]:
    db = orders_db()
    try:
        return list(db["orders"].rows_where("account = ?", [account], order_by="id"))
    finally:
        db.close()


@reads.get("/orders/{order_id}")
def get_order(order_id: int, account: str = Depends(current_account)) -> dict[str, object]:
    db = orders_db()
    try:
        return _order_or_404(db, account, order_id)
    finally:
        db.close()


app = FastAPI(title="orders", lifespan=lifespan)
app.include_router(protected)
app.include_router(reads)
