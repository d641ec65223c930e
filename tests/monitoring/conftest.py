"""The shipped monitoring files are checked with Prometheus's own promtool
(Debian's `prometheus` package): skipped where it is missing, a failure under
CI, which installs it (.ci/run)."""

from __future__ import annotations

import pytest

from tests.monitoring.prometheus_server import debian_prometheus_tool


@pytest.fixture(scope="session")
def promtool() -> str:
    return debian_prometheus_tool("promtool", "CI checks the Prometheus rules with promtool")
