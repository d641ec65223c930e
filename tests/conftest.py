"""Shared fixtures. `ledger_target` is parametrised over the storage backends
so that backend-independent tests run against every one of them."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator

import pytest

from idemctl import Ledger, Policy

BACKENDS = ["sqlite"]


class FakeClock:
    """A virtual clock in integer milliseconds, moved by hand."""

    def __init__(self, start: int = 1_700_000_000_000) -> None:
        self.now = start

    def __call__(self) -> int:
        return self.now

    def advance(self, ms: int) -> int:
        self.now += ms
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def ledger_target(backend_name: str, tmp_path) -> Iterator[str]:
    """Where a fresh, empty ledger lives for this test (a path or a URL)."""
    if backend_name == "sqlite":
        yield str(tmp_path / "ledger.db")
    else:  # pragma: no cover - extended by the PostgreSQL backend
        raise AssertionError(backend_name)


@pytest.fixture
def make_ledger(ledger_target: str, clock: FakeClock) -> Iterator[Callable[..., Ledger]]:
    """Open (and init) ledgers on this test's target; all are closed afterwards."""
    opened: list[Ledger] = []

    def factory(*, policy: Policy | None = None, clock_fn: Callable[[], int] | None = None, init: bool = True, **kw: object) -> Ledger:
        ledger = Ledger.open(ledger_target, policy=policy, clock=clock_fn or clock, **kw)  # type: ignore[arg-type]
        opened.append(ledger)
        if init:
            ledger.init()
        return ledger

    yield factory
    for ledger in opened:
        ledger.close()


@pytest.fixture
def ledger(make_ledger: Callable[..., Ledger]) -> Ledger:
    return make_ledger()


SHARED = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "shared"))


@contextlib.contextmanager
def read_only_file(path: str | os.PathLike[str]) -> Iterator[None]:
    """Make a file truly read-only for root too (chattr +i), or skip with the reason."""
    path = os.fspath(path)
    done = subprocess.run(["chattr", "+i", path], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot make {path} immutable here: {done.stderr.strip() or 'chattr failed'}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", path], check=False)
