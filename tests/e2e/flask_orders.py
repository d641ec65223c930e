"""examples/flask_app.py as the gunicorn end-to-end tests serve it, plus the
test scaffolding the example itself must not carry:

- a hold: when the file $TEST_HOLD_DIR/<Idempotency-Key> exists, the next
  attempt with that key stops inside the mutation (before the orders
  database is touched), renames the file to <key>.<pid>.held so the test
  learns the worker, and waits until the test deletes it (or kills the
  worker); the rename is atomic, so exactly one attempt is held;
- one log line per process that has loaded the app ("orders app loaded"),
  which is when a gunicorn worker can serve: the harness waits for these.
"""

from __future__ import annotations

import logging
import os

import sqlite_utils
from flask import request

import examples.flask_app as example
from tests.e2e.server import hold_here

HOLD_DIR = os.environ.get("TEST_HOLD_DIR") or None
_orders_db = example.orders_db


def held_orders_db() -> sqlite_utils.Database:
    hold_here(HOLD_DIR, request.headers.get("Idempotency-Key", ""))
    return _orders_db()


example.orders_db = held_orders_db  # the views look it up at call time
app = example.app

if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    # As docs/observability.md shows a user: count the ledger's decisions in
    # every worker, serve all workers' values from any one of them.
    from flask import Response
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from idemctl.prometheus import instrument, multiprocess_registry

    instrument(example.ledger)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(multiprocess_registry()), content_type=CONTENT_TYPE_LATEST)


# gunicorn's own logger (silent outside gunicorn).
logging.getLogger("gunicorn.error").info("orders app loaded (pid %d)", os.getpid())
