"""Each framework's native answer shapes through its adapter: streamed and
file answers are captured whole (under the body cap), stored, and replayed
byte for byte; duplicates waiting under the FastAPI route class hold no
thread of anyio's pool."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import flask
import httpx
import pytest
from django.http import FileResponse as DjangoFileResponse
from django.http import StreamingHttpResponse
from django.urls import path as django_path
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse
from fastapi.testclient import TestClient
from werkzeug.test import Client as WerkzeugClient

from idemctl import Ledger, Policy
from idemctl.asgi import IdempotencyMiddleware as AsgiMiddleware
from idemctl.fastapi import idempotent_route
from idemctl.flask import idempotent
from tests.adapters.django_site import Site
from tests.helpers import asgi_exchange, post_scope

# Dependency scopes (`Depends(..., scope="function")`) came with a later
# FastAPI than the lowest one idemctl supports; where the installed one has
# none, no app can declare such a dependency.
needs_dependency_scopes = pytest.mark.skipif(
    "scope" not in inspect.signature(Depends).parameters,
    reason="this FastAPI has no dependency scopes (Depends(..., scope=...))",
)

BINARY = bytes(range(256)) * 4  # not UTF-8: stored as a BLOB


@pytest.fixture
def receipt(tmp_path: Path) -> Path:
    path = tmp_path / "receipt.bin"
    path.write_bytes(BINARY)
    return path


def django_site(ledger: Ledger, view) -> Site:  # type: ignore[no-untyped-def]
    return Site([django_path("orders", view)], {"LEDGER": ledger, "PRINCIPAL": lambda request: "acct_A"})


def django_post(site: Site, key: str = "k-1"):  # type: ignore[no-untyped-def]
    return site.request("POST", "/orders", b"{}", {"Idempotency-Key": key, "Content-Type": "application/json"})


def test_django_streaming_response_is_stored_and_replayed_byte_for_byte(make_ledger):
    ledger = make_ledger()
    runs: list[int] = []

    def view(request):  # type: ignore[no-untyped-def]
        runs.append(1)
        return StreamingHttpResponse(iter([BINARY[:100], BINARY[100:]]), content_type="application/octet-stream")

    site = django_site(ledger, view)
    first, again = django_post(site), django_post(site)
    assert (first.status_code, first.content) == (200, BINARY)
    assert (again.status_code, again.content, again["Content-Type"]) == (200, BINARY, "application/octet-stream")
    assert runs == [1]
    assert ledger.lookup("acct_A", "k-1").body_bytes == BINARY


def test_django_file_response_is_stored_and_replayed_and_its_file_closed(make_ledger, receipt):
    ledger = make_ledger()
    opened = []

    def view(request):  # type: ignore[no-untyped-def]
        handle = receipt.open("rb")
        opened.append(handle)
        return DjangoFileResponse(handle, content_type="application/octet-stream")

    site = django_site(ledger, view)
    first, again = django_post(site), django_post(site)
    assert (first.status_code, first.content, again.content) == (200, BINARY, BINARY)
    assert len(opened) == 1 and opened[0].closed


def test_django_stream_failing_after_the_view_returned_releases_with_release_on_error(make_ledger):
    ledger = make_ledger()
    seen = []
    ledger.subscribe(seen.append)

    def broken():  # type: ignore[no-untyped-def]
        yield b"half"
        raise RuntimeError("the stream broke")

    def view(request):  # type: ignore[no-untyped-def]
        return StreamingHttpResponse(broken())

    site = Site(
        [django_path("orders", view)],
        {"LEDGER": ledger, "PRINCIPAL": lambda request: "acct_A", "RELEASE_ON_ERROR": True},
    )
    with pytest.raises(RuntimeError, match="the stream broke"):
        django_post(site)
    assert ledger.lookup("acct_A", "k-1") is None
    assert [e.outcome.value for e in seen] == ["failed"]


def flask_client(ledger: Ledger, view) -> WerkzeugClient:  # type: ignore[no-untyped-def]
    app = flask.Flask(__name__)
    app.post("/orders")(idempotent(ledger, principal=lambda: "acct_A")(view))
    return WerkzeugClient(app)


def flask_post(client: WerkzeugClient, key: str = "k-1"):  # type: ignore[no-untyped-def]
    return client.post("/orders", data=b"{}", headers={"Idempotency-Key": key, "Content-Type": "application/json"})


def test_flask_send_file_is_stored_and_replayed_byte_for_byte(make_ledger, receipt):
    ledger = make_ledger()
    runs: list[int] = []

    def view():  # type: ignore[no-untyped-def]
        runs.append(1)
        return flask.send_file(receipt, mimetype="application/octet-stream")

    client = flask_client(ledger, view)
    first, again = flask_post(client), flask_post(client)
    assert (first.status_code, first.get_data(), again.get_data()) == (200, BINARY, BINARY)
    assert runs == [1]


def test_flask_stream_with_context_is_stored_and_replayed(make_ledger):
    ledger = make_ledger()

    def view():  # type: ignore[no-untyped-def]
        def parts():  # type: ignore[no-untyped-def]
            yield b"order "
            yield flask.request.headers["Idempotency-Key"].encode()  # needs the request context

        return flask.Response(flask.stream_with_context(parts()), status=201, mimetype="text/plain")

    client = flask_client(ledger, view)
    first, again = flask_post(client), flask_post(client)
    assert (first.status_code, first.get_data()) == (201, b"order k-1")
    assert (again.status_code, again.get_data()) == (201, b"order k-1")


def test_fastapi_waiting_duplicates_beyond_anyios_thread_pool_all_get_the_replay(make_ledger):
    ledger = make_ledger(policy=Policy(in_progress_wait_ms=20_000))
    runs: list[int] = []

    async def scenario() -> tuple[list[tuple[int, bytes]], tuple[int, bytes], int]:
        release, started = asyncio.Event(), asyncio.Event()

        def account(request: Request) -> str:
            return "acct_A"

        router = APIRouter(route_class=idempotent_route(ledger, principal=account))

        @router.post("/orders/{name}")
        async def create(name: str) -> PlainTextResponse:
            runs.append(1)
            if name == "slow":
                started.set()
                await release.wait()
            return PlainTextResponse(f"made {name}", status_code=201)

        app = FastAPI()
        app.include_router(router)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:

            async def post(name: str) -> tuple[int, bytes]:
                reply = await client.post(f"/orders/{name}", content=b"{}", headers={"idempotency-key": name})
                return reply.status_code, reply.content

            owner = asyncio.ensure_future(post("slow"))
            await started.wait()
            # More than anyio's 40 worker threads: a wait that held one would starve the rest.
            duplicates = [asyncio.ensure_future(post("slow")) for _ in range(45)]
            await asyncio.sleep(0.3)
            unrelated = await asyncio.wait_for(post("other"), timeout=30)
            waiting = sum(not d.done() for d in duplicates)
            release.set()
            replies = [await owner, *await asyncio.gather(*duplicates)]
        return replies, unrelated, waiting

    replies, unrelated, waiting = asyncio.run(scenario())
    assert unrelated == (201, b"made other")
    assert waiting == 45
    assert replies == [(201, b"made slow")] * 46
    assert len(runs) == 2


# -- ASGI: an app that sends trailer fields ------------------------------------------------
async def asgi_post(app, key: str = "k-1") -> list[dict]:  # type: ignore[no-untyped-def]
    """One POST through an ASGI app: every message it sent."""
    sent = await asgi_exchange(app, post_scope(key, extensions={"http.response.trailers": {}}))
    await app.wait_idle()
    return sent


def test_asgi_trailers_are_left_out_and_the_answer_is_stored_and_replayed(make_ledger):
    ledger = make_ledger()
    runs: list[int] = []

    async def orders(scope, receive, send):  # type: ignore[no-untyped-def]
        runs.append(1)
        await send(
            {
                "type": "http.response.start",
                "status": 201,
                "trailers": True,
                "headers": [(b"content-type", b"text/plain"), (b"trailer", b"x-checksum")],
            }
        )
        await send({"type": "http.response.body", "body": b"made"})
        await send({"type": "http.response.trailers", "headers": [(b"x-checksum", b"abc")], "more_trailers": True})
        await send({"type": "http.response.trailers", "headers": [], "more_trailers": False})

    app = AsgiMiddleware(orders, ledger, principal=lambda scope: "acct_A")
    first, again = asyncio.run(asgi_post(app)), asyncio.run(asgi_post(app))
    # Both are the stored answer: no trailers flag, no trailer message, first and replay alike.
    for sent in (first, again):
        assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
        assert (sent[0]["status"], sent[0].get("trailers", False), sent[1]["body"]) == (201, False, b"made")
    assert first == again
    assert runs == [1]
    row = ledger.lookup("acct_A", "k-1")
    assert (row.status.value, row.response_status, row.body_bytes) == ("completed", 201, b"made")


# -- FastAPI: a dependency whose commit runs after the endpoint, and fails ------------------
class CommitFails(Exception):
    pass


def failing_commit_app(ledger: Ledger, *, route_class: bool, release_on_error: bool):  # type: ignore[no-untyped-def]
    """A FastAPI app whose endpoint writes through a function-scoped yield
    dependency: it commits after the endpoint returned, before the answer
    goes out, and its first commit fails."""
    commits: list[str] = []
    runs: list[int] = []

    async def session():  # type: ignore[no-untyped-def]
        yield "session"
        if not commits:
            commits.append("failed")
            raise CommitFails("the commit failed")
        commits.append("committed")

    def account(request: Request) -> str:
        return "acct_A"

    route = idempotent_route(ledger, principal=account, release_on_error=release_on_error) if route_class else None
    router = APIRouter(route_class=route) if route is not None else APIRouter()

    @router.post("/orders", status_code=201)
    async def create(db: str = Depends(session, scope="function")) -> dict:  # type: ignore[type-arg]
        runs.append(1)
        return {"id": len(runs)}

    app = FastAPI()
    app.include_router(router)
    if not route_class:
        app = AsgiMiddleware(app, ledger, principal=lambda scope: "acct_A", release_on_error=release_on_error)  # type: ignore[assignment]
    return app, commits, runs


@needs_dependency_scopes
@pytest.mark.parametrize("door", ["route-class", "asgi-middleware"])
def test_fastapi_function_scoped_commit_that_fails_is_never_replayed_as_a_success(make_ledger, door):
    ledger = make_ledger()
    app, commits, runs = failing_commit_app(ledger, route_class=door == "route-class", release_on_error=True)
    client = TestClient(app, raise_server_exceptions=False)
    headers = {"idempotency-key": "k-1"}
    first = client.post("/orders", content=b"{}", headers=headers)
    assert first.status_code == 500
    # Nothing was committed, so nothing is stored: the retry runs the endpoint again.
    assert ledger.lookup("acct_A", "k-1") is None
    again = client.post("/orders", content=b"{}", headers=headers)
    assert (again.status_code, again.json()) == (201, {"id": 2})
    assert commits == ["failed", "committed"] and runs == [1, 1]
    replay = client.post("/orders", content=b"{}", headers=headers)
    assert (replay.status_code, replay.json(), len(runs)) == (201, {"id": 2}, 2)


@needs_dependency_scopes
def test_fastapi_function_scoped_commit_that_fails_leaves_the_reservation_for_a_takeover(make_ledger, clock):
    ledger = make_ledger()
    app, commits, runs = failing_commit_app(ledger, route_class=True, release_on_error=False)
    client = TestClient(app, raise_server_exceptions=False)
    headers = {"idempotency-key": "k-1"}
    assert client.post("/orders", content=b"{}", headers=headers).status_code == 500
    assert ledger.lookup("acct_A", "k-1").status.value == "pending"
    assert client.post("/orders", content=b"{}", headers=headers).status_code == 409
    clock.advance(30_001)
    again = client.post("/orders", content=b"{}", headers=headers)
    assert (again.status_code, again.json(), runs) == (201, {"id": 2}, [1, 1])
    assert (commits[0], commits[-1]) == ("failed", "committed")


@needs_dependency_scopes
def test_fastapi_http_exception_reaches_function_scoped_dependencies_as_without_the_route_class(make_ledger):
    from fastapi import HTTPException

    ledger = make_ledger()
    seen: list[str] = []

    async def session():  # type: ignore[no-untyped-def]
        try:
            yield "session"
        except HTTPException:
            seen.append("rolled back")
            raise
        seen.append("committed")

    router = APIRouter(route_class=idempotent_route(ledger, principal=lambda: "acct_A"))

    @router.post("/orders")
    async def create(db: str = Depends(session, scope="function")) -> dict:  # type: ignore[type-arg]
        raise HTTPException(status_code=402, detail="card declined")

    app = FastAPI()
    app.include_router(router)
    client = TestClient(app)
    first = client.post("/orders", content=b"{}", headers={"idempotency-key": "k-1"})
    assert (first.status_code, first.json(), seen) == (402, {"detail": "card declined"}, ["rolled back"])
    replay = client.post("/orders", content=b"{}", headers={"idempotency-key": "k-1"})
    assert (replay.status_code, replay.content) == (402, first.content)
    assert ledger.lookup("acct_A", "k-1").response_status == 402
