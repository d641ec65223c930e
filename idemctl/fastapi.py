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

import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from fastapi import Depends, Request, Response
from fastapi.routing import APIRoute
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from . import responses
from .asgi import request_target, scope_headers
from .errors import AnswerNotStoredError, LedgerUnavailableError, StorageError
from .ledger import Ledger
from .outcomes import Answer, Outcome, Ticket
from .wire import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_UNAVAILABLE_RETRY_AFTER_MS,
    log_not_stored,
    wire_headers,
)

log = logging.getLogger("idemctl.fastapi")

_TICKET = "idemctl_ticket"
_REQUEST_PARAM = "idemctl_request_"
_PRINCIPAL_PARAM = "idemctl_principal_"
_ORIGINAL = "__idemctl_endpoint__"


class _Immediate(Exception):
    """The ledger answered without running the endpoint (replay, 400, 401, 409, 503)."""

    def __init__(self, answer: Answer) -> None:
        super().__init__(answer.status)
        self.answer = answer


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
    caller's principal (str) or None (401)."""

    async def wrap_endpoint(endpoint: Callable[..., Any], request: Request, who: str | None, kwargs: Any) -> Any:
        method = request.method.upper()
        if not ledger.policy.protects(method):
            return await _call(endpoint, kwargs)
        body = await request.body()
        if len(body) > max_body_bytes:
            raise _Immediate(Answer(*responses.body_too_large(max_body_bytes), Outcome.BODY_REFUSED))
        path = request_target(request.scope)
        headers = scope_headers(request.scope, ledger.policy.fingerprint_headers)
        key = request.headers.get("idempotency-key")
        try:
            decision = await run_in_threadpool(ledger.begin, who, key, method, path, headers, body)
        except StorageError as exc:
            level = logging.WARNING if isinstance(exc, LedgerUnavailableError) else logging.ERROR
            log.log(level, "idempotency ledger unavailable, refused %s %s with 503: %s", method, path, exc)
            raise _Immediate(Answer(*responses.unavailable(unavailable_retry_after_ms), Outcome.UNAVAILABLE)) from exc
        if isinstance(decision, Answer):
            raise _Immediate(decision)
        request.state.idemctl_ticket = decision
        return await _call(endpoint, kwargs)

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
                    return _response(immediate.answer, replayed_header, sweep=None)
                except BaseException:
                    ticket = getattr(request.state, _TICKET, None)
                    if ticket is not None:
                        await run_in_threadpool(ledger.abandon, ticket, release=release_on_error)
                    raise
                ticket = getattr(request.state, _TICKET, None)
                if not isinstance(ticket, Ticket):
                    return response  # not protected: FastAPI's own response
                status, headers, body = await _captured(response)
                try:
                    answer = await run_in_threadpool(ledger.finish, ticket, status, headers, body)
                except AnswerNotStoredError as exc:
                    reservation = ticket.reservation
                    who = reservation.principal if reservation else None
                    log_not_stored(log, exc, who, reservation.key if reservation else None)
                    return _response(exc.answer, replayed_header, sweep=None)
                return _response(answer, replayed_header, sweep=ledger)

            return handler

    return IdempotentRoute


async def _call(endpoint: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    if inspect.iscoroutinefunction(endpoint):
        return await endpoint(**kwargs)
    return await run_in_threadpool(endpoint, **kwargs)


def _with_principal(
    endpoint: Callable[..., Any],
    principal: Callable[..., Any],
    wrap: Callable[[Callable[..., Any], Request, str | None, dict[str, Any]], Awaitable[Any]],
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
        if who is not None and not isinstance(who, str):
            raise TypeError(f"the principal dependency must return str or None, got {type(who).__name__}")
        return await wrap(endpoint, request, who, kwargs)

    wrapper.__signature__ = signature.replace(parameters=[*params, *extra, *tail])  # type: ignore[attr-defined]
    setattr(wrapper, _ORIGINAL, endpoint)
    return wrapper


async def _captured(response: Response) -> tuple[int, list[tuple[str, str]], bytes]:
    """The response FastAPI built, as status, headers and the whole body."""
    iterator = getattr(response, "body_iterator", None)
    if iterator is not None:
        chunks = [chunk if isinstance(chunk, bytes) else str(chunk).encode("utf-8") async for chunk in iterator]
        body = b"".join(chunks)
    else:
        body = bytes(response.body)
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in response.raw_headers]
    return response.status_code, headers, body


def _response(answer: Answer, replayed_header: bool, *, sweep: Ledger | None) -> Response:
    response = Response(content=answer.body, status_code=answer.status)
    response.raw_headers = [
        (name.lower().encode("latin-1"), value.encode("latin-1"))
        for name, value in wire_headers(answer, replayed_header=replayed_header)
    ]
    if sweep is not None and answer.started_at is not None:
        # Starlette runs a sync background task in its thread pool, after the answer.
        response.background = BackgroundTask(sweep.after_response, answer)
    return response


__all__ = ["idempotent_route"]
