"""The middleware on PostgreSQL under a real pre-fork, multi-threaded gunicorn:
the ledger is opened (and its pool started) in the master before the fork,
every worker builds its own pool, and one key still runs its mutation once."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

psycopg = pytest.importorskip("psycopg")
requests = pytest.importorskip("requests")
pytest.importorskip("gunicorn")

pytestmark = [pytest.mark.engines("postgres"), pytest.mark.slow]

APP = textwrap.dedent(
    """
    import json, os, time
    import psycopg
    from idemctl import Ledger
    from idemctl.wsgi import IdempotencyMiddleware

    URL = os.environ["IDEMCTL_DB"]
    ledger = Ledger.open(URL)
    ledger.init()  # in the master (--preload): its pool is open when gunicorn forks

    def orders(environ, start_response):
        body = environ["wsgi.input"].read()
        time.sleep(0.3)  # long enough for the racing retries to find it pending
        with psycopg.connect(URL, autocommit=True) as conn:
            (order_id,) = conn.execute(
                "INSERT INTO orders (sku, worker) VALUES (%s, %s) RETURNING id", (body.decode(), os.getpid())
            ).fetchone()
        start_response("201 Created", [("Content-Type", "application/json"), ("Location", f"/orders/{order_id}")])
        return [json.dumps({"id": order_id, "worker": os.getpid()}).encode()]

    app = IdempotencyMiddleware(orders, ledger, principal=lambda environ: "acct_1")
    """
)


@pytest.fixture
def gunicorn(ledger_target: str, tmp_path: Path) -> Iterator[str]:
    with psycopg.connect(ledger_target, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id serial PRIMARY KEY, sku text NOT NULL, worker int NOT NULL)")
    (tmp_path / "pgapp.py").write_text(APP)
    log = tmp_path / "gunicorn.log"
    cmd = [
        sys.executable, "-m", "gunicorn", "--preload", "--workers", "3", "--threads", "4",
        "--bind", "127.0.0.1:0", "--chdir", str(tmp_path), "--error-logfile", str(log), "pgapp:app",
    ]  # fmt: skip
    env = {"IDEMCTL_DB": ledger_target, "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        port = None
        while port is None:
            assert proc.poll() is None, log.read_text() if log.exists() else "gunicorn exited"
            assert time.monotonic() < deadline, "gunicorn did not start"
            text = log.read_text() if log.exists() else ""
            found = re.search(r"Listening at: http://127\.0\.0\.1:(\d+)", text)
            booted = len(re.findall(r"Booting worker with pid", text))
            if found and booted >= 3:
                port = int(found.group(1))
            else:
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(15)


def post(base: str, key: str, sku: str) -> requests.Response:
    return requests.post(
        f"{base}/orders", data=sku.encode(), headers={"Idempotency-Key": key, "Content-Type": "text/plain"}, timeout=30
    )


def test_one_key_from_thirty_clients_across_forked_workers_runs_once_and_every_2xx_is_identical(
    gunicorn: str, ledger_target: str
) -> None:
    answers: list[requests.Response] = []
    lock = threading.Lock()
    barrier = threading.Barrier(30)

    def client() -> None:
        barrier.wait()
        response = post(gunicorn, "order-1", "sku-1")
        with lock:
            answers.append(response)

    threads = [threading.Thread(target=client) for _ in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with psycopg.connect(ledger_target) as conn:
        orders = conn.execute("SELECT id, sku FROM orders").fetchall()
    assert len(orders) == 1 and orders[0][1] == "sku-1"
    created = [r for r in answers if r.status_code == 201]
    others = [r for r in answers if r.status_code != 201]
    assert created and {(r.content, r.headers["Location"]) for r in created} == {
        (created[0].content, f"/orders/{orders[0][0]}")
    }
    assert all(r.status_code == 409 and r.json()["error"] == "idempotency_key_in_progress" for r in others)
    assert all(r.headers["Retry-After"] == "30" for r in others)
    replay = post(gunicorn, "order-1", "sku-1")
    assert (replay.status_code, replay.content) == (201, created[0].content)


def test_distinct_keys_in_parallel_each_run_once_in_several_workers_with_their_own_connections(
    gunicorn: str, ledger_target: str
) -> None:
    with psycopg.connect(ledger_target) as conn:
        app_name = conn.execute("SHOW application_name").fetchone()[0]
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(post(gunicorn, f"k-{i}", f"sku-{i}").status_code))
        for i in range(24)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [201] * 24
    with psycopg.connect(ledger_target) as conn:
        assert conn.execute("SELECT count(*), count(DISTINCT sku) FROM orders").fetchone() == (24, 24)
        workers = conn.execute("SELECT count(DISTINCT worker) FROM orders").fetchone()[0]
        # The ledger's connections: each worker's own pool, never shared across
        # the fork (a shared socket would have broken the protocol above).
        ledger_conns = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND pid <> pg_backend_pid()", (app_name,)
        ).fetchone()[0]
    assert workers >= 2
    assert 3 <= ledger_conns <= 3 * 10 + 1  # at least one per worker, at most each pool's max (+ the master's)
