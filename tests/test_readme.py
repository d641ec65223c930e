"""README.md's promises stay true: the library example runs as printed, and
CI runs exactly the README's test command."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_library_example_runs_and_replays(tmp_path):
    block = re.search(r"## Library\n\n```python\n(.*?)```", README, re.S)
    assert block, "README lost its library example"
    done = subprocess.run([sys.executable, "-c", block.group(1)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    expected = "(201, (('content-type', 'application/json'), ('location', '/orders/42')), b'{\"id\":42}')"
    assert done.stdout.splitlines() == [expected, expected]
    assert (tmp_path / "idempotency.db").exists()


def test_readme_opens_with_the_two_fresh_machine_commands():
    commands = re.findall(r"```sh\n(.*?)\n```", README, re.S)
    assert len(commands) >= 2
    first, second = commands[0], commands[1]
    assert "pip install ." in first and "idemctl init" in first
    assert "pip install -e '.[test]'" in second and "python -m pytest" in second


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    test_command = re.findall(r"```sh\n(.*?)\n```", README, re.S)[1]
    # .ci/run makes its own venv first; the install-and-test part must be the README's, verbatim.
    install_and_test = test_command.split("&& ", 2)[2]
    assert install_and_test in ci
