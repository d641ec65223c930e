"""Stream a 256 MiB answer through one adapter and print how much the
process's peak RSS grew (KiB). Run as `python -m tests.e2e.stream_rss ADAPTER LEDGER`
from the repository root; tests/adapters/test_bounded_capture.py reads the number."""

from __future__ import annotations

import asyncio
import io
import resource
import sys

from idemctl import Ledger

CHUNK = b"x" * (1024 * 1024)
CHUNKS = 256
SMALL = 4


def peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def stream(n: int):  # type: ignore[no-untyped-def]
    for _ in range(n):
        yield CHUNK


def wsgi(ledger: Ledger) -> callable:
    from idemctl.wsgi import IdempotencyMiddleware

    def app(environ, start_response):  # type: ignore[no-untyped-def]
        start_response("200 OK", [("Content-Type", "application/octet-stream")])
        return stream(int(environ["PATH_INFO"].strip("/")))

    mw = IdempotencyMiddleware(app, ledger, principal=lambda env: "acct_A")

    def request(key: str, n: int) -> int:
        env = {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": f"/{n}",
            "HTTP_IDEMPOTENCY_KEY": key,
            "CONTENT_LENGTH": "0",
            "wsgi.input": io.BytesIO(b""),
        }
        seen = {}
        result = mw(env, lambda status, headers, exc_info=None: seen.setdefault("status", status))
        b"".join(result)
        result.close()
        return int(seen["status"][:3])

    return request


def asgi(ledger: Ledger) -> callable:
    from idemctl.asgi import IdempotencyMiddleware

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        n = int(scope["path"].strip("/"))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for chunk in stream(n):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    mw = IdempotencyMiddleware(app, ledger, principal=lambda scope: "acct_A")

    def request(key: str, n: int) -> int:
        sent = []

        async def receive():  # type: ignore[no-untyped-def]
            return {"type": "http.request", "body": b""}

        async def send(message):  # type: ignore[no-untyped-def]
            sent.append(message)

        async def run() -> None:
            scope = {
                "type": "http",
                "method": "POST",
                "path": f"/{n}",
                "raw_path": f"/{n}".encode(),
                "query_string": b"",
                "headers": [(b"idempotency-key", key.encode())],
            }
            await mw(scope, receive, send)
            await mw.wait_idle()

        asyncio.run(run())
        return int(sent[0]["status"])

    return request


def fastapi(ledger: Ledger) -> callable:
    from fastapi import APIRouter, FastAPI
    from fastapi.responses import StreamingResponse
    from fastapi.testclient import TestClient

    from idemctl.fastapi import idempotent_route

    router = APIRouter(route_class=idempotent_route(ledger, principal=lambda: "acct_A"))

    @router.post("/{n}")
    async def endpoint(n: int):  # type: ignore[no-untyped-def]
        return StreamingResponse(stream(n))

    app = FastAPI()
    app.include_router(router)
    client = TestClient(app)
    return lambda key, n: client.post(f"/{n}", headers={"idempotency-key": key}).status_code


def flask(ledger: Ledger) -> callable:
    import flask as flask_
    from werkzeug.test import Client

    from idemctl.flask import idempotent

    app = flask_.Flask(__name__)

    @app.post("/<int:n>")
    @idempotent(ledger, principal=lambda: "acct_A")
    def endpoint(n: int):  # type: ignore[no-untyped-def]
        return flask_.Response(flask_.stream_with_context(stream(n)))

    client = Client(app)
    return lambda key, n: client.post(f"/{n}", headers={"Idempotency-Key": key}).status_code


def django(ledger: Ledger) -> callable:
    from django.http import StreamingHttpResponse
    from django.urls import path

    from tests.adapters.django_site import Site

    def view(request, n):  # type: ignore[no-untyped-def]
        return StreamingHttpResponse(stream(n))

    site = Site([path("<int:n>", view)], {"LEDGER": ledger, "PRINCIPAL": lambda request: "acct_A"})
    return lambda key, n: site.request("POST", f"/{n}", b"", {"Idempotency-Key": key}).status_code


ADAPTERS = {"wsgi": wsgi, "asgi": asgi, "fastapi": fastapi, "flask": flask, "django": django}

if __name__ == "__main__":
    adapter, target = sys.argv[1], sys.argv[2]
    ledger = Ledger.open(target)
    ledger.init()
    request = ADAPTERS[adapter](ledger)
    assert request("warm-up", SMALL) == 500  # 4 MiB is over the default cap too: everything is imported and warm
    before = peak_kib()
    status = request("big", CHUNKS)
    replay = request("big", CHUNKS)
    print(status, replay, peak_kib() - before)
