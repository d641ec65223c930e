"""Django and Django REST framework: the Idempotency-Key contract for views.

`IdempotencyMiddleware` protects every view of a project. Its principal is
the primary key of the user Django's `AuthenticationMiddleware` resolved
(anonymous requests get the contract's 401), or whatever the callable
named by ``IDEMCTL["PRINCIPAL"]`` returns. DRF authenticates inside the
view (token, JWT, ...), after every middleware has run, so a DRF view adds
`IdempotencyMixin` instead: the key is claimed after DRF's authentication,
permission and throttle checks, with DRF's user as the principal. The
middleware leaves views that use the mixin to it.

Everything is configured in one settings dict, ``settings.IDEMCTL``
(:mod:`idemctl.django.conf`). Answers are the WSGI middleware's, byte for
byte: the app's response (streamed or not) is collected whole, stored, and
the answer built from what was stored is sent. Needs the `django` extra.

The modules, each for one job: `conf` (the settings, the per-process
ledger), `marks` (the per-view marks), `exchange` (one request's body,
decision, capture and answer), `middleware`, `drf` (the mixin), `apps`
(the AppConfig, for ``"idemctl.django"`` in ``INSTALLED_APPS``).
"""

from __future__ import annotations

from .conf import Config, current_config, init_ledger, user_principal
from .drf import IdempotencyMixin
from .exchange import answer_response
from .marks import (
    EXEMPT,
    KEY_OPTIONAL,
    KEY_REQUIRED,
    idempotency_exempt,
    idempotency_key_optional,
    idempotency_key_required,
)
from .middleware import IdempotencyMiddleware

__all__ = [
    "EXEMPT",
    "KEY_OPTIONAL",
    "KEY_REQUIRED",
    "Config",
    "IdempotencyMiddleware",
    "IdempotencyMixin",
    "answer_response",
    "current_config",
    "idempotency_exempt",
    "idempotency_key_optional",
    "idempotency_key_required",
    "init_ledger",
    "user_principal",
]
