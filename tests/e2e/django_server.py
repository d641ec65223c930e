"""A real gunicorn serving examples/django_project on 127.0.0.1 and an
ephemeral port. Before it starts, `manage.py migrate` creates Django's
database and the idempotency ledger (the example connects the ledger's
init to post_migrate), and two users with known API tokens are added."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from idemctl import Ledger

from .server import ServerProcess, gunicorn_command, listening

PROJECT = Path(__file__).resolve().parents[2] / "examples" / "django_project"
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
    name = "gunicorn"
    """Everything it writes (Django's database, the ledger, the log) lives under `workdir`."""

    def __init__(self, workdir: Path, *, workers: int = 4, preload: bool = False) -> None:
        self.place(workdir, workers=workers, log_name="gunicorn.log")
        self.preload = preload

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
        cmd = [*gunicorn_command(self.workers, PROJECT, preload=self.preload), "orders_site.wsgi"]
        ready = listening(self, _BOOTED, self.workers)
        self.launch(cmd, env=self._env(), cwd=self.workdir, timeout=timeout, ready=ready)
        return self

    # -- what the tests look at ------------------------------------------------------
    def ledger(self) -> Ledger:
        return Ledger.open(self.ledger_path, create=False)

    def user_id(self, username: str) -> str:
        return str(self.query("SELECT id FROM auth_user WHERE username = ?", username))
