"""The shipped monitoring files are checked with Prometheus's own promtool
(Debian's `prometheus` package): skipped where it is missing, a failure under
CI, which installs it (.ci/run)."""

from __future__ import annotations

import os
import shutil

import pytest


@pytest.fixture(scope="session")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        reason = "promtool is not installed (Debian: apt-get install --no-install-recommends prometheus)"
        if os.environ.get("CI"):
            pytest.fail(f"CI checks the Prometheus rules with promtool: {reason}", pytrace=False)
        pytest.skip(reason)
    return found
