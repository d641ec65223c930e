"""The example's settings: an orders API where every POST, PATCH and DELETE
honours its Idempotency-Key.

Read from the environment: ORDERS_DB (Django's database, default orders.db
here), IDEMCTL_DB (the idempotency ledger: a SQLite path or a
postgresql:// URL, default idempotency.db here), IDEMCTL_PENDING_TTL and
the rest of idemctl.config, IDEMCTL_REPLAYED_HEADER ("1" marks replays),
DJANGO_SECRET_KEY and DJANGO_DEBUG ("1").
"""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "demo-only-secret-key")
DEBUG = os.environ.get("DJANGO_DEBUG", "") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "rest_framework",
    "rest_framework.authtoken",
    "idemctl.django",
    "orders",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # After AuthenticationMiddleware, and last: the headers the middleware
    # above adds then go out with every answer, first or replayed.
    "idemctl.django.IdempotencyMiddleware",
]

IDEMCTL = {
    "LEDGER": os.environ.get("IDEMCTL_DB") or str(BASE_DIR / "idempotency.db"),
    "REPLAYED_HEADER": os.environ.get("IDEMCTL_REPLAYED_HEADER", "") == "1",
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["rest_framework.authentication.TokenAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
}

ROOT_URLCONF = "orders_site.urls"
WSGI_APPLICATION = "orders_site.wsgi.application"

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("ORDERS_DB") or str(BASE_DIR / "orders.db"),
        # Several gunicorn workers share the file: wait for its write lock.
        "OPTIONS": {"timeout": 20},
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
