"""A real Prometheus server (Debian's /usr/bin/prometheus) started by a test:
a temporary config and storage under the test's directory, a free port on
127.0.0.1, the shipped rules loaded, stopped by the test."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import requests

from tests.e2e.server import StartedProcess
from tests.helpers import skip_or_fail
from tests.ports import free_ports


def debian_prometheus_tool(name: str, needed_for: str) -> str:
    """A binary of Debian's `prometheus` package (`prometheus`, `promtool`):
    skips where it is missing, fails under CI (which installs it)."""
    found = f"/usr/bin/{name}" if os.path.exists(f"/usr/bin/{name}") else shutil.which(name)
    if found is None:
        skip_or_fail(
            f"{name} is not installed (Debian: apt-get install --no-install-recommends prometheus)", needed_for
        )
    return found


def prometheus_or_skip() -> str:
    """The server's binary; skips where it is missing, fails under CI (which installs it)."""
    return debian_prometheus_tool("prometheus", "CI scrapes a real application with Prometheus")


class PrometheusServer(StartedProcess):
    """A Prometheus server on a free port, its data and log under `workdir`,
    scraping `targets` and evaluating `rule_files`."""

    stop_signal = signal.SIGTERM
    name = "prometheus"
    health_path = "/-/ready"

    def __init__(self, binary: str, workdir: Path, *, targets: dict[str, str], rule_files: list[Path]) -> None:
        self.binary = binary
        self.workdir = workdir
        self.targets = targets  # job name: host:port
        self.rule_files = rule_files
        self.log_path = workdir / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None

    def _config(self) -> str:
        # Written as YAML by hand: flow style keeps it one readable block.
        lines = [
            "global:",
            "  scrape_interval: 1s",
            "  evaluation_interval: 1s",
            "rule_files:",
            *[f"  - {path}" for path in self.rule_files],
            "scrape_configs:",
        ]
        for job, target in self.targets.items():
            lines += [f"  - job_name: {job}", "    static_configs:", f"      - targets: ['{target}']"]
        return "\n".join(lines) + "\n"

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        (self.port,) = free_ports(1)
        config = self.workdir / "prometheus.yml"
        config.write_text(self._config(), encoding="utf-8")
        cmd = [
            self.binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        self.launch(cmd, cwd=self.workdir, timeout=timeout)
        return self

    # -- its HTTP API ----------------------------------------------------------------
    def _get(self, path: str, **params: str) -> Any:
        answer = requests.get(self.url + path, params=params, timeout=5)
        answer.raise_for_status()
        body = answer.json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> dict[tuple[tuple[str, str], ...], float]:
        """An instant query's vector: {sorted labels: value}."""
        data = self._get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", data
        return {tuple(sorted(item["metric"].items())): float(item["value"][1]) for item in data["result"]}

    def alerts(self) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/alerts")["alerts"])

    def rule_groups(self) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/rules")["groups"])

    def targets_up(self) -> list[dict[str, Any]]:
        return [t for t in self._get("/api/v1/targets")["activeTargets"] if t["health"] == "up"]
