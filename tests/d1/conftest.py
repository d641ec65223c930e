"""Fixtures of the D1 tests: one miniflare for the module that asks for it
(starting workerd costs about a second), and a fresh ledger in it per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from idemctl.storage import Store
from idemctl.storage.d1 import D1Engine

from .runtime import Runtime, start


@pytest.fixture(scope="module")
def runtime() -> Iterator[Runtime]:
    started = start()
    try:
        yield started
    finally:
        started.stop()


def wipe(runtime: Runtime) -> None:
    """Drop every table of the ledger, so each test starts from an empty D1."""
    engine = D1Engine(runtime.ledger_url, environ=runtime.env())
    try:
        for table in ("idemctl_fenced_out", "idemctl_schema_version", "idempotency_keys"):
            engine.write(f"DROP TABLE IF EXISTS {table}", {})
    finally:
        engine.close()


@pytest.fixture
def d1(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> Iterator[Runtime]:
    """The runtime with an empty database, its token and base URL in the environment."""
    wipe(runtime)
    runtime.faults(rateLimited=0, unavailable=0, delays=0, delayMs=0)
    for name, value in runtime.env().items():
        monkeypatch.setenv(name, value)
    yield runtime


@pytest.fixture
def d1_store(d1: Runtime) -> Iterator[Store]:
    store = Store(D1Engine(d1.ledger_url))
    try:
        yield store
    finally:
        store.close()
