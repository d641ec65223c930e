"""The two edges on PostgreSQL: the middleware fails closed (503, app not
called) when the server cannot be reached, and the CLI answers a bad URL, a
refused connection or an unknown role with one line on stderr, exit 2, no
traceback and no password."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

psycopg = pytest.importorskip("psycopg")

from idemctl import Ledger  # noqa: E402
from idemctl.storage.postgres import PostgresEngine  # noqa: E402
from tests.helpers import ROOT  # noqa: E402

# Only this engine's half: these checks mean nothing on the others.
pytestmark = pytest.mark.engines("postgres")

SECRET = "s3cr3t-Pa55"


def post(app, key: str, body: bytes = b'{"sku":"x"}') -> tuple[str, dict[str, str], bytes]:
    environ = {
        "REQUEST_METHOD": "POST",
        "SCRIPT_NAME": "",
        "PATH_INFO": "/orders",
        "QUERY_STRING": "",
        "SERVER_NAME": "test",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(body)),
        "HTTP_IDEMPOTENCY_KEY": key,
        "wsgi.input": io.BytesIO(body),
        "wsgi.errors": io.StringIO(),
        "wsgi.url_scheme": "http",
        "wsgi.version": (1, 0),
        "wsgi.multithread": True,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
    }
    seen: dict[str, object] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: object = None) -> None:
        seen["status"], seen["headers"] = status, {k.lower(): v for k, v in headers}

    result = app(environ, start_response)
    try:
        body_out = b"".join(result)
    finally:
        getattr(result, "close", lambda: None)()
    return seen["status"], seen["headers"], body_out  # type: ignore[return-value]


def test_middleware_on_an_unreachable_server_answers_503_and_never_runs_the_app() -> None:
    wsgi = pytest.importorskip("idemctl.wsgi")
    calls: list[str] = []

    def app(environ, start_response):
        calls.append(environ["PATH_INFO"])
        start_response("201 Created", [("Content-Type", "application/json")])
        return [b'{"id":1}']

    ledger = Ledger.open(f"postgresql://app:{SECRET}@127.0.0.1:1/payments")
    wrapped = wsgi.IdempotencyMiddleware(app, ledger, principal=lambda env: "acct_1")
    status, headers, body = post(wrapped, "k-1")
    assert status.startswith("503 ")
    assert headers["retry-after"].isdigit() and int(headers["retry-after"]) >= 1
    assert json.loads(body)["error"] == "idempotency_ledger_unavailable"
    assert calls == []
    ledger.close()


def test_middleware_on_postgres_runs_once_and_replays(ledger: Ledger) -> None:
    wsgi = pytest.importorskip("idemctl.wsgi")
    calls: list[bytes] = []

    def app(environ, start_response):
        calls.append(environ["wsgi.input"].read())
        start_response("201 Created", [("Content-Type", "application/json"), ("Location", "/orders/7")])
        return [b'{"id":7}']

    wrapped = wsgi.IdempotencyMiddleware(app, ledger, principal=lambda env: "acct_1")
    first = post(wrapped, "k-1")
    again = post(wrapped, "k-1")
    assert first[0] == again[0] == "201 Created"
    assert first[2] == again[2] == b'{"id":7}'
    assert first[1]["location"] == again[1]["location"] == "/orders/7"
    assert calls == [b'{"sku":"x"}']


def idemctl(*args: str) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("idemctl.cli")
    return subprocess.run([sys.executable, "-m", "idemctl", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            f"postgresql://app:{SECRET}@127.0.0.1:5432/payments?bogus=1",
            'bad PostgreSQL URL: invalid URI query parameter: "bogus"',
        ),
        (
            f"postgresql://app:{SECRET}@127.0.0.1:1/payments",
            "cannot reach PostgreSQL at postgresql://app@127.0.0.1:1/payments: Connection refused",
        ),
        (f"postgresql://nobody_here:{SECRET}@127.0.0.1:5432/test", 'role "nobody_here" does not exist'),
    ],
    ids=["bad-url", "refused", "unknown-role"],
)
def test_cli_database_errors_are_one_line_exit_2_without_the_password(
    url: str, expected: str, postgres_server: str
) -> None:
    done = idemctl("--db", url, "stats")
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], done.stderr
    assert SECRET not in done.stderr and "Traceback" not in done.stderr


def test_cli_init_then_inspect_against_postgres(ledger_target: str) -> None:
    where = PostgresEngine(ledger_target).describe()
    done = idemctl("--db", ledger_target, "init")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{where}: created (schema version 3)"
    ledger = Ledger.open(ledger_target)
    ledger.handle(
        "acct_A",
        "order-42",
        "POST",
        "/orders",
        {},
        b"\xff\xfe",
        lambda b: (201, {"content-type": "application/octet-stream"}, b"\x00\xff"),
    )
    ledger.close()
    done = idemctl("--db", ledger_target, "inspect", "order-42", "--principal", "acct_A", "--json")
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert (shown["principal"], shown["key"], shown["status"], shown["generation"]) == (
        "acct_A",
        "order-42",
        "completed",
        1,
    )
    assert shown["response"]["status"] == 201 and shown["response"]["body_base64"] == "AP8="  # b"\x00\xff"
    again = idemctl("--db", ledger_target, "init")
    assert again.returncode == 0 and again.stdout.strip() == f"{where}: already up to date (schema version 3)"


def test_the_documented_postgres_example_runs_against_the_test_server(ledger_target: str, tmp_path) -> None:
    import re

    page = (ROOT / "docs" / "postgres.md").read_text(encoding="utf-8")
    example = re.findall(r"```python\n(.*?)```", page, re.S)[0]
    shown = "postgresql://app:secret@db.internal:5432/payments?"
    assert shown in example
    code = example.replace(shown, ledger_target + "&")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "created (schema version 3)\n"
    again = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert again.stdout == "already up to date (schema version 3)\n"
