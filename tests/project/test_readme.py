"""README.md's promises stay true: its commands and examples run as printed,
followed top to bottom in one folder, and CI runs exactly its test command."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from wsgiref.util import setup_testing_defaults

import pytest

from tests.helpers import ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")
SH_BLOCKS = re.findall(r"```sh\n(.*?)\n```", README, re.S)
TRY_IT, RUN_TESTS = SH_BLOCKS[0], SH_BLOCKS[1]
# The part of the test command that .ci/run repeats after making its own venv.
INSTALL_AND_TEST = "pip install -e '.[test]' && python -m pytest -q"


def python_block(heading: str) -> str:
    block = re.search(rf"## {heading}\n\n```python\n(.*?)```", README, re.S)
    assert block, f"README lost its {heading} example"
    return block.group(1)


def sh_block_with(word: str) -> str:
    (block,) = [b for b in SH_BLOCKS if word in b]
    return block


def user_env() -> dict[str, str]:
    """This environment's idemctl and gunicorn first on PATH, as after the
    README's `. .venv/bin/activate`, and no idemctl settings from the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IDEMCTL_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_shell(command: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, shell=True, cwd=cwd, env=env or user_env(), capture_output=True, text=True, timeout=120
    )


def try_it_steps() -> list[str]:
    """The README's first command, minus the venv and the install this test
    environment has already done."""
    steps = TRY_IT.split(" && ")
    assert steps[:3] == ["python3 -m venv .venv", ". .venv/bin/activate", "pip install ."]
    rest = steps[3:]
    assert rest and all(step.startswith("idemctl ") for step in rest)
    return rest


def run_try_it(folder: Path) -> list[subprocess.CompletedProcess[str]]:
    done = []
    for step in try_it_steps():
        result = run_shell(step, folder)
        assert result.returncode == 0, f"{step}\n{result.stdout}\n{result.stderr}"
        done.append(result)
    return done


def test_try_it_runs_a_takeover_on_a_fresh_sqlite_ledger(tmp_path):
    init, simulate, inspect = run_try_it(tmp_path)
    assert re.fullmatch(r"demo\.db: created \(schema version \d+\)\n", init.stdout), init.stdout
    assert "every step went as expected" in simulate.stdout
    assert "taken over once" in inspect.stdout
    # The row it leaves behind: generation 2 answered, generation 1 fenced out.
    row = run_shell("idemctl --db demo.db inspect order-42 --principal acct_A --json", tmp_path)
    assert row.returncode == 0, row.stderr
    doc = json.loads(row.stdout)
    assert (doc["status"], doc["generation"], doc["response"]["status"]) == ("completed", 2, 201)
    assert [e["superseded_generation"] for e in doc["fenced_out"]] == [1]
    # It keeps to its own file, so the examples below start from an empty ledger.
    assert not (tmp_path / "idempotency.db").exists()


def test_the_test_command_is_the_one_ci_runs():
    steps = RUN_TESTS.split(" && ")
    assert steps[:2] == ["python3 -m venv .venv", ". .venv/bin/activate"]
    assert " && ".join(steps[2:]) == INSTALL_AND_TEST
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    marker = ci.index("# --- README: test command (keep identical to README.md) ---")
    assert ci[marker + 1] == INSTALL_AND_TEST


def run_library_example(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", python_block("Library")], cwd=folder, capture_output=True, text=True, timeout=60
    )


def test_library_example_runs_and_replays(tmp_path):
    done = run_library_example(tmp_path)
    assert done.returncode == 0, done.stderr
    expected = "(201, (('content-type', 'application/json'), ('location', '/orders/42')), b'{\"id\":42}')"
    assert done.stdout.splitlines() == [expected, expected]
    assert (tmp_path / "idempotency.db").exists()


def call(app, *, user: str | None, key: str = "k-1", body: bytes = b'{"sku":"x"}') -> tuple[str, list, bytes]:
    environ: dict = {}
    setup_testing_defaults(environ)
    environ.update(
        REQUEST_METHOD="POST",
        PATH_INFO="/orders",
        CONTENT_TYPE="application/json",
        CONTENT_LENGTH=str(len(body)),
        HTTP_IDEMPOTENCY_KEY=key,
    )
    environ["wsgi.input"] = io.BytesIO(body)
    if user is not None:
        environ["REMOTE_USER"] = user
    got: dict = {}

    def start_response(status, headers, exc_info=None):
        got.update(status=status, headers=headers)

    chunks = app(environ, start_response)
    try:
        out = b"".join(chunks)
    finally:
        getattr(chunks, "close", lambda: None)()
    return got["status"], got["headers"], out


def test_wsgi_example_runs_once_replays_and_refuses_without_a_principal(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(python_block("WSGI middleware"), "README.md (WSGI middleware)", "exec"), namespace)
    app, ledger = namespace["app"], namespace["ledger"]
    try:
        first = call(app, user="acct_W")
        assert first[0] == "201 Created" and first[2] == b'{"id":42}'
        assert call(app, user="acct_W") == first
        status, _, body = call(app, user="acct_W", body=b'{"sku":"y"}')
        assert (status, json.loads(body)) == ("409 Conflict", {"error": "idempotency_key_reused"})
        assert call(app, user=None)[0].startswith("401")
    finally:
        ledger.close()
    assert (tmp_path / "idempotency.db").exists()


def parse_curl_block() -> list[tuple[str, str, str]]:
    """(command, expected status line, expected body) for each curl line."""
    lines = sh_block_with("curl").splitlines()
    steps = []
    for command, expect in zip(lines[::2], lines[1::2]):
        assert command.startswith("curl ")
        m = re.fullmatch(r"# (HTTP/1\.1 \d{3} [A-Za-z ]+) … (\{.*\})", expect)
        assert m, expect
        steps.append((command, m.group(1), m.group(2)))
    return steps


def http_parts(raw: str) -> tuple[str, dict[str, str], str]:
    head, _, body = raw.partition("\r\n\r\n")
    status, *header_lines = head.split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return status, headers, body


@pytest.mark.slow
def test_following_the_readme_top_to_bottom_in_one_folder_works(tmp_path):
    if shutil.which("curl") is None:
        pytest.skip("the README's HTTP example uses curl, which this machine lacks")
    run_try_it(tmp_path)
    assert run_library_example(tmp_path).returncode == 0

    install, serve = sh_block_with("gunicorn").split(" && ")
    assert install == "pip install flask gunicorn"
    assert "127.0.0.1:8000" in serve
    env = user_env()
    # "From the repository root": the example module comes from the checkout,
    # everything it writes goes to this test's folder.
    env["PYTHONPATH"] = str(ROOT)
    log_path = tmp_path / "gunicorn.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            serve.replace("127.0.0.1:8000", "127.0.0.1:0"),
            shell=True,
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        port = None
        while port is None:
            found = re.search(r"Listening at: http://127\.0\.0\.1:(\d+)", log_path.read_text(errors="replace"))
            if found:
                port = found.group(1)
            elif server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"gunicorn did not start:\n{log_path.read_text(errors='replace')}")
            else:
                time.sleep(0.1)
        answers = []
        for command, status_line, body in parse_curl_block():
            # Bytes: the CRLFs of the HTTP head must survive.
            done = subprocess.run(
                command.replace("127.0.0.1:8000", f"127.0.0.1:{port}"),
                shell=True,
                cwd=tmp_path,
                env=env,
                capture_output=True,
                timeout=60,
            )
            assert done.returncode == 0, done.stderr
            got_status, headers, got_body = http_parts(done.stdout.decode("utf-8"))
            # Flask ends its JSON with a newline; the README shows the document.
            assert (got_status, got_body.rstrip("\n")) == (status_line, body)
            answers.append((got_status, {k: v for k, v in headers.items() if k != "date"}, got_body))
        # The retry is the first answer again, headers included.
        assert answers[1] == answers[0]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()

    row = run_shell("idemctl --db idempotency.db inspect order-42 --principal acct_A --json", tmp_path)
    assert row.returncode == 0, row.stderr
    doc = json.loads(row.stdout)
    assert (doc["status"], doc["generation"], doc["response"]["status"]) == ("completed", 1, 201)
