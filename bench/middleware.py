"""(2) The middleware: the same request cycle through
`idemctl.wsgi.IdempotencyMiddleware` around a trivial WSGI app, called
in-process (no server, no sockets), against (1) — `Ledger.handle` followed by
`after_response`, which is what the middleware does per request — and against
the raw floor, all alternating on one file."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from idemctl import Ledger

from .common import (
    BODY_1K,
    HEADERS,
    STORED_1K,
    Context,
    noop_mutation,
    now_ms,
    raw_connect,
    raw_pair,
    spread,
    timed,
    wsgi_environ,
)

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIEnvironment


def available() -> bool:
    try:
        from idemctl.wsgi import IdempotencyMiddleware  # noqa: F401
    except ImportError:
        return False
    return True


def _app(environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes]:
    environ["wsgi.input"].read()
    start_response("201 Created", [("Content-Type", "application/json"), ("Content-Length", str(len(STORED_1K)))])
    return [STORED_1K]


def _cycle(ctx: Context, synchronous: str) -> dict[str, Any]:
    from idemctl.wsgi import IdempotencyMiddleware

    n = ctx.size(1500 if synchronous == "FULL" else 4000, 40)
    reps = ctx.size(5, 2)
    path = ctx.path(f"middleware-{synchronous.lower()}.db")
    ledger = Ledger.open(path, synchronous=synchronous)
    ledger.init()
    raw = raw_connect(path, synchronous)
    app = IdempotencyMiddleware(_app, ledger, principal=lambda environ: environ.get("REMOTE_USER"))
    seen: list[str] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        seen.append(status)
        return lambda data: None

    def call(key: str) -> bytes:
        body_iter = app(wsgi_environ(key), start_response)
        try:
            return b"".join(body_iter)
        finally:
            close = getattr(body_iter, "close", None)
            if close is not None:
                close()

    assert call("check") == STORED_1K and seen[-1].startswith("201"), seen
    assert call("check") == STORED_1K and seen[-1].startswith("201")  # replayed

    def floor(rep: int) -> None:
        now = now_ms()
        for i in range(n):
            raw_pair(raw, "acct_bench", f"raw-{rep}-{i}", now)

    def library(rep: int) -> None:
        for i in range(n):
            ledger.after_response(
                ledger.handle("acct_bench", f"lib-{rep}-{i}", "POST", "/orders", HEADERS, BODY_1K, noop_mutation)
            )

    def middleware(rep: int) -> None:
        for i in range(n):
            call(f"mw-{rep}-{i}")

    variants = {"floor": floor, "library": library, "middleware": middleware}
    rates: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for rep in range(reps):
        for name in names[rep % 3 :] + names[: rep % 3]:
            rates[name].append(n / timed(lambda: variants[name](rep)))
    ledger.close()
    raw.close()
    return {
        "synchronous": synchronous,
        "requests_per_rep": n,
        "floor_ops_per_s": spread(rates["floor"], 1),
        "library_ops_per_s": spread(rates["library"], 1),
        "middleware_ops_per_s": spread(rates["middleware"], 1),
        "ratio_to_library": spread([m / lib for m, lib in zip(rates["middleware"], rates["library"])]),
        "ratio_to_floor": spread([m / f for m, f in zip(rates["middleware"], rates["floor"])]),
    }


def run(ctx: Context) -> dict[str, Any]:
    if not available():
        return {"missing": "idemctl.wsgi.IdempotencyMiddleware is not importable"}
    return {"full": _cycle(ctx, "FULL"), "normal": _cycle(ctx, "NORMAL")}
