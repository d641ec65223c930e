"""FastAPI: protect routes whose principal comes from a FastAPI dependency.

ASGI middleware runs before routing, so it cannot see who `Depends(current_user)`
says the caller is. `idempotent_route(ledger, principal=...)` makes an
`APIRoute` class for a router: `principal` is itself a FastAPI dependency
(it may depend on `current_user`), resolved with the route's own
dependencies and validation; only then is the key claimed, so a request
that fails validation (422) or auth (401 from the dependency) claims
nothing. The endpoint runs at most once per key, and the response FastAPI
builds from its return value is stored and sent exactly as the ASGI and
WSGI middleware send theirs. Needs the `asgi` extra (FastAPI).

>>> from fastapi import APIRouter, Depends, FastAPI
>>> from idemctl import Ledger
>>> from idemctl.fastapi import idempotent_route
>>> ledger = Ledger.open(":memory:"); _ = ledger.init()
>>> def current_account() -> str:  # your auth dependency
...     return "acct_1"
>>> router = APIRouter(route_class=idempotent_route(ledger, principal=current_account))
>>> @router.post("/orders", status_code=201)
... async def create_order(order: dict, account: str = Depends(current_account)) -> dict:
...     return {"id": 7, "account": account}
>>> app = FastAPI(); app.include_router(router)
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from fastapi import Depends, Request, Response
from fastapi.exception_handlers import http_exception_handler
from fastapi.routing import APIRoute
from starlette.background import BackgroundTask, BackgroundTasks
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from .exchange import gate as gates
from .exchange import scope as scopes
from .exchange.capture import Capture
from .exchange.drive import LATER, Later, drive_async
from .exchange.gate import Delivery
from .exchange.scope import MessageCapture, capturable_scope
from .exchange.sequence import EveryRequestProtected, Run, sequence
from .exchange.threads import hand_off
from .exchange.wire import DEFAULT_MAX_BODY_BYTES, DEFAULT_UNAVAILABLE_RETRY_AFTER_MS, wire_headers
from .ledger import Ledger

log = logging.getLogger("idemctl.fastapi")

_PENDING = "idemctl_pending"
_REQUEST_PARAM = "idemctl_request_"
_PRINCIPAL_PARAM = "idemctl_caller"
_ORIGINAL = "__idemctl_endpoint__"
Endpoint = Callable[..., Any]
Kwargs = dict[str, Any]


# SQLite's statements go to the loop's default executor, handed back to the
# loop by the worker (anyio's thread pool costs three times as much a hand-off).
_in_thread = functools.partial(hand_off, None)


class _Immediate(Exception):
    """The gate answered without running the endpoint (replay, 400, 401, 409, 413, 503)."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


class _Door(EveryRequestProtected):
    """One request's FastAPI side: the endpoint FastAPI resolved, and the
    principal its dependency returned."""

    __slots__ = ("background", "endpoint", "kwargs", "release_on_error", "replayed_header", "request", "sent", "who")

    def __init__(
        self, endpoint: Endpoint, kwargs: Kwargs, request: Request, who: object, release: bool, replayed_header: bool
    ) -> None:
        self.endpoint, self.kwargs, self.request = endpoint, kwargs, request
        self.who, self.release_on_error, self.replayed_header = who, release, replayed_header
        self.background: BackgroundTask | None = None
        self.sent = False

    @property
    def in_thread(self) -> Callable[..., Awaitable[Any]]:
        return _in_thread

    @property
    def keep(self) -> None:
        return None  # FastAPI runs the endpoint: it is not shielded from the request

    def principal(self) -> object:
        return self.who

    def read_body(self, limit: int, declared: int | None) -> Awaitable[bytes]:
        return self.request.body()

    async def run(self, need: Run) -> object:
        return LATER  # the endpoint runs once the route has returned from the sequence

    async def send(self, delivery: Delivery, after: Callable[[], Awaitable[None]] | None) -> Response:
        self.sent = True
        return _response(delivery, self.replayed_header, self.background, after)

    async def pass_through(self) -> Any:
        return await _call(self.endpoint, self.kwargs)


def idempotent_route(
    ledger: Ledger,
    *,
    principal: Callable[..., Any],
    release_on_error: bool = False,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    replayed_header: bool = False,
    unavailable_retry_after_ms: int = DEFAULT_UNAVAILABLE_RETRY_AFTER_MS,
) -> type[APIRoute]:
    """An `APIRoute` class that puts every route of a router under the
    Idempotency-Key contract. Methods the ledger's Policy does not protect
    pass through. `principal` is a FastAPI dependency returning the
    caller's principal (str) or None (401).

    What the endpoint answers after the claim is its answer, stored and
    replayed: any Starlette response (plain, JSON, streaming, file), an
    ``HTTPException`` it raises (rendered by the app's handler for it),
    and its ``BackgroundTasks``, which run once after the first answer and
    never on a replay."""
    gate = gates.adapter_gate(
        ledger, principal, "FastAPI dependency", log, max_body_bytes, replayed_header, unavailable_retry_after_ms
    )

    names = ledger.policy.fingerprint_headers

    async def wrap_endpoint(endpoint: Callable[..., Any], request: Request, who: object, kwargs: Any) -> Any:
        door = _Door(endpoint, kwargs, request, who, release_on_error, gate.replayed_header)
        out = await drive_async(gate, sequence(gate, scopes.parse(request.scope, names, exact_length=True), door), door)
        if isinstance(out, Later):
            setattr(request.state, _PENDING, (out, door))
            return await _call(endpoint, kwargs)
        if door.sent:
            raise _Immediate(out)
        return out

    class IdempotentRoute(APIRoute):
        def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
            # Routers may copy a route by its endpoint (include_router): that
            # is our wrapper, and the user's function is wrapped only once.
            endpoint = getattr(endpoint, _ORIGINAL, endpoint)
            super().__init__(path, _with_principal(endpoint, principal, wrap_endpoint), **kwargs)

        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            original = super().get_route_handler()

            async def handler(request: Request) -> Response:
                try:
                    response = await original(request)
                except _Immediate as immediate:
                    return immediate.response
                except HTTPException as exc:
                    pending = getattr(request.state, _PENDING, None)
                    if pending is None:
                        raise  # before the claim (a dependency's): nothing was claimed
                    # After the claim it is the endpoint's answer, like any other;
                    # its function-scoped dependencies see the exception first,
                    # as they would without the route class (a rollback).
                    try:
                        await _end_function_scope(request.scope, exc)
                        response = await _rendered(request, exc)
                    except BaseException as failure:
                        await drive_async(gate, pending[0].steps, pending[1], failure, resumed=True)
                        raise
                except BaseException as exc:
                    pending = getattr(request.state, _PENDING, None)
                    if pending is not None:
                        await drive_async(gate, pending[0].steps, pending[1], exc, resumed=True)
                    raise
                pending = getattr(request.state, _PENDING, None)
                if pending is None:
                    return response  # not protected: FastAPI's own response
                later, door = pending
                # The endpoint's background work runs once, after the first
                # answer is sent; a replay never carries it.
                door.background, response.background = response.background, None
                failed: BaseException | None = None
                try:
                    # The commit of a function-scoped dependency is part of the
                    # endpoint: stored only once it succeeded (a failing one is
                    # the endpoint raising, and nothing is stored).
                    await _end_function_scope(request.scope, None)
                    await _capture(response, request.scope, later.run.capture)
                except BaseException as exc:
                    failed = exc
                sent: Response = await drive_async(gate, later.steps, door, failed, resumed=True)
                return sent

            return handler

    return IdempotentRoute


async def _call(endpoint: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    if inspect.iscoroutinefunction(endpoint):
        return await endpoint(**kwargs)
    return await run_in_threadpool(endpoint, **kwargs)


async def _end_function_scope(scope: Any, exc: BaseException | None) -> None:
    """Run the teardown of the endpoint's ``Depends(..., scope="function")``
    dependencies now, before its answer is captured and stored, instead of
    after this handler returns (where FastAPI runs it): a teardown that
    commits and fails then raises here, the reservation is abandoned, and no
    answer the client never got is stored. `exc` is an exception the
    endpoint raised, which they see as they would without the route class.
    FastAPI exits the emptied stack again afterwards, a no-op."""
    stack = scope.get("fastapi_function_astack")
    # No function-scoped yield dependency (or a FastAPI without scopes): nothing to await.
    if stack is None or not getattr(stack, "_exit_callbacks", True):
        return
    if exc is None:
        await stack.aclose()
    else:
        await stack.__aexit__(type(exc), exc, exc.__traceback__)


async def _rendered(request: Request, exc: HTTPException) -> Response:
    """The response the app's handler for this exception makes (FastAPI's
    default one when the app registered none)."""
    handlers: dict[Any, Callable[..., Any]] = getattr(request.app, "exception_handlers", {}) or {}
    handler: Callable[..., Any] = http_exception_handler
    for cls in type(exc).__mro__:
        if cls in handlers:
            handler = handlers[cls]
            break
    if inspect.iscoroutinefunction(handler):
        response = await handler(request, exc)
    else:
        response = await run_in_threadpool(handler, request, exc)
    if not isinstance(response, Response):
        raise TypeError(f"the exception handler for {type(exc).__name__} returned {type(response).__name__}")
    return response


async def _capture(response: Response, scope: Any, capture: Capture) -> None:
    """Any Starlette response (plain, streaming, file) captured through the
    ASGI messages it sends, byte for byte, bounded by the body cap."""
    inner = capturable_scope(scope)
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        # Nothing more arrives while the response is captured; a streaming
        # response that listens for a disconnect waits here until it is done.
        await never.wait()
        return {"type": "http.disconnect"}

    captured = MessageCapture(capture)
    await response(inner, receive, captured.send)
    captured.check_complete()


def _with_principal(
    endpoint: Callable[..., Any],
    principal: Callable[..., Any],
    wrap: Callable[[Callable[..., Any], Request, object, dict[str, Any]], Awaitable[Any]],
) -> Callable[..., Any]:
    """The endpoint with two more parameters FastAPI fills in: the Request
    and the principal dependency. Its own parameters are resolved (and
    validated) by FastAPI as before."""
    signature = inspect.signature(endpoint, eval_str=True)
    params = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    # FastAPI hands the Request to one parameter only: the endpoint's own, if it has one.
    own = next((p.name for p in params if isinstance(p.annotation, type) and issubclass(p.annotation, Request)), None)
    extra = [inspect.Parameter(_PRINCIPAL_PARAM, inspect.Parameter.KEYWORD_ONLY, default=Depends(principal))]
    if own is None:
        extra.insert(0, inspect.Parameter(_REQUEST_PARAM, inspect.Parameter.KEYWORD_ONLY, annotation=Request))
    tail = [p for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]

    @functools.wraps(endpoint)
    async def wrapper(**kwargs: Any) -> Any:
        request = kwargs[own] if own is not None else kwargs.pop(_REQUEST_PARAM)
        who = kwargs.pop(_PRINCIPAL_PARAM)
        return await wrap(endpoint, request, who, kwargs)

    wrapper.__signature__ = signature.replace(parameters=[*params, *extra, *tail])  # type: ignore[attr-defined]
    setattr(wrapper, _ORIGINAL, endpoint)
    return wrapper


def _response(
    delivery: Delivery,
    replayed_header: bool,
    background: BackgroundTask | None,
    sweep: Callable[[], Awaitable[None]] | None,
) -> Response:
    answer = delivery.answer
    response = Response(content=answer.body, status_code=answer.status)
    response.raw_headers = [
        (name.lower().encode("latin-1"), value.encode("latin-1"))
        for name, value in wire_headers(answer, replayed_header=replayed_header)
    ]
    if background is not None or sweep is not None:
        # Starlette runs them after the answer has gone out, in this order.
        tasks = BackgroundTasks()
        if background is not None:
            tasks.add_task(background)
        if sweep is not None:
            tasks.add_task(sweep)
        response.background = tasks
    return response


__all__ = ["idempotent_route"]
