"""Fixtures of the D1 tests: the session's miniflare (tests/conftest.py's
`d1_runtime`) with an empty database per test, its token and base URL in the
environment."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from idemctl.storage import Store
from idemctl.storage.d1 import D1Engine

from .runtime import Runtime, wipe

# The module that runs the ledger's contract tests again on D1, by importing them.
CONTRACT_ON_D1 = "test_contract_on_d1.py"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The contract tests imported into CONTRACT_ON_D1 run there on D1 only:
    the imported tests that name their own engines, or none, already ran in
    their own modules."""
    elsewhere = [
        item
        for item in items
        if item.path.name == CONTRACT_ON_D1
        and getattr(getattr(item, "callspec", None), "params", {}).get("backend_name") != "d1"
    ]
    if elsewhere:
        config.hook.pytest_deselected(items=elsewhere)
        items[:] = [item for item in items if item not in elsewhere]


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
