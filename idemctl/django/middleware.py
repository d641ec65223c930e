"""`IdempotencyMiddleware`: every view of a project under the Idempotency-Key
contract, with the user Django's `AuthenticationMiddleware` resolved as
the principal (or whatever ``IDEMCTL["PRINCIPAL"]`` names)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.core.signals import got_request_exception
from django.http import HttpResponse

from ..exchange.drive import Later
from ..outcomes import Outcome
from .conf import current_config, log
from .drf import IdempotencyMixin
from .exchange import AnswerResponse, State, buffer_multipart, start
from .marks import EXEMPT, view_mode

_STATE_ATTR = "_idemctl_state"


def _note_exception(sender: object, request: Any = None, **kwargs: Any) -> None:
    # Django turns an exception of the view into a 500 before the middleware
    # sees the response; this signal is how we learn that the view raised.
    state = getattr(request, _STATE_ATTR, None)
    if isinstance(state, State) and state.pending is not None:
        state.raised = True


def watch_exceptions() -> None:
    """Connect the receiver that tells the middleware a view raised. Safe to
    call any number of times: the app's ``ready()`` and every middleware
    instance call it, so a project without the app in ``INSTALLED_APPS``
    is protected the same way."""
    got_request_exception.connect(_note_exception, dispatch_uid="idemctl.django.note_exception")


_hinted: set[type] = set()


def _hint_drf(view_func: Any, request: Any) -> None:
    cls = getattr(view_func, "cls", None)
    if isinstance(cls, type) and hasattr(cls, "authentication_classes") and cls not in _hinted:
        _hinted.add(cls)
        log.warning(
            "%s %s: %s is a Django REST framework view, which authenticates inside the view; the middleware "
            "saw Django's user (anonymous) and answered 401. Add idemctl.django.IdempotencyMixin to the view "
            "so that the principal is the user DRF authenticates.",
            request.method,
            request.path,
            cls.__name__,
        )


def _uses_mixin(view_func: Any) -> bool:
    cls = getattr(view_func, "cls", None)
    return isinstance(cls, type) and issubclass(cls, IdempotencyMixin)


class _ViewRaised(Exception):
    """The view raised and Django made its 500 of it: the view failed."""


class IdempotencyMiddleware:
    """Every view under the Idempotency-Key contract. Put it after
    ``django.contrib.auth.middleware.AuthenticationMiddleware`` in
    ``MIDDLEWARE``; CSRF and authentication failures then claim nothing.

    Protected methods (POST, PATCH, DELETE by default) are decided once the
    view is known (process_view), so the per-view marks apply; the view runs
    at most once per key, and the answer that was stored is sent. A view
    that raises leaves the reservation pending (or releases it, with
    ``RELEASE_ON_ERROR``) and Django answers 500 as usual. DRF views using
    `IdempotencyMixin` are left to the mixin.
    """

    sync_capable = True
    async_capable = False

    def __init__(self, get_response: Callable[[Any], Any]) -> None:
        self.get_response = get_response
        watch_exceptions()
        current_config()  # a mistake in settings.IDEMCTL fails at startup, not at the first POST

    def __call__(self, request: Any) -> Any:
        config = current_config()
        if str(request.method or "GET").upper() not in config.policy.protected_methods:
            return self.get_response(request)
        state = State(config, bool(config.exempt_paths) and config.path_is_exempt(request))
        setattr(request, _STATE_ATTR, state)
        if not state.path_exempt:
            buffer_multipart(request, config.max_body_bytes)
        try:
            response = self.get_response(request)
        except BaseException as exc:  # DEBUG_PROPAGATE_EXCEPTIONS lets the view's exception through
            state.fail(exc)
            raise
        if state.reply is not None:
            return state.reply
        if state.pending is None:
            return response
        if state.raised:
            state.fail(_ViewRaised())
            return response
        return state.complete(response)

    def process_view(self, request: Any, view_func: Any, view_args: Any, view_kwargs: Any) -> Any:
        state = getattr(request, _STATE_ATTR, None)
        if not isinstance(state, State) or state.decided:
            return None
        state.decided = True
        if _uses_mixin(view_func):
            return None
        mode = view_mode(view_func, str(request.method))
        if mode is None and state.path_exempt:
            mode = EXEMPT
        door, out = start(state.config, request, request, mode)
        if isinstance(out, Later):
            state.pending = (out, door)
            return None
        if isinstance(out, AnswerResponse):
            if door.delivery is not None and door.delivery.answer.outcome is Outcome.UNAUTHENTICATED:
                _hint_drf(view_func, request)
            state.reply = out
            # A stand-in that skips the view; __call__ sends the answer itself,
            # so inner middleware cannot make it differ from a first answer.
            return HttpResponse(status=out.status_code)
        return None


__all__ = ["IdempotencyMiddleware", "watch_exceptions"]
