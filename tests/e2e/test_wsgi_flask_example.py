"""examples/flask_app.py in process: Flask behind the middleware, with
wsgiref.validate on both sides (server -> middleware, middleware -> Flask)."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import sqlite3
import subprocess
import sys
import time
from http import HTTPStatus
from pathlib import Path
from wsgiref.util import setup_testing_defaults
from wsgiref.validate import validator

import pytest

from idemctl.wsgi import IdempotencyMiddleware
from tests.helpers import ROOT

pytestmark = pytest.mark.filterwarnings("error::wsgiref.validate.WSGIWarning")

EXAMPLE = ROOT / "examples" / "flask_app.py"


@pytest.fixture
def example(tmp_path, monkeypatch):
    monkeypatch.setenv("IDEMCTL_DB", str(tmp_path / "idempotency.db"))
    monkeypatch.setenv("ORDERS_DB", str(tmp_path / "orders.db"))
    monkeypatch.setenv("IDEMCTL_PENDING_TTL", "5s")
    spec = importlib.util.spec_from_file_location("flask_app_under_test", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    middleware = module.app.wsgi_app
    assert isinstance(middleware, IdempotencyMiddleware)
    module.unvalidated_flask = middleware.app
    middleware.app = validator(middleware.app)  # Flask as the middleware sees it
    yield module
    module.ledger.close()


def request(app, method, path, body=b"", *, key=None, api_key="demo-key-A", content_type="application/json"):
    env: dict = {}
    setup_testing_defaults(env)
    env.update(REQUEST_METHOD=method, PATH_INFO=path, QUERY_STRING="", CONTENT_LENGTH=str(len(body)))
    env["wsgi.input"] = io.BytesIO(body)
    if content_type:
        env["CONTENT_TYPE"] = content_type
    if key is not None:
        env["HTTP_IDEMPOTENCY_KEY"] = key
    if api_key is not None:
        env["HTTP_X_API_KEY"] = api_key
    seen: dict = {}

    def start_response(status, headers, exc_info=None):
        seen.update(status=status, headers=list(headers))
        return lambda data: None

    result = validator(app)(env, start_response)
    try:
        payload = b"".join(result)
    finally:
        result.close()
    return seen["status"], seen["headers"], payload


def count(path: Path, table: str) -> int:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    finally:
        conn.close()


def test_an_order_is_created_once_and_the_retry_replays_it(example, tmp_path):
    body = b'{"sku":"tea","qty":2}'
    first = request(example.app, "POST", "/orders", body, key="order-42")
    retry = request(example.app, "POST", "/orders", body, key="order-42")
    expected = b'{"account":"acct_A","id":1,"qty":2,"sku":"tea","status":"open"}\n'
    assert first == (
        "201 Created",
        [("content-type", "application/json"), ("location", "/orders/1"), ("content-length", str(len(expected)))],
        expected,
    )
    assert retry == first
    assert count(tmp_path / "orders.db", "orders") == 1


def test_an_unknown_api_key_is_refused_before_flask_runs(example, tmp_path):
    status, _, body = request(example.app, "POST", "/orders", b'{"sku":"tea"}', key="k", api_key="stolen")
    assert (status, json.loads(body)["error"]) == ("401 Unauthorized", "unauthenticated")
    assert count(tmp_path / "orders.db", "orders") == 0


def test_a_cancel_is_a_bodiless_204_without_flasks_default_content_type(example):
    # Flask puts a Content-Type on its 204, which the inner validator would
    # reject; the middleware drops it, and the outer validator checks that.
    example.app.wsgi_app.app = example.unvalidated_flask
    request(example.app, "POST", "/orders", b'{"sku":"tea"}', key="create")
    first = request(example.app, "DELETE", "/orders/1", key="cancel", content_type=None)
    assert first == ("204 No Content", [], b"")
    assert request(example.app, "DELETE", "/orders/1", key="cancel", content_type=None) == first
    status, _, body = request(example.app, "GET", "/orders/1")
    assert (status, json.loads(body)["status"]) == ("200 OK", "cancelled")


def test_a_binary_attachment_round_trips_and_is_stored_once(example, tmp_path):
    request(example.app, "POST", "/orders", b'{"sku":"tea"}', key="create")
    blob = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) + b"\xff"
    first = request(example.app, "POST", "/orders/1/attachments", blob, key="att", content_type="image/png")
    retry = request(example.app, "POST", "/orders/1/attachments", blob, key="att", content_type="image/png")
    assert first[0] == "201 Created" and first[2] == blob and retry == first
    assert ("content-type", "image/png") in first[1]
    assert count(tmp_path / "orders.db", "attachments") == 1


def test_an_invalid_order_is_stored_and_replayed_as_422(example, tmp_path):
    first = request(example.app, "POST", "/orders", b'{"qty":1}', key="bad")
    assert first[0] == f"422 {HTTPStatus(422).phrase}"
    assert json.loads(first[2])["error"] == "invalid_order"
    assert request(example.app, "POST", "/orders", b'{"qty":1}', key="bad") == first
    assert count(tmp_path / "orders.db", "orders") == 0


_BOOT_WORKER = """
import os, runpy, sys, time
import flask, sqlite_utils, idemctl.wsgi  # the slow imports happen before the start line
go = sys.argv[2]
while not os.path.exists(go):
    time.sleep(0.001)
runpy.run_path(sys.argv[1])
"""


def test_workers_booting_at_once_on_a_fresh_orders_file_all_come_up(tmp_path):
    # gunicorn imports the app in every worker at the same moment; a worker
    # that fails to boot makes gunicorn halt the whole server.
    for attempt in range(3):
        run = tmp_path / f"boot{attempt}"
        run.mkdir()
        go = run / "go"
        env = {
            **os.environ,
            "IDEMCTL_DB": str(run / "idempotency.db"),
            "ORDERS_DB": str(run / "orders.db"),
        }
        workers = [
            subprocess.Popen(
                [sys.executable, "-c", _BOOT_WORKER, str(EXAMPLE), str(go)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            for _ in range(6)
        ]
        time.sleep(1.0)  # let every worker reach the start line
        go.touch()
        failures = [w.communicate(timeout=60)[1].decode()[-300:] for w in workers if w.wait(60) != 0]
        assert failures == []
        with sqlite3.connect(run / "orders.db") as db:
            tables = sorted(r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'"))
            assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert tables == ["attachments", "orders"]
