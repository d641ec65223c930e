"""The D1 tests' runtime: miniflare (workerd) serving the recipe's Worker and
a stand-in for D1's HTTP API over ONE D1 database (runtime/serve.mjs), in a
temporary directory on a free loopback port. `npm ci` in tests/d1/runtime
installs it (.ci/run does)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
RUNTIME = HERE / "runtime"
TOKEN = "test-token-9b1c0d"
ACCOUNT = "0123456789abcdef0123456789abcdef"
DATABASE = "5a1e2f7c-0000-4000-8000-00000000d1d1"


def unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"CI runs the D1 tests: {reason}", pytrace=False)
    pytest.skip(reason)


@dataclass
class Runtime:
    """A running miniflare: `url` serves the recipe's Worker, `base` is the
    API's base URL for CLOUDFLARE_BASE_URL, `sqlite` the D1 database's file."""

    url: str
    sqlite: str
    process: subprocess.Popen[str]
    state: str

    @property
    def base(self) -> str:
        return self.url.rstrip("/") + "/client/v4"

    @property
    def ledger_url(self) -> str:
        return f"d1://{ACCOUNT}/{DATABASE}"

    def env(self, token: str = TOKEN) -> dict[str, str]:
        return {"CLOUDFLARE_API_TOKEN": token, "CLOUDFLARE_BASE_URL": self.base}

    def faults(self, **settings: Any) -> dict[str, Any]:
        """Set what the stand-in's next calls suffer (its test hook)."""
        request = urllib.request.Request(
            self.url.rstrip("/") + "/__faults", data=json.dumps(settings).encode(), method="POST"
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            return dict(json.load(answer))

    def post(
        self, path: str, body: bytes, *, key: str | None, principal: str = "acct_1", timeout: float = 20
    ) -> tuple[int, dict[str, str], bytes]:
        """A request to the recipe's Worker."""
        headers = {"x-principal": principal, "content-type": "application/json"}
        if key is not None:
            headers["idempotency-key"] = key
        request = urllib.request.Request(self.url.rstrip("/") + path, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                return answer.status, {k.lower(): v for k, v in answer.headers.items()}, answer.read()
        except urllib.error.HTTPError as error:
            return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()

    def stop(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.state, ignore_errors=True)


def start() -> Runtime:
    node = shutil.which("node")
    if node is None:
        unavailable("node is not installed")
    if not (RUNTIME / "node_modules" / "miniflare").is_dir():
        unavailable("the D1 runtime is not installed: run `npm ci` in tests/d1/runtime")
    state = tempfile.mkdtemp(prefix="idemctl-d1-")
    process = subprocess.Popen(
        [str(node), str(RUNTIME / "serve.mjs"), state, TOKEN, ACCOUNT, DATABASE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(os.path.join(state, "miniflare.log"), "w"),
        text=True,
        cwd=RUNTIME,
    )
    assert process.stdout is not None
    deadline = time.monotonic() + 60
    line = ""
    while time.monotonic() < deadline and not line:
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            break
    if not line:
        process.kill()
        log = Path(state, "miniflare.log").read_text(errors="replace")[-2000:]
        shutil.rmtree(state, ignore_errors=True)
        unavailable(f"miniflare did not start: {log}")
    ready = json.loads(line)
    return Runtime(ready["url"], ready["sqlite"], process, state)


def wipe(runtime: Runtime) -> None:
    """Drop the ledger's tables and clear the stand-in's faults, so a test
    starts from an empty D1 database."""
    from idemctl.storage.d1 import D1Engine

    runtime.faults(rateLimited=0, unavailable=0, delays=0, delayMs=0)
    engine = D1Engine(runtime.ledger_url, environ=runtime.env())
    try:
        for table in ("idemctl_fenced_out", "idemctl_schema_version", "idempotency_keys"):
            engine.write(f"DROP TABLE IF EXISTS {table}", {})
    finally:
        engine.close()
