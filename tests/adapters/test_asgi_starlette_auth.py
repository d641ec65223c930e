"""The ASGI middleware behind Starlette's AuthenticationMiddleware, with the
principal function docs/asgi.md shows: a signed-in user is its identity, a
request nobody signed is 401, and neither is a 500."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from idemctl import Ledger
from idemctl.asgi import IdempotencyMiddleware
from tests.helpers import ROOT


class Customer(SimpleUser):
    """A user whose `identity` is its name: an app's user class implements
    `BaseUser.identity` (older Starlettes' SimpleUser does not)."""

    @property
    def identity(self) -> str:
        return self.username


class BearerNames(AuthenticationBackend):
    """`Authorization: Bearer NAME` signs in NAME; no header, nobody."""

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, Customer] | None:
        given = conn.headers.get("Authorization", "")
        if not given.startswith("Bearer "):
            return None
        return AuthCredentials(["authenticated"]), Customer(given.removeprefix("Bearer "))


def documented_principal():  # type: ignore[no-untyped-def]
    """The `principal` function of docs/asgi.md's middleware example, as written there."""
    page = (ROOT / "docs" / "asgi.md").read_text(encoding="utf-8")
    start = page.index("async def principal(scope)")
    source = page[start : page.index("\n\n", start)]
    namespace: dict[str, object] = {}
    exec(source, namespace)  # the documentation's own example
    return namespace["principal"]


@pytest.fixture
def client(tmp_path):  # type: ignore[no-untyped-def]
    runs: list[str] = []

    async def create(request: Request) -> JSONResponse:
        runs.append(request.scope["idemctl.principal"])
        return JSONResponse({"order": len(runs), "by": request.scope["idemctl.principal"]}, status_code=201)

    ledger = Ledger.open(tmp_path / "ledger.db")
    ledger.init()
    inner = IdempotencyMiddleware(
        Starlette(routes=[Route("/orders", create, methods=["POST"])]), ledger, principal=documented_principal()
    )
    app = Starlette(
        routes=[Route("/{path:path}", inner, methods=["POST"])],
        middleware=[Middleware(AuthenticationMiddleware, backend=BearerNames())],
    )
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client, runs
    ledger.close()


def test_a_signed_in_user_is_its_identity_and_a_retry_replays(client):  # type: ignore[no-untyped-def]
    http, runs = client
    headers = {"Authorization": "Bearer alice", "Idempotency-Key": "k1", "Content-Type": "application/json"}
    first = http.post("/orders", headers=headers, content=b"{}")
    again = http.post("/orders", headers=headers, content=b"{}")
    assert (first.status_code, first.json()) == (201, {"order": 1, "by": "alice"})
    assert (again.status_code, again.json()) == (201, {"order": 1, "by": "alice"})
    assert runs == ["alice"]


def test_a_request_nobody_signed_is_401_not_500(client):  # type: ignore[no-untyped-def]
    http, runs = client
    answer = http.post("/orders", headers={"Idempotency-Key": "k1", "Content-Type": "application/json"}, content=b"{}")
    assert answer.status_code == 401
    assert runs == []


def test_returning_the_unauthenticated_user_object_itself_is_401_and_a_signed_in_one_a_type_error(tmp_path):
    # What the earlier documentation said: `return scope.get("user")`.
    ledger = Ledger.open(tmp_path / "ledger.db")
    ledger.init()

    async def orders(scope, receive, send):  # type: ignore[no-untyped-def]
        await JSONResponse({}, status_code=201)(scope, receive, send)

    inner = IdempotencyMiddleware(orders, ledger, principal=lambda scope: scope.get("user"))
    app = Starlette(
        routes=[Route("/{path:path}", inner, methods=["POST"])],
        middleware=[Middleware(AuthenticationMiddleware, backend=BearerNames())],
    )
    with TestClient(app, raise_server_exceptions=True) as http:
        nobody = http.post("/orders", headers={"Idempotency-Key": "k1"}, content=b"{}")
        assert nobody.status_code == 401
        with pytest.raises(TypeError, match=r"got Customer \(return the user's identity, e\.g\. user\.identity\)"):
            http.post("/orders", headers={"Idempotency-Key": "k1", "Authorization": "Bearer bob"}, content=b"{}")
    ledger.close()
