"""The Django app: ``"idemctl.django"`` in ``INSTALLED_APPS`` (label
``idemctl``; no models, no migrations). Its `ready` connects, once Django
has loaded, the receiver by which the middleware learns that a view raised.
The middleware connects it as well when Django builds it, so a project
that only lists the middleware behaves the same."""

from __future__ import annotations

from django.apps import AppConfig

from .middleware import watch_exceptions


class IdempotencyConfig(AppConfig):  # type: ignore[misc]  # Django ships no type information
    name = "idemctl.django"
    label = "idemctl"
    verbose_name = "idemctl"

    def ready(self) -> None:
        watch_exceptions()


__all__ = ["IdempotencyConfig"]
