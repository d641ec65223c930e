"""A small orders API behind idemctl's WSGI middleware.

Run it under gunicorn from the repository root (several pre-forked workers
share one ledger file):

    IDEMCTL_DB=idempotency.db ORDERS_DB=orders.db \\
        gunicorn -w 4 -b 127.0.0.1:8000 examples.flask_app:app

Endpoints (every one needs an `X-Api-Key` header; the stand-in auth layer maps
it to an account id, which is the ledger's principal):

    POST   /orders                    {"sku": "...", "qty": 1} -> 201 + Location
    GET    /orders                    the account's orders
    GET    /orders/<id>               one order
    DELETE /orders/<id>               cancel -> 204
    POST   /orders/<id>/attachments   any bytes -> 201, the stored bytes echoed back

A browser signs in once instead and sends its session cookie:

    POST   /session                   with `X-Api-Key`: 204 and a session cookie
    POST   /session/orders            {"sku": "...", "qty": 1} -> 201 + Location

The session lives inside Flask, where the middleware (which sees only the
WSGI environ) cannot read it, so the middleware leaves /session alone and
the one view that creates orders from a session is protected by
`idemctl.flask.idempotent` instead.

Settings, all from the environment:

    IDEMCTL_DB, IDEMCTL_PENDING_TTL, ...  the ledger and its policy (idemctl.config)
    IDEMCTL_REPLAYED_HEADER "1" adds `Idempotent-Replayed: true` to replays
    ORDERS_DB               the orders database (default orders.db)
    ORDERS_API_KEYS         "key=account,key=account" (default: two demo keys)
    ORDERS_MAX_BODY_BYTES   request body limit (default 1 MiB)
    ORDERS_SECRET_KEY       signs the session cookie (default: a demo key)
"""

from __future__ import annotations

import os
import sqlite3
import time

import sqlite_utils
from flask import Flask, Response, abort, jsonify, request, session

from idemctl.config import Settings
from idemctl.flask import idempotent
from idemctl.wsgi import DEFAULT_MAX_BODY_BYTES, IdempotencyMiddleware

DEMO_API_KEYS = "demo-key-A=acct_A,demo-key-B=acct_B"


def _api_keys(spec: str) -> dict[str, str]:
    pairs = (item.split("=", 1) for item in spec.split(",") if "=" in item)
    return {k.strip(): v.strip() for k, v in pairs if k.strip() and v.strip()}


API_KEYS = _api_keys(os.environ.get("ORDERS_API_KEYS", DEMO_API_KEYS))
ORDERS_DB = os.environ.get("ORDERS_DB", "orders.db")
MAX_BODY_BYTES = int(os.environ.get("ORDERS_MAX_BODY_BYTES", str(DEFAULT_MAX_BODY_BYTES)))
REPLAYED_HEADER = os.environ.get("IDEMCTL_REPLAYED_HEADER", "") == "1"


def account_for(environ: dict) -> str | None:
    """The stand-in auth layer: API key -> account id. A real app would look
    the key up in its own store; the middleware only needs this callable."""
    return API_KEYS.get(environ.get("HTTP_X_API_KEY", ""))


def orders_db() -> sqlite_utils.Database:
    # One connection per request: sqlite3 connections must not cross threads
    # or forks, and gunicorn may run this module under either.
    return sqlite_utils.Database(ORDERS_DB)


def _enable_wal(db: sqlite_utils.Database) -> None:
    # Switching a fresh file to WAL needs it to itself: a worker that finds
    # another one mid-switch gets "database is locked" at once, whatever the
    # busy timeout, so it waits a moment and asks again (up to 10 s).
    for _ in range(100):
        try:
            db.enable_wal()
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc):
                raise
            time.sleep(0.1)
    db.enable_wal()


def _create_tables() -> None:
    # gunicorn boots its workers at the same moment and each one imports this
    # module. On a fresh file, two first-time creators can each hold a read
    # lock while asking for the write lock; SQLite then fails one of them at
    # once ("database is locked") instead of waiting, and gunicorn halts when
    # a worker fails to boot. BEGIN IMMEDIATE asks for the write lock before
    # reading anything, so the busy timeout applies and the creators queue.
    db = orders_db()
    try:
        _enable_wal(db)
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


def _account() -> str:
    account = account_for(request.environ)
    if account is None:
        abort(Response('{"error":"unauthenticated"}', status=401, content_type="application/json"))
    return account


def _order_json(row: dict) -> dict:
    return {k: row[k] for k in ("id", "account", "sku", "qty", "status")}


_create_tables()
ledger = Settings.from_env().open_ledger()  # IDEMCTL_DB, IDEMCTL_PENDING_TTL, ...
ledger.init()

app = Flask(__name__)
app.secret_key = os.environ.get("ORDERS_SECRET_KEY", "demo-only-secret")


@app.get("/healthz")
def healthz() -> Response:
    return jsonify(ok=True, pid=os.getpid())


@app.post("/orders")
def create_order() -> Response:
    return _new_order(_account())


@app.post("/session")
def sign_in() -> Response:
    session["account"] = _account()
    return Response(status=204)


@app.post("/session/orders")
@idempotent(
    ledger,
    principal=lambda: session.get("account"),
    max_body_bytes=MAX_BODY_BYTES,
    replayed_header=REPLAYED_HEADER,
)
def create_order_in_session() -> Response:
    return _new_order(session["account"])


def _new_order(account: str) -> Response:
    payload = request.get_json(silent=True)
    if not isinstance(payload, dict) or not isinstance(payload.get("sku"), str) or not payload["sku"]:
        return jsonify(error="invalid_order", message='Send {"sku": "...", "qty": 1}.'), 422
    qty = payload.get("qty", 1)
    if isinstance(qty, bool) or not isinstance(qty, int) or qty < 1:
        return jsonify(error="invalid_order", message="qty must be a positive integer."), 422
    db = orders_db()
    try:
        now_ms = time.time_ns() // 1_000_000
        row = {"account": account, "sku": payload["sku"], "qty": qty, "status": "open", "created_at": now_ms}
        row["id"] = db["orders"].insert(row).last_pk
    finally:
        db.close()
    response = jsonify(_order_json(row))
    response.status_code = 201
    response.headers["Location"] = f"/orders/{row['id']}"
    return response


@app.get("/orders")
def list_orders() -> Response:
    account = _account()
    db = orders_db()
    try:
        rows = list(db["orders"].rows_where("account = ?", [account], order_by="id"))
    finally:
        db.close()
    return jsonify(orders=[_order_json(r) for r in rows])


def _find_order(db: sqlite_utils.Database, account: str, order_id: int) -> dict:
    rows = list(db["orders"].rows_where("id = ? AND account = ?", [order_id, account]))
    if not rows:
        abort(Response('{"error":"not_found"}', status=404, content_type="application/json"))
    return rows[0]


@app.get("/orders/<int:order_id>")
def get_order(order_id: int) -> Response:
    account = _account()
    db = orders_db()
    try:
        return jsonify(_order_json(_find_order(db, account, order_id)))
    finally:
        db.close()


@app.delete("/orders/<int:order_id>")
def cancel_order(order_id: int) -> Response:
    account = _account()
    db = orders_db()
    try:
        _find_order(db, account, order_id)
        db["orders"].update(order_id, {"status": "cancelled"})
    finally:
        db.close()
    return Response(status=204)


@app.post("/orders/<int:order_id>/attachments")
def add_attachment(order_id: int) -> Response:
    account = _account()
    data = request.get_data(cache=False)
    content_type = request.content_type or "application/octet-stream"
    db = orders_db()
    try:
        _find_order(db, account, order_id)
        pk = (
            db["attachments"]
            .insert({"order_id": order_id, "account": account, "content_type": content_type, "data": data})
            .last_pk
        )
    finally:
        db.close()
    response = Response(data, status=201, content_type=content_type)
    response.headers["Location"] = f"/orders/{order_id}/attachments/{pk}"
    return response


app.wsgi_app = IdempotencyMiddleware(  # type: ignore[method-assign]
    app.wsgi_app,
    ledger,
    principal=account_for,
    exempt=lambda environ: str(environ.get("PATH_INFO", "")).startswith("/session"),  # see the docstring
    max_body_bytes=MAX_BODY_BYTES,
    replayed_header=REPLAYED_HEADER,
)
