"""End-to-end tests: real servers (gunicorn, uvicorn, Django's runserver),
worker processes, Redis, a PostgreSQL failover. The modules here that are
not tests are the apps and servers those tests start."""

from __future__ import annotations

from pathlib import Path

# The suite runs with --doctest-modules; the apps start servers' apps on import.
collect_ignore = [p.name for p in Path(__file__).parent.glob("*.py") if not p.name.startswith(("test_", "conftest"))]
