"""Every CLI command on a d1:// ledger while the recipe's Worker serves
requests on the same D1 database: the recipe's ledger upgraded in place
(`init`), read (`inspect`, `pending`, `fenced`, `stats`), swept, purged,
checked (`doctor`) and copied both ways, with no key lost and the Worker
answering 201 or a replay throughout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from idemctl.schema import schema_files
from idemctl.storage.d1 import D1Engine

from .runtime import TOKEN, Runtime

pytestmark = pytest.mark.slow


def idemctl(runtime: Runtime, *args: str, token: str = TOKEN) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IDEMCTL_", "CLOUDFLARE_"))}
    env.update(runtime.env(token), IDEMCTL_DB=runtime.ledger_url, COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "idemctl", *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def recipe_table(runtime: Runtime) -> None:
    """The recipe's own table and index, as its migration creates them."""
    engine = D1Engine(runtime.ledger_url)
    try:
        recipe = schema_files("sqlite")[0]
        from idemctl.storage.sqlite.schema import split_statements

        engine.write_turn([(statement, {}) for statement in split_statements(recipe.sql)])
    finally:
        engine.close()


class Traffic:
    """Requests to the recipe's Worker in a thread, each key sent twice (the
    second a retry that must replay the first answer)."""

    def __init__(self, runtime: Runtime, prefix: str) -> None:
        self.runtime, self.prefix = runtime, prefix
        self.answers: dict[str, list[tuple[int, bytes]]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            key = f"{self.prefix}-{n}"
            for _ in range(2):
                status, _, body = self.runtime.post("/orders", b'{"n": %d}' % n, key=key)
                self.answers.setdefault(key, []).append((status, body))
            n += 1

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=60)

    def check(self) -> None:
        assert self.answers, "the Worker answered nothing"
        for key, answers in self.answers.items():
            assert [s for s, _ in answers] == [201, 201], (key, answers)
            assert answers[0][1] == answers[1][1], f"{key}: the retry ran the mutation again"


@pytest.fixture
def served(runtime: Runtime) -> Iterator[Runtime]:
    recipe_table(runtime)
    yield runtime


def test_init_upgrades_the_recipes_ledger_in_place_while_its_worker_serves(served: Runtime) -> None:
    status, _, before = served.post("/orders", b"{}", key="before-init")
    assert status == 201
    with Traffic(served, "during-init") as traffic:
        dry = idemctl(served, "init", "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert "0" in dry.stdout and "3" in dry.stdout
        done = idemctl(served, "init")
        assert done.returncode == 0, done.stderr
        again = idemctl(served, "init")
        assert again.returncode == 0 and "up to date" in again.stdout
    traffic.check()
    # The key stored before the upgrade still replays, byte for byte.
    assert served.post("/orders", b"{}", key="before-init")[::2] == (201, before)
    version = D1Engine(served.ledger_url).read("SELECT max(version) FROM idemctl_schema_version", {})
    assert version == [(3,)]


def test_reads_sweep_purge_and_doctor_on_d1_under_traffic(served: Runtime) -> None:
    assert idemctl(served, "init").returncode == 0
    with Traffic(served, "reads") as traffic:
        engine = D1Engine(served.ledger_url)
        # Three rows past a retention of 1 h (not past the Worker's 24 h, so
        # its own sweep leaves them), one stale pending reservation.
        now = int(engine.read("SELECT CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)", {})[0][0])
        old = now - 2 * 3600_000
        for i in range(3):
            engine.write(
                "INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, response_status,"
                " response_body, response_headers, created_at, updated_at)"
                " VALUES ('acct_old', :k, 'fp', 'completed', 1, 201, 'x', '{}', :t, :t)",
                {"k": f"old-{i}", "t": old + i},
            )
        engine.write(
            "INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, created_at, updated_at)"
            " VALUES ('acct_1', 'stuck', 'fp', 'pending', 1, :t, :t)",
            {"t": now - 60_000},
        )
        inspect = idemctl(served, "inspect", "stuck", "-p", "acct_1", "--json")
        assert inspect.returncode == 0, inspect.stderr
        assert json.loads(inspect.stdout)["status"] == "pending"
        pending = idemctl(served, "pending", "--stale", "--json")
        assert pending.returncode == 0, pending.stderr
        assert [p["key"] for p in json.loads(pending.stdout)["rows"]] == ["stuck"]
        assert idemctl(served, "fenced", "--json").returncode == 0
        stats = idemctl(served, "stats", "--json", "--retention", "1h")
        assert stats.returncode == 0, stats.stderr
        assert json.loads(stats.stdout)["expired"] == 3
        for fmt in ("--format=text", "--format=prometheus"):
            shown = idemctl(served, "stats", fmt)
            assert shown.returncode == 0, (fmt, shown.stderr)
        dry = idemctl(served, "sweep", "--dry-run", "--json", "--retention", "1h")
        assert dry.returncode == 0, dry.stderr
        swept = idemctl(served, "sweep", "--batch-size", "2", "--json", "--retention", "1h")
        assert swept.returncode == 0, swept.stderr
        assert json.loads(swept.stdout)["deleted"] == 3
        purged = idemctl(served, "purge", "stuck", "-p", "acct_1", "--yes", "--force")
        assert purged.returncode == 0, purged.stderr
        doctor = idemctl(served, "doctor")
        assert doctor.returncode == 0, doctor.stderr
        assert "Cloudflare D1" in doctor.stdout and "schema version 3" in doctor.stdout
        assert TOKEN not in doctor.stdout + doctor.stderr
    traffic.check()
    left = engine.read("SELECT key FROM idempotency_keys WHERE principal <> 'acct_1' OR key = 'stuck'", {})
    assert left == []


def test_copy_both_ways_between_d1_and_sqlite_under_traffic_loses_no_key(served: Runtime, tmp_path: Path) -> None:
    assert idemctl(served, "init").returncode == 0
    for i in range(30):  # more rows than one statement may bind on D1 (100 parameters)
        assert served.post("/orders", b"{}", key=f"seed-{i}")[0] == 201
    local = str(tmp_path / "copy.db")
    with Traffic(served, "copying") as traffic:
        out = idemctl(served, "copy", "--to", local, "--init", "--json")
        assert out.returncode == 0, out.stderr
    traffic.check()
    engine = D1Engine(served.ledger_url)
    on_d1 = {tuple(r) for r in engine.read("SELECT principal, key, response_body FROM idempotency_keys", {})}
    import sqlite3

    with sqlite3.connect(local) as conn:
        copied = set(conn.execute("SELECT principal, key, response_body FROM idempotency_keys"))
    seeded = {row for row in on_d1 if row[1].startswith("seed-")}
    assert len(seeded) == 30 and seeded <= copied
    # Back into a fresh D1 database: the rows of the file, and the Worker replays them.
    engine.write_turn([(f"DELETE FROM {t}", {}) for t in ("idempotency_keys", "idemctl_fenced_out")])
    back = idemctl(served, "copy", "--db", local, "--to", served.ledger_url, "--json")  # --db: the file, not D1
    assert back.returncode == 0, back.stderr
    after = {tuple(r) for r in engine.read("SELECT principal, key, response_body FROM idempotency_keys", {})}
    assert copied == after
    status, _, body = served.post("/orders", b"{}", key="seed-7")
    assert (status, body.decode()) == (201, next(b for p, k, b in after if k == "seed-7"))


def test_a_binary_answer_copied_into_d1_keeps_its_key_as_the_sentinel(runtime: Runtime, tmp_path: Path) -> None:
    from idemctl import Ledger

    local = str(tmp_path / "binary.db")
    source = Ledger.open(local)
    source.init()
    reservation = source.claim("acct_1", "bin", "fp")
    source.complete(reservation, 200, {}, b"\xff\x00\x80")
    assert source.operator.get("acct_1", "bin").row.response_body == b"\xff\x00\x80"
    source.close()
    copied = idemctl(runtime, "copy", "--db", local, "--to", runtime.ledger_url, "--init", "--json")
    assert copied.returncode == 0, copied.stderr
    rows = D1Engine(runtime.ledger_url).read(
        "SELECT status, response_status, response_body FROM idempotency_keys WHERE key = 'bin'", {}
    )
    assert rows == [("completed", 500, None)]


def test_ctrl_c_stops_a_d1_sweep_between_batches_and_says_what_it_deleted(served: Runtime) -> None:
    import signal
    import time

    assert idemctl(served, "init").returncode == 0
    engine = D1Engine(served.ledger_url)
    now = int(engine.read("SELECT CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)", {})[0][0])
    insert = (
        "INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, response_status,"
        " response_body, response_headers, created_at, updated_at)"
        " VALUES ('acct_old', :k, 'fp', 'completed', 1, 201, 'x', '{}', :t, :t)"
    )
    engine.write_turn([(insert, {"k": f"old-{i}", "t": now - 7200_000 + i}) for i in range(600)])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IDEMCTL_", "CLOUDFLARE_"))}
    env.update(served.env(), IDEMCTL_DB=served.ledger_url)
    command = ["sweep", "--json", "--retention", "1h", "--batch-size", "50", "--pause", "300ms"]
    sweep = subprocess.Popen(
        [sys.executable, "-m", "idemctl", *command],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while engine.read("SELECT count(*) FROM idempotency_keys", {})[0][0] == 600 and time.monotonic() < deadline:
        time.sleep(0.05)
    sweep.send_signal(signal.SIGINT)
    out, err = sweep.communicate(timeout=60)
    assert sweep.returncode == 130, err
    report = json.loads(out)
    assert report["stopped"] == "interrupted"
    left = engine.read("SELECT count(*) FROM idempotency_keys WHERE principal = 'acct_old'", {})[0][0]
    # Whole batches only, and what it says it deleted is what is gone.
    assert 0 < report["deleted"] < 600 and report["deleted"] % 50 == 0
    assert left == 600 - report["deleted"]
    assert "Traceback" not in err
