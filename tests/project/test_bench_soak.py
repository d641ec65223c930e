"""The soak still runs: `python -m bench.soak` serves its app under uvicorn
with two workers on PostgreSQL, ends the ledger's connections under load,
retries every acknowledged key after the TTL and prints its table. A few
seconds only: the numbers are the bench's business, not this test's."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow


def test_a_short_soak_on_postgres_exits_0_with_no_acknowledged_answer_run_again(postgres_server: str) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.soak",
            "--engine",
            "postgres",
            "--url",
            postgres_server,
            "--seconds",
            "3",
            "--end-every",
            "0.5",
            "--clients",
            "4",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = dict(
        (cells[1].strip(), cells[2].strip())
        for cells in (
            line.split("|") for line in proc.stdout.splitlines() if line.startswith("| ") and line.count("|") == 3
        )
    )
    assert lines["engine"] == "postgres"
    assert lines["re-run after ack"] == "0"
    assert int(lines["acknowledged (2xx)"]) > 0
