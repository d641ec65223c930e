"""Adapter tests: WSGI, ASGI, FastAPI, Django/DRF, Flask, each through the
one gate; `django_site` configures Django once for all of them."""

from __future__ import annotations

# A support module, not tests (and --doctest-modules would import it).
collect_ignore = ["django_site.py"]
