"""Ctrl-C during `idemctl copy` into PostgreSQL while a statement is in
flight: the CLI's one line, exit 130, and nothing from the connection pool
(psycopg_pool warned twice about the connection given back mid-statement)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from idemctl import Ledger
from tests.helpers import interruptible

psycopg = pytest.importorskip("psycopg")
from psycopg.conninfo import conninfo_to_dict  # noqa: E402

pytestmark = pytest.mark.engines("postgres")


def test_ctrl_c_while_a_copy_waits_on_postgres_prints_one_line_and_exits_130(ledger_target: str, tmp_path) -> None:
    source = tmp_path / "src.db"
    with Ledger.open(source) as ledger:
        ledger.init()
        for n in range(5):
            ledger.handle("acct_1", f"k{n}", "POST", "/orders", {}, b"", lambda body: (201, {}, b"made"))
    with Ledger.open(ledger_target) as destination:
        destination.init()
    app_name = conninfo_to_dict(ledger_target)["application_name"]
    with psycopg.connect(ledger_target) as blocker:
        # Every statement on the ledger table waits behind this lock, so the
        # copy's first one is surely in flight when Ctrl-C comes.
        blocker.execute("LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "idemctl",
                "--db",
                str(source),
                "--busy-timeout",
                "60s",
                "copy",
                "--to",
                ledger_target,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=interruptible,
        )
        try:
            deadline = time.monotonic() + 30
            with psycopg.connect(ledger_target, autocommit=True) as watcher:
                while True:
                    waiting = watcher.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND wait_event_type = 'Lock'",
                        (app_name,),
                    ).fetchone()
                    if waiting and waiting[0] > 0:
                        break
                    assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                    time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        blocker.rollback()
    assert (proc.returncode, out) == (130, "")
    assert err == (
        "interrupted after 0 row(s) read; run the same copy again: "
        "it writes only what is missing or older in the destination\n"
    )
