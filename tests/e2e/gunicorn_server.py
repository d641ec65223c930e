"""A real gunicorn in front of examples/flask_app.py (as tests/e2e/flask_orders.py
serves it), on 127.0.0.1 and an
ephemeral port, started and stopped by the tests that use it."""

from __future__ import annotations

import re
from pathlib import Path

from idemctl import Ledger, Policy

from .server import ServerProcess, gunicorn_command, listening

REPO = Path(__file__).resolve().parents[2]
_LOADED = re.compile(r"orders app loaded \(pid (\d+)\)")  # logged by tests/e2e/flask_orders.py


def _has_option(flag: str) -> bool:
    from gunicorn.config import KNOWN_SETTINGS

    return any(flag in (getattr(s, "cli", None) or ()) for s in KNOWN_SETTINGS)


class GunicornServer(ServerProcess):
    """gunicorn serving the example orders API. Everything it writes (ledger,
    orders database, hold files, log) lives under `workdir`."""

    name = "gunicorn"

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
        self.place(workdir, workers=workers, log_name="gunicorn.log")
        self.threads = threads
        self.preload = preload
        self.pending_ttl_ms = pending_ttl_ms
        self.extra_env = env or {}
        self.metrics_dir = workdir / "prometheus" if metrics else None

    def start(self, timeout: float = 30.0) -> GunicornServer:
        with Ledger.open(self.ledger_path) as ledger:
            ledger.init()
        env = self.app_env(IDEMCTL_PENDING_TTL=f"{self.pending_ttl_ms}ms", **self.extra_env)
        if self.metrics_dir is not None:
            self.metrics_dir.mkdir(parents=True, exist_ok=True)
            env["PROMETHEUS_MULTIPROC_DIR"] = str(self.metrics_dir)
        cmd = [*gunicorn_command(self.workers, REPO, preload=self.preload), "--access-logfile", "-"]
        if self.threads > 1:
            cmd += ["--threads", str(self.threads)]
        if self.metrics_dir is not None:
            cmd += ["--config", str(REPO / "tests" / "e2e" / "gunicorn_metrics_conf.py")]
        if _has_option("--no-control-socket"):
            cmd.append("--no-control-socket")  # several servers may run at once
        cmd.append("tests.e2e.flask_orders:app")
        # Every worker has imported the app (with --preload the master did,
        # once): a worker that fails to boot fails here, with the log.
        loaded = 1 if self.preload else self.workers
        self.launch(cmd, env=env, cwd=self.workdir, timeout=timeout, ready=listening(self, _LOADED, loaded))
        return self

    # -- what the tests look at ------------------------------------------------------
    def ledger(self) -> Ledger:
        """The server's ledger, seen with the server's own policy."""
        return Ledger.open(self.ledger_path, create=False, policy=Policy(pending_ttl_ms=self.pending_ttl_ms))

    def count_attachments(self, order_id: int) -> int:
        return self.query("SELECT count(*) FROM attachments WHERE order_id = ?", order_id)
