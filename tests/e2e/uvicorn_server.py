"""A real `uvicorn --workers N` serving tests/e2e/asgi_orders.py (the
FastAPI orders example) on 127.0.0.1, started and stopped by the tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from idemctl import Ledger, Policy
from tests.ports import free_port

from .server import ServerProcess

REPO = Path(__file__).resolve().parents[2]
_STARTED = re.compile(r"Application startup complete")


class UvicornServer(ServerProcess):
    stop_signal = signal.SIGINT

    def __init__(
        self, workdir: Path, *, workers: int = 4, pending_ttl: str = "30s", env: dict[str, str] | None = None
    ) -> None:
        self.workdir = workdir
        self.workers = workers
        self.pending_ttl = pending_ttl
        self.ledger_path = workdir / "idempotency.db"
        self.orders_path = workdir / "orders.db"
        self.hold_dir = workdir / "hold"
        self.log_path = workdir / "uvicorn.log"
        self.extra_env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = free_port()

    def start(self, timeout: float = 40.0) -> UvicornServer:
        self.hold_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(
            IDEMCTL_DB=str(self.ledger_path),
            IDEMCTL_PENDING_TTL=self.pending_ttl,
            ORDERS_DB=str(self.orders_path),
            TEST_HOLD_DIR=str(self.hold_dir),
            PYTHONUNBUFFERED="1",
            PYTHONPATH=str(REPO),
        )
        env.update(self.extra_env)
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
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(_STARTED.findall(self.log())) >= self.workers and self._healthy():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"uvicorn exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"uvicorn did not come up within {timeout} s:\n{self.log()}")

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/orders", headers={"X-Api-Key": "demo-key-A"}, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def ledger(self) -> Ledger:
        return Ledger.open(self.ledger_path, create=False, policy=Policy())
