"""CLI tests: every one runs as on a machine with no IDEMCTL_* settings and
no NO_COLOR, in its own empty folder. A module that sets TERMINAL_COLUMNS
runs on a terminal that wide (--help and tables are wrapped to it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import clean_env


@pytest.fixture(autouse=True)
def cli_environment(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env(monkeypatch, tmp_path, columns=getattr(request.module, "TERMINAL_COLUMNS", None))
    monkeypatch.delenv("NO_COLOR", raising=False)
