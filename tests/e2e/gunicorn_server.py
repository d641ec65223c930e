"""A real gunicorn in front of examples/flask_app.py (as tests/e2e/flask_orders.py
serves it), on 127.0.0.1 and an
ephemeral port, started and stopped by the tests that use it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import requests

from idemctl import Ledger, Policy

from .server import ServerProcess

REPO = Path(__file__).resolve().parents[2]
_LISTENING = re.compile(r"Listening at: http://127\.0\.0\.1:(\d+)")
_LOADED = re.compile(r"orders app loaded \(pid (\d+)\)")  # logged by tests/e2e/flask_orders.py


def _has_option(flag: str) -> bool:
    from gunicorn.config import KNOWN_SETTINGS

    return any(flag in (getattr(s, "cli", None) or ()) for s in KNOWN_SETTINGS)


class GunicornServer(ServerProcess):
    """gunicorn serving the example orders API. Everything it writes (ledger,
    orders database, hold files, log) lives under `workdir`."""

    def __init__(
        self,
        workdir: Path,
        *,
        workers: int = 4,
        threads: int = 1,
        preload: bool = False,
        pending_ttl_ms: int = 30_000,
        env: dict[str, str] | None = None,
        metrics: bool = False,
    ) -> None:
        self.workdir = workdir
        self.workers = workers
        self.threads = threads
        self.preload = preload
        self.pending_ttl_ms = pending_ttl_ms
        self.ledger_path = workdir / "idempotency.db"
        self.orders_path = workdir / "orders.db"
        self.hold_dir = workdir / "hold"
        self.log_path = workdir / "gunicorn.log"
        self.extra_env = env or {}
        self.metrics_dir = workdir / "prometheus" if metrics else None
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None

    def start(self, timeout: float = 30.0) -> GunicornServer:
        self.hold_dir.mkdir(parents=True, exist_ok=True)
        with Ledger.open(self.ledger_path) as ledger:
            ledger.init()
        env = dict(os.environ)
        env.update(
            IDEMCTL_DB=str(self.ledger_path),
            ORDERS_DB=str(self.orders_path),
            TEST_HOLD_DIR=str(self.hold_dir),
            IDEMCTL_PENDING_TTL=f"{self.pending_ttl_ms}ms",
            PYTHONUNBUFFERED="1",
        )
        env.update(self.extra_env)
        if self.metrics_dir is not None:
            self.metrics_dir.mkdir(parents=True, exist_ok=True)
            env["PROMETHEUS_MULTIPROC_DIR"] = str(self.metrics_dir)
        cmd = [
            sys.executable,
            "-m",
            "gunicorn",
            "--workers",
            str(self.workers),
            "--bind",
            "127.0.0.1:0",
            "--chdir",
            str(REPO),
            "--timeout",
            "60",
            "--graceful-timeout",
            "3",
            "--log-level",
            "info",
            "--access-logfile",
            "-",
        ]
        if self.threads > 1:
            cmd += ["--threads", str(self.threads)]
        if self.preload:
            cmd.append("--preload")
        if self.metrics_dir is not None:
            cmd += ["--config", str(REPO / "tests" / "e2e" / "gunicorn_metrics_conf.py")]
        if _has_option("--no-control-socket"):
            cmd.append("--no-control-socket")  # several servers may run at once
        cmd.append("tests.e2e.flask_orders:app")
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log()
            match = _LISTENING.search(text)
            # Every worker has imported the app (with --preload the master
            # did, once): a worker that fails to boot fails here, with the log.
            if match and len(_LOADED.findall(text)) >= (1 if self.preload else self.workers):
                self.port = int(match.group(1))
                if self._healthy():
                    return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"gunicorn did not come up within {timeout} s:\n{self.log()}")

    def _healthy(self) -> bool:
        try:
            return requests.get(self.url + "/healthz", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    # -- what the tests look at ------------------------------------------------------
    def ledger(self) -> Ledger:
        """The server's ledger, seen with the server's own policy."""
        return Ledger.open(self.ledger_path, create=False, policy=Policy(pending_ttl_ms=self.pending_ttl_ms))

    def count_attachments(self, order_id: int) -> int:
        return self.query("SELECT count(*) FROM attachments WHERE order_id = ?", order_id)
