"""Per-view marks: which views the ledger leaves alone, which need a key
only when one is sent, and which need one even under ``EXEMPT_PATHS``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

EXEMPT = "exempt"
KEY_OPTIONAL = "key_optional"
KEY_REQUIRED = "key_required"
MODE_ATTR = "idemctl_mode"

V = TypeVar("V")


def _marked(view: V, mode: str) -> V:
    setattr(view, MODE_ATTR, mode)
    return view


def idempotency_exempt(view: V) -> V:
    """A view (function, class, or a DRF handler or viewset action method)
    that the ledger leaves alone: requests pass as if idemctl were not there.
    Put it above ``@api_view`` and ``@csrf_exempt``.

    >>> @idempotency_exempt
    ... def sign_in(request): ...
    >>> view_mode(sign_in, "POST")
    'exempt'
    """
    return _marked(view, EXEMPT)


def idempotency_key_optional(view: V) -> V:
    """Requests to this view without an `Idempotency-Key` header run
    unprotected (only for views harmless to repeat); with one they are
    protected as usual."""
    return _marked(view, KEY_OPTIONAL)


def idempotency_key_required(view: V) -> V:
    """This view is protected even under one of ``EXEMPT_PATHS``: every
    request with a protected method needs a key (the default elsewhere)."""
    return _marked(view, KEY_REQUIRED)


def mode_of(candidates: Iterable[object]) -> str | None:
    for candidate in candidates:
        mode = getattr(candidate, MODE_ATTR, None)
        if mode in (EXEMPT, KEY_OPTIONAL, KEY_REQUIRED):
            return str(mode)
    return None


def view_mode(view_func: Any, method: str) -> str | None:
    """The mark that applies to this request: on the method handler (a
    class-based view's `post`, a viewset's action), the view function, or
    the view class; the most specific wins."""
    cls = getattr(view_func, "cls", None) or getattr(view_func, "view_class", None)
    candidates: list[object] = []
    if isinstance(cls, type):
        actions = getattr(view_func, "actions", None)
        name = actions.get(method.lower()) if isinstance(actions, Mapping) else method.lower()
        if name:
            candidates.append(getattr(cls, name, None))
    candidates += [view_func, cls]
    return mode_of(candidates)


__all__ = [
    "EXEMPT",
    "KEY_OPTIONAL",
    "KEY_REQUIRED",
    "idempotency_exempt",
    "idempotency_key_optional",
    "idempotency_key_required",
    "mode_of",
    "view_mode",
]
