"""`IdempotencyMixin`: the contract for Django REST framework views, whose
user is known only once DRF's own authentication ran inside the view."""

from __future__ import annotations

from typing import Any

from django.http import HttpResponse

from ..exchange.drive import Later
from .conf import current_config
from .exchange import AnswerResponse, State, buffer_multipart, start
from .marks import EXEMPT, mode_of


class _Answered(Exception):
    """The ledger answered without running the handler (replay, 400, 401, 409, 503)."""

    def __init__(self, response: HttpResponse) -> None:
        super().__init__(response.status_code)
        self.response = response


class IdempotencyMixin:
    """For DRF views and viewsets: claims the key after DRF's authentication,
    permission and throttle checks, with ``request.user`` as DRF resolved it
    (token, session, JWT, ...) as the principal. List it before the DRF base::

        class OrderList(IdempotencyMixin, APIView):
            authentication_classes = [TokenAuthentication]
            permission_classes = [IsAuthenticated]

    A request DRF refuses (401, 403, 429) claims nothing. The handler runs at
    most once per key; its response (a DRF ``Response`` is rendered first)
    is stored, and the answer built from what was stored is sent, exactly as
    the middleware sends it. An exception DRF turns into a response (a
    ValidationError's 400) is an answer like any other; one it does not
    leaves the reservation pending, or releases it with ``RELEASE_ON_ERROR``.
    ``settings.IDEMCTL`` configures it; the per-view marks work on the class
    and on handler or action methods. The middleware is not needed for it.
    """

    _idemctl_state: State | None = None
    # Django's HttpRequest, as dispatch() receives it before DRF wraps it:
    # its META, body and path are what the middleware reads.
    _idemctl_request: Any = None

    def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        parent: Any = super()
        self._idemctl_state = None
        self._idemctl_request = request
        try:
            return parent.dispatch(request, *args, **kwargs)
        except BaseException as exc:
            state, self._idemctl_state = self._idemctl_state, None
            if state is not None:
                state.fail(exc)
            raise

    def _idemctl_django_request(self, request: Any) -> Any:
        # DRF's Request passes attribute access through to Django's: it
        # serves when dispatch() was bypassed.
        return self._idemctl_request if self._idemctl_request is not None else request

    def initial(self, request: Any, *args: Any, **kwargs: Any) -> None:
        parent: Any = super()
        config = current_config()
        django_request = self._idemctl_django_request(request)
        protected = config.policy.protects(str(request.method))
        if protected:
            buffer_multipart(django_request, config.max_body_bytes)
        parent.initial(request, *args, **kwargs)
        if not protected:
            return
        handler = getattr(self, "action", None) or str(request.method).lower()
        mode = mode_of([getattr(type(self), handler, None), type(self)])
        if mode is None and config.path_is_exempt(django_request):
            mode = EXEMPT
        door, out = start(config, django_request, request, mode)
        if isinstance(out, AnswerResponse):
            raise _Answered(out)
        if isinstance(out, Later):
            state = State(config, False)
            state.pending = (out, door)
            self._idemctl_state = state

    def handle_exception(self, exc: Exception) -> Any:
        if isinstance(exc, _Answered):
            return exc.response
        parent: Any = super()
        return parent.handle_exception(exc)

    def finalize_response(self, request: Any, response: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(response, AnswerResponse):
            return response  # the ledger's answer, sent as the middleware sends it
        parent: Any = super()
        response = parent.finalize_response(request, response, *args, **kwargs)
        state, self._idemctl_state = self._idemctl_state, None
        if state is None or state.pending is None:
            return response
        if callable(getattr(response, "render", None)) and not getattr(response, "is_rendered", True):
            response = response.render()
        return state.complete(response)


__all__ = ["IdempotencyMixin"]
