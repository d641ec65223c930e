"""idemctl.flask.idempotent: one Flask view whose principal comes from inside
Flask (Flask-Login's current_user, the session), with the WSGI middleware's
answers; and the example's session view that uses it."""

from __future__ import annotations

import importlib.util
import io
import json
import re
import sqlite3
from pathlib import Path
from typing import Any

import flask
import pytest
from flask_login import LoginManager, UserMixin, current_user, login_user
from werkzeug.test import Client

from idemctl import Ledger
from idemctl.flask import idempotent
from idemctl.wsgi import PRINCIPAL_ENVIRON_KEY, IdempotencyMiddleware
from tests.helpers import ROOT

ORDER = b'{"sku":"tea","qty":2}'
UNAUTHENTICATED = b'{"error":"unauthenticated","message":"No authenticated principal for this request."}'
EXAMPLE = ROOT / "examples" / "flask_app.py"


@pytest.fixture
def ledger(tmp_path, clock):
    with Ledger.open(tmp_path / "ledger.db", clock=clock) as opened:
        opened.init()
        yield opened


class User(UserMixin):  # type: ignore[misc]
    def __init__(self, name: str) -> None:
        self.id = name


def login_app(ledger: Ledger, runs: list[str | None]) -> flask.Flask:
    """An app with Flask-Login session auth and one protected view."""
    app = flask.Flask(__name__)
    app.secret_key = "tests"
    app.testing = True
    logins = LoginManager(app)
    logins.user_loader(User)

    @app.post("/login/<name>")
    def login(name: str) -> flask.Response:
        login_user(User(name))
        return flask.Response(status=204)

    @app.route("/orders", methods=["GET", "POST"])
    @idempotent(ledger, principal=lambda: current_user.get_id() if current_user.is_authenticated else None)
    def orders() -> Any:
        runs.append(flask.request.environ.get(PRINCIPAL_ENVIRON_KEY))
        if flask.request.method == "GET":
            return {"orders": len(runs)}
        return {"id": len(runs), "by": current_user.get_id()}, 201, {"Location": f"/orders/{len(runs)}"}

    return app


def post(client: Client, path: str = "/orders", body: bytes = ORDER, key: str | None = "k-1", **headers: str) -> Any:
    sent = {"Content-Type": "application/json", **headers}
    if key is not None:
        sent["Idempotency-Key"] = key
    return client.post(path, data=body, headers=sent)


def test_flask_logins_current_user_is_the_principal_and_two_users_never_meet(ledger):
    runs: list[str | None] = []
    app = login_app(ledger, runs)
    alice, bob = Client(app), Client(app)
    alice.post("/login/alice")
    bob.post("/login/bob")
    a, b = post(alice, key="same"), post(bob, key="same")
    a_again, b_again = post(alice, key="same"), post(bob, key="same")
    assert (a.status_code, a.get_json(), a.headers["Location"]) == (201, {"id": 1, "by": "alice"}, "/orders/1")
    assert (b.status_code, b.get_json(), b.headers["Location"]) == (201, {"id": 2, "by": "bob"}, "/orders/2")
    assert (a_again.get_data(), b_again.get_data()) == (a.get_data(), b.get_data())
    assert runs == ["alice", "bob"]
    assert ledger.lookup("alice", "same").body_bytes == a.get_data()


def test_an_anonymous_caller_gets_the_contracts_401_and_the_view_never_runs(ledger):
    runs: list[str | None] = []
    reply = post(Client(login_app(ledger, runs)))
    assert (reply.status_code, reply.headers["Content-Type"], reply.get_data()) == (
        401,
        "application/json",
        UNAUTHENTICATED,
    )
    assert runs == [] and ledger.operator.stats().total == 0


def test_safe_methods_reach_the_view_untouched(ledger):
    runs: list[str | None] = []
    client = Client(login_app(ledger, runs))
    assert client.get("/orders").get_json() == {"orders": 1}
    assert client.get("/orders").get_json() == {"orders": 2}
    assert ledger.operator.stats().total == 0


def test_what_flask_makes_of_an_abort_is_the_stored_answer(ledger):
    runs: list[str] = []
    app = flask.Flask(__name__)
    app.testing = True

    @app.errorhandler(404)
    def not_found(error: Exception) -> Any:
        return {"error": "no_such_order"}, 404

    @app.post("/orders/<int:order_id>/cancel")
    @idempotent(ledger, principal=lambda: "acct_A")
    def cancel(order_id: int) -> Any:
        runs.append("cancel")
        flask.abort(404)

    client = Client(app)
    first, again = post(client, "/orders/9/cancel"), post(client, "/orders/9/cancel")
    assert (first.status_code, first.get_json()) == (404, {"error": "no_such_order"})
    assert (again.status_code, again.get_data()) == (404, first.get_data())
    assert runs == ["cancel"] and ledger.lookup("acct_A", "k-1").response_status == 404


@pytest.mark.parametrize(("release", "left"), [(False, "pending"), (True, None)], ids=["kept", "released"])
def test_a_view_that_raises_leaves_or_releases_its_reservation(ledger, release, left):
    app = flask.Flask(__name__)
    app.testing = True

    @app.post("/orders")
    @idempotent(ledger, principal=lambda: "acct_A", release_on_error=release)
    def orders() -> Any:
        raise RuntimeError("the mutation failed")

    with pytest.raises(RuntimeError, match="the mutation failed"):
        post(Client(app))
    row = ledger.lookup("acct_A", "k-1")
    assert (row.status.value if row else None) == left


def _wsgi_call(app: Any, key: str) -> tuple[str, list[tuple[str, str]], bytes]:
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/orders",
        "SCRIPT_NAME": "",
        "QUERY_STRING": "",
        "SERVER_NAME": "localhost",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(ORDER),
        "wsgi.errors": io.StringIO(),
        "CONTENT_LENGTH": str(len(ORDER)),
        "CONTENT_TYPE": "application/json",
        "HTTP_IDEMPOTENCY_KEY": key,
    }
    seen: dict[str, Any] = {}
    result = app(environ, lambda status, headers, exc_info=None: seen.update(status=status, headers=list(headers)))
    try:
        body = b"".join(result)
    finally:
        getattr(result, "close", lambda: None)()
    return seen["status"], seen["headers"], body


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_the_decorator_sends_what_the_wsgi_middleware_sends(ledger, streamed):
    def answer() -> flask.Response:
        chunks = [b'{"id":', b"7}"]
        body = iter(chunks) if streamed else b"".join(chunks)
        response = flask.Response(body, status=201, content_type="application/json")
        response.headers["Location"] = "/orders/7"
        response.headers["X-Trace"] = "not replayed"
        return response

    plain = flask.Flask("plain")
    plain.add_url_rule("/orders", "orders", answer, methods=["POST"])
    wrapped = IdempotencyMiddleware(plain.wsgi_app, ledger, principal=lambda environ: "acct_A")
    decorated = flask.Flask("decorated")
    decorated.add_url_rule(
        "/orders", "orders", idempotent(ledger, principal=lambda: "acct_A")(answer), methods=["POST"]
    )

    by_middleware = _wsgi_call(wrapped, "by-middleware")
    by_decorator = _wsgi_call(decorated, "by-decorator")
    assert (
        by_decorator
        == by_middleware
        == (
            "201 Created",
            [("content-type", "application/json"), ("location", "/orders/7"), ("content-length", "8")],
            b'{"id":7}',
        )
    )
    assert _wsgi_call(decorated, "by-decorator") == by_decorator
    assert ledger.lookup("acct_A", "by-decorator").fingerprint == ledger.lookup("acct_A", "by-middleware").fingerprint


# -- the example's session view -------------------------------------------------------------
@pytest.fixture
def example(tmp_path, monkeypatch):
    monkeypatch.setenv("IDEMCTL_DB", str(tmp_path / "idempotency.db"))
    monkeypatch.setenv("ORDERS_DB", str(tmp_path / "orders.db"))
    spec = importlib.util.spec_from_file_location("flask_app_sessions_under_test", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    module.ledger.close()


def _orders(tmp_path: Path, sku: str) -> int:
    with sqlite3.connect(tmp_path / "orders.db") as conn:
        return int(conn.execute("SELECT count(*) FROM orders WHERE sku = ?", (sku,)).fetchone()[0])


def test_the_examples_session_orders_are_created_once_per_key_and_account(example, tmp_path):
    browser_a, browser_b = Client(example.app), Client(example.app)
    assert browser_a.post("/session", headers={"X-Api-Key": "demo-key-A"}).status_code == 204
    assert browser_b.post("/session", headers={"X-Api-Key": "demo-key-B"}).status_code == 204
    body = json.dumps({"sku": "session-tea", "qty": 1}).encode()
    first = post(browser_a, "/session/orders", body, key="s-1")
    again = post(browser_a, "/session/orders", body, key="s-1")
    other_account = post(browser_b, "/session/orders", body, key="s-1")
    assert (first.status_code, first.headers["Location"]) == (201, f"/orders/{first.get_json()['id']}")
    assert first.get_json()["account"] == "acct_A" and other_account.get_json()["account"] == "acct_B"
    assert again.get_data() == first.get_data()
    assert _orders(tmp_path, "session-tea") == 2
    assert example.ledger.lookup("acct_A", "s-1").response_status == 201


def test_the_examples_session_view_refuses_a_browser_that_has_not_signed_in(example, tmp_path):
    reply = post(Client(example.app), "/session/orders", key="s-2")
    assert (reply.status_code, reply.get_data()) == (401, UNAUTHENTICATED)
    assert _orders(tmp_path, "tea") == 0


def test_the_wsgi_pages_decorator_example_serves_signed_in_users_once_per_key(tmp_path, monkeypatch):
    page = (ROOT / "docs" / "wsgi.md").read_text(encoding="utf-8")
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "idemctl.flask" in b]
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "wsgi_page_example"}
    exec(compile(block, "docs/wsgi.md", "exec"), namespace)
    app, ledger = namespace["app"], namespace["ledger"]
    app.secret_key = "tests"
    LoginManager(app).user_loader(User)
    app.add_url_rule("/login", "login", lambda: (login_user(User("alice")), "")[1], methods=["POST"])
    try:
        anonymous = post(Client(app), key="doc-1")
        browser = Client(app)
        browser.post("/login")
        first, again = post(browser, key="doc-1"), post(browser, key="doc-1")
        assert (anonymous.status_code, anonymous.get_data()) == (401, UNAUTHENTICATED)
        assert (first.status_code, first.headers["Location"], first.get_json()) == (201, "/orders/42", {"id": 42})
        assert again.get_data() == first.get_data()
        assert ledger.lookup("alice", "doc-1").response_status == 201
    finally:
        ledger.close()
