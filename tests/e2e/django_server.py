"""A real gunicorn serving examples/django_project on 127.0.0.1 and an
ephemeral port. Before it starts, `manage.py migrate` creates Django's
database and the idempotency ledger (the example connects the ledger's
init to post_migrate), and two users with known API tokens are added."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import requests

from idemctl import Ledger

from .server import ServerProcess

PROJECT = Path(__file__).resolve().parents[2] / "examples" / "django_project"
_LISTENING = re.compile(r"Listening at: http://127\.0\.0\.1:(\d+)")
_BOOTED = re.compile(r"Booting worker with pid: (\d+)")

USERS = {"alice": "a" * 40, "bob": "b" * 40}  # username -> DRF token
PASSWORD = "correct horse"
_ADD_USERS = f"""
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
for name, key in {USERS!r}.items():
    Token.objects.create(user=User.objects.create_user(name, password={PASSWORD!r}), key=key)
"""


class DjangoGunicornServer(ServerProcess):
    orders_table = "orders_order"
    """Everything it writes (Django's database, the ledger, the log) lives under `workdir`."""

    def __init__(self, workdir: Path, *, workers: int = 4, preload: bool = False) -> None:
        self.workdir = workdir
        self.workers = workers
        self.preload = preload
        self.orders_path = workdir / "orders.db"
        self.ledger_path = workdir / "idempotency.db"
        self.log_path = workdir / "gunicorn.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("IDEMCTL_", "DJANGO_"))}
        env.update(ORDERS_DB=str(self.orders_path), IDEMCTL_DB=str(self.ledger_path), PYTHONUNBUFFERED="1")
        return env

    def _manage(self, *args: str) -> None:
        done = subprocess.run(
            [sys.executable, "manage.py", *args], cwd=PROJECT, env=self._env(), capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")

    def start(self, timeout: float = 40.0) -> DjangoGunicornServer:
        self._manage("migrate", "--no-input")
        self._manage("shell", "-c", _ADD_USERS)
        cmd = [
            sys.executable,
            "-m",
            "gunicorn",
            "--workers",
            str(self.workers),
            "--bind",
            "127.0.0.1:0",
            "--chdir",
            str(PROJECT),
            "--timeout",
            "60",
            "--graceful-timeout",
            "3",
            "--log-level",
            "info",
        ]
        if self.preload:
            cmd.append("--preload")
        cmd.append("orders_site.wsgi")
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self._env(), cwd=self.workdir)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log()
            match = _LISTENING.search(text)
            if match and len(_BOOTED.findall(text)) >= self.workers:
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
        return Ledger.open(self.ledger_path, create=False)

    def user_id(self, username: str) -> str:
        return str(self.query("SELECT id FROM auth_user WHERE username = ?", username))
