"""Fixtures of the D1 tests: the session's miniflare (tests/conftest.py's
`d1_runtime`) with an empty database per test, its token and base URL in the
environment."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from idemctl.storage import Store
from idemctl.storage.d1 import D1Engine

from .runtime import Runtime, wipe


@pytest.fixture
def runtime(d1_runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> Iterator[Runtime]:
    """The runtime with an empty database, its token and base URL in the environment."""
    wipe(d1_runtime)
    for name, value in d1_runtime.env().items():
        monkeypatch.setenv(name, value)
    yield d1_runtime


@pytest.fixture
def d1_store(runtime: Runtime) -> Iterator[Store]:
    store = Store(D1Engine(runtime.ledger_url))
    try:
        yield store
    finally:
        store.close()
