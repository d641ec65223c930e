"""What the end-to-end harnesses share: a server process started by a test,
its log, its shutdown, and the hold files that stall one attempt of a
mutation (see tests/e2e/flask_orders.py and asgi_orders.py)."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any


class ServerProcess:
    """A server the test started; subclasses set `workdir`, `log_path`,
    `orders_path`, `port` and start it (`start()`), and may use `hold_dir`."""

    stop_signal = signal.SIGQUIT  # gunicorn's quick shutdown: the master takes its workers down
    orders_table = "orders"

    workdir: Path
    log_path: Path
    orders_path: Path
    hold_dir: Path
    port: int | None
    proc: subprocess.Popen[bytes] | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 40.0) -> Any:
        raise NotImplementedError

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
