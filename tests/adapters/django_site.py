"""Django inside the test process.

Django's settings can be configured once per process, so every in-process
Django test shares this configuration: an in-memory database holding the
auth and DRF token tables, and a project's middleware with idemctl's last.
A `Site` serves one test's URL patterns with its own ``IDEMCTL`` settings
through Django's test client; it installs both before each of its
requests, so sites never see each other's ledger."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import django
from django import conf  # not `settings`: doctest collection would touch the unconfigured lazy object

SETTINGS: dict[str, Any] = {
    "DEBUG": False,
    "SECRET_KEY": "idemctl-tests",
    "ALLOWED_HOSTS": ["testserver"],
    "ROOT_URLCONF": "tests.adapters.django_site",
    "INSTALLED_APPS": [
        "django.contrib.auth",
        "django.contrib.contenttypes",
        "django.contrib.sessions",
        "rest_framework",
        "rest_framework.authtoken",
        "idemctl.django",
    ],
    # No middleware that adds headers of its own: the contract table compares
    # every header of an answer with the WSGI middleware's.
    "MIDDLEWARE": [
        "django.contrib.sessions.middleware.SessionMiddleware",
        "django.middleware.csrf.CsrfViewMiddleware",
        "django.contrib.auth.middleware.AuthenticationMiddleware",
        "idemctl.django.IdempotencyMiddleware",
    ],
    # Shared between the test's threads; Django keeps an in-memory database open.
    "DATABASES": {
        "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "file:idemctl-tests?mode=memory&cache=shared"}
    },
    "DEFAULT_AUTO_FIELD": "django.db.models.AutoField",
    "USE_TZ": True,
    "PASSWORD_HASHERS": ["django.contrib.auth.hashers.MD5PasswordHasher"],
    "REST_FRAMEWORK": {"DEFAULT_AUTHENTICATION_CLASSES": ["rest_framework.authentication.TokenAuthentication"]},
}

urlpatterns: list[Any] = []  # each Site brings its own
_ready = False
_names = itertools.count(1)


def setup() -> None:
    """Configure Django for this process and create its tables, once."""
    global _ready
    if _ready:
        return
    if not conf.settings.configured:
        conf.settings.configure(**SETTINGS)
    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)
    _ready = True


def make_user(prefix: str = "user") -> Any:
    """A new user with a unique name (the database lives as long as the process)."""
    setup()
    from django.contrib.auth.models import User

    return User.objects.create_user(f"{prefix}-{next(_names)}", password="pw")


def token_for(user: Any) -> str:
    from rest_framework.authtoken.models import Token

    return str(Token.objects.create(user=user).key)


class _Urls:
    """A URLconf object (hashable, unlike a list, as Django's resolver cache needs)."""

    def __init__(self, patterns: Iterable[Any]) -> None:
        self.urlpatterns = list(patterns)


class Site:
    def __init__(self, urlpatterns: Iterable[Any], idemctl: Mapping[str, Any], **client_options: Any) -> None:
        setup()
        from django.test import Client

        self.urls = _Urls(urlpatterns)
        self.idemctl = dict(idemctl)
        self.client = Client(**client_options)

    def install(self) -> None:
        conf.settings.ROOT_URLCONF = self.urls
        conf.settings.IDEMCTL = self.idemctl

    def request(
        self, method: str, path: str, body: bytes = b"", headers: Mapping[str, str] | None = None, **environ: Any
    ) -> Any:
        self.install()
        content_type = "application/octet-stream"
        extra: dict[str, Any] = {}
        for name, value in (headers or {}).items():
            if name.lower() == "content-type":
                content_type = value
            else:
                extra["HTTP_" + name.upper().replace("-", "_")] = value
        extra.update(environ)
        return self.client.generic(method, path, data=body, content_type=content_type, **extra)

    def post(self, path: str, body: bytes = b"{}", *, key: str | None = "k-1", **headers: str) -> Any:
        sent = {"Content-Type": "application/json", **{k.replace("_", "-"): v for k, v in headers.items()}}
        if key is not None:
            sent["Idempotency-Key"] = key
        return self.request("POST", path, body, sent)


def wire(response: Any) -> tuple[int, str, list[tuple[str, str]], bytes]:
    """Everything of a Django test response that goes on the wire."""
    return response.status_code, response.reason_phrase, list(response.items()), response.content
