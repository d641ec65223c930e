"""What the end-to-end harnesses share: a server process started by a test,
its log, its shutdown, and the hold files that stall one attempt of a
mutation (see tests/e2e/flask_orders.py and asgi_orders.py)."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import requests


class StartedProcess:
    """A server process a test started on 127.0.0.1, its output in
    `log_path`: started by `launch`, which waits until it is up, and
    stopped with `stop_signal` (then killed) by `stop()` or ``with``."""

    stop_signal = signal.SIGQUIT  # gunicorn's quick shutdown: the master takes its workers down
    name = "the server"
    health_path = "/healthz"

    workdir: Path
    log_path: Path
    port: int | None
    proc: subprocess.Popen[bytes] | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 40.0) -> Any:
        raise NotImplementedError

    def launch(
        self,
        cmd: Sequence[str],
        *,
        cwd: Path,
        timeout: float,
        env: dict[str, str] | None = None,
        ready: Callable[[str], bool] = lambda log: True,
    ) -> None:
        """Run `cmd` and return once `ready(log)` holds and the server
        answers its health check; raise with the log if it exits first
        or is not up within `timeout` seconds."""
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready(self.log()) and self._healthy():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.name} did not come up within {timeout} s:\n{self.log()}")

    def _healthy(self) -> bool:
        try:
            return requests.get(self.url + self.health_path, timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(self.stop_signal)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def gunicorn_command(workers: int, chdir: Path, *, preload: bool) -> list[str]:
    """gunicorn on 127.0.0.1 and a port it picks, `workers` processes,
    quick to stop: what each gunicorn the tests start runs with."""
    cmd = [sys.executable, "-m", "gunicorn", "--workers", str(workers), "--bind", "127.0.0.1:0"]
    cmd += ["--chdir", str(chdir), "--timeout", "60", "--graceful-timeout", "3", "--log-level", "info"]
    return [*cmd, "--preload"] if preload else cmd


# gunicorn's master names the port it bound (the tests bind port 0).
_LISTENING = re.compile(r"Listening at: http://127\.0\.0\.1:(\d+)")


def listening(server: StartedProcess, worker_line: re.Pattern[str], workers: int) -> Callable[[str], bool]:
    """gunicorn's readiness, for `launch`: its master has bound a port (now
    the server's) and `workers` lines of `worker_line` are in its log."""

    def ready(log: str) -> bool:
        match = _LISTENING.search(log)
        if match is None or len(worker_line.findall(log)) < workers:
            return False
        server.port = int(match.group(1))
        return True

    return ready


class ServerProcess(StartedProcess):
    """An app server the test started: subclasses `place()` its files, start
    it (`start()`, through `launch`) and may use `hold_dir`."""

    orders_table = "orders"

    orders_path: Path
    hold_dir: Path
    ledger_path: Path
    workers: int

    def place(self, workdir: Path, *, workers: int, log_name: str) -> None:
        """Everything the server writes (ledger, orders database, hold
        files, log) under `workdir`; not started yet."""
        self.workdir, self.workers = workdir, workers
        self.ledger_path = workdir / "idempotency.db"
        self.orders_path = workdir / "orders.db"
        self.hold_dir = workdir / "hold"
        self.log_path = workdir / log_name
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None

    def app_env(self, **more: str) -> dict[str, str]:
        """This environment, pointing the served app at its files."""
        self.hold_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(IDEMCTL_DB=str(self.ledger_path), ORDERS_DB=str(self.orders_path), TEST_HOLD_DIR=str(self.hold_dir))
        return {**env, "PYTHONUNBUFFERED": "1", **more}

    # -- what the tests look at ------------------------------------------------------
    def query(self, sql: str, *args: object) -> int:
        conn = sqlite3.connect(self.orders_path, timeout=10)
        try:
            return int(conn.execute(sql, args).fetchone()[0])
        finally:
            conn.close()

    def count_orders(self, sku: str) -> int:
        return self.query(f"SELECT count(*) FROM {self.orders_table} WHERE sku = ?", sku)

    def hold(self, key: str) -> None:
        """The next attempt with this Idempotency-Key stalls inside the mutation."""
        (self.hold_dir / key).touch()

    def held_pid(self, key: str, timeout: float = 15.0) -> int:
        """The pid of the worker stalled on `key`, once it is there."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = list(self.hold_dir.glob(f"{key}.*.held"))
            if found:
                return int(found[0].name.rsplit(".", 2)[1])
            time.sleep(0.01)
        raise AssertionError(f"no worker reached the mutation for {key} within {timeout} s:\n{self.log()}")

    def release(self, key: str, pid: int) -> None:
        (self.hold_dir / f"{key}.{pid}.held").unlink()


HOLD_LIMIT_S = 60.0


def hold_here(hold_dir: str | None, idempotency_key: str) -> None:
    """Inside a served app: if the test created `<hold_dir>/<key>`, rename it
    to `<key>.<pid>.held` (atomic: exactly one attempt is held, and the test
    learns the worker) and wait until the test deletes it or kills us."""
    key = re.sub(r"[^A-Za-z0-9_.-]", "_", idempotency_key)
    if hold_dir is None or not key:
        return
    held = os.path.join(hold_dir, f"{key}.{os.getpid()}.held")
    try:
        os.rename(os.path.join(hold_dir, key), held)
    except FileNotFoundError:
        return
    deadline = time.monotonic() + HOLD_LIMIT_S
    while os.path.exists(held) and time.monotonic() < deadline:
        time.sleep(0.01)
