"""A real `uvicorn --workers N` serving tests/e2e/asgi_orders.py (the
FastAPI orders example) on 127.0.0.1, started and stopped by the tests."""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import httpx

from idemctl import Ledger, Policy
from tests.ports import free_port

from .server import ServerProcess

REPO = Path(__file__).resolve().parents[2]
_STARTED = re.compile(r"Application startup complete")


class UvicornServer(ServerProcess):
    stop_signal = signal.SIGINT
    name = "uvicorn"

    def __init__(
        self, workdir: Path, *, workers: int = 4, pending_ttl: str = "30s", env: dict[str, str] | None = None
    ) -> None:
        self.place(workdir, workers=workers, log_name="uvicorn.log")
        self.pending_ttl = pending_ttl
        self.extra_env = env or {}
        self.port = free_port()

    def start(self, timeout: float = 40.0) -> UvicornServer:
        env = self.app_env(IDEMCTL_PENDING_TTL=self.pending_ttl, PYTHONPATH=str(REPO), **self.extra_env)
        cmd = [
            sys.executable,
            "-m",
            "uvicorn",
            "tests.e2e.asgi_orders:app",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            str(self.workers),
            "--timeout-graceful-shutdown",
            "3",
            "--log-level",
            "info",
        ]
        ready = lambda log: len(_STARTED.findall(log)) >= self.workers  # noqa: E731
        self.launch(cmd, env=env, cwd=REPO, timeout=timeout, ready=ready)
        return self

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/orders", headers={"X-Api-Key": "demo-key-A"}, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def ledger(self) -> Ledger:
        return Ledger.open(self.ledger_path, create=False, policy=Policy())
