"""A soak with connections ended under load: does any acknowledged answer
run again?

FastAPI under `uvicorn --workers N` (bench/soak_app.py) with its ledger on
PostgreSQL or MariaDB. Client threads send POST /orders, each with a key of
its own, as fast as the server answers; every `--end-every` seconds an
operator thread ends every server connection the ledger holds
(`pg_terminate_backend` on the app's application_name; `KILL` on MariaDB),
idle pooled ones and ones in the middle of a statement alike. Once the load
stops and the pending TTL has passed, every key whose first request was
acknowledged (2xx) is sent again, as a client that retries would.

    python -m bench.soak --engine postgres --seconds 60
    python -m bench.soak --engine mysql --seconds 60 --end-every 2

Reported: requests, acknowledged, re-run after ack (an acknowledged key
whose retry got another answer, or whose mutation ran twice: must be 0),
answers the server could not store (AnswerNotStoredError, from its log),
completions stored again on a fresh connection, and every other outcome by
type (503s are refusals before the app ran: nothing ran)."""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_URLS = {
    "postgres": os.environ.get("IDEMCTL_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"),
    "mysql": os.environ.get("IDEMCTL_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test"),
}
PENDING_TTL_MS = 2000
BODY = {"sku": "tea", "qty": 1}


@dataclass
class Tally:
    requests: int = 0
    acknowledged: dict[str, bytes] = field(default_factory=dict)
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    ended: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


# -- a ledger of its own ----------------------------------------------------------------


@contextlib.contextmanager
def scratch_ledger(engine: str, base: str) -> Iterator[tuple[str, Any]]:
    """A fresh ledger (a schema on PostgreSQL, a database on MariaDB) as a
    URL, and a function that ends every connection the app holds to it."""
    name = f"soak_{secrets.token_hex(5)}"
    if engine == "postgres":
        import psycopg

        app = f"idemctl-{name}"
        sep = "&" if "?" in base else "?"
        url = f"{base}{sep}options=-csearch_path%3D{name}&application_name={app}"
        admin = psycopg.connect(base, autocommit=True)
        admin.execute(f"CREATE SCHEMA {name}")

        def end_all() -> int:
            rows = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s", (app,)
            ).fetchall()
            return len(rows)

        try:
            yield url, end_all
        finally:
            end_all()
            admin.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")
            admin.close()
    else:
        import pymysql

        from .mysql import _connect

        admin = _connect(base)
        cur = admin.cursor()
        cur.execute(f"CREATE DATABASE {name} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
        url = base.split("?", 1)[0].rsplit("/", 1)[0] + f"/{name}"

        def end_all() -> int:
            cur.execute(
                "SELECT id FROM information_schema.processlist WHERE db = %s AND id <> CONNECTION_ID()", (name,)
            )
            ids = [int(r[0]) for r in cur.fetchall()]
            for one in ids:
                with contextlib.suppress(pymysql.MySQLError):
                    cur.execute(f"KILL {one}")
            return len(ids)

        try:
            yield url, end_all
        finally:
            end_all()
            cur.execute(f"DROP DATABASE IF EXISTS {name}")
            admin.close()


# -- the server --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(url: str, workers: int, runs_dir: str, log_path: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = dict(os.environ, SOAK_URL=url, SOAK_RUNS_DIR=runs_dir, SOAK_PENDING_TTL_MS=str(PENDING_TTL_MS))
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "uvicorn", "bench.soak_app:app", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--workers", str(workers), "--log-level", "warning", "--no-access-log"]
    log = open(log_path, "wb")  # noqa: SIM115 (the server's life)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: see {log_path}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + "/docs", timeout=1).status_code == 200:
                return proc, base
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server did not start within 60 s: see {log_path}")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- the load ----------------------------------------------------------------------------


def post(client: httpx.Client, key: str) -> tuple[str, bytes]:
    try:
        reply = client.post("/orders", json=BODY, headers={"Idempotency-Key": key, "X-Account": "acct_soak"})
    except httpx.HTTPError as exc:
        return f"client: {type(exc).__name__}", b""
    return str(reply.status_code), reply.content


def load(base: str, tally: Tally, worker: int, stop: threading.Event) -> None:
    with httpx.Client(base_url=base, timeout=30) as client:
        n = 0
        while not stop.is_set():
            n += 1
            key = f"c{worker}-{n}"
            status, body = post(client, key)
            with tally.lock:
                tally.requests += 1
                tally.outcomes[status] += 1
                if status.startswith("2"):
                    tally.acknowledged[key] = body


def operator(end_all: Any, every_s: float, tally: Tally, stop: threading.Event) -> None:
    while not stop.wait(every_s):
        try:
            ended = end_all()
        except Exception as exc:  # the soak goes on; say so at the end
            with tally.lock:
                tally.outcomes[f"operator: {type(exc).__name__}"] += 1
            continue
        with tally.lock:
            tally.ended += ended


def retry_acknowledged(base: str, tally: Tally, clients: int) -> tuple[int, collections.Counter[str]]:
    """Every acknowledged key once more; how many got another answer, and the retries' statuses."""
    keys = list(tally.acknowledged.items())
    rerun = 0
    statuses: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()

    def part(chunk: list[tuple[str, bytes]]) -> None:
        nonlocal rerun
        with httpx.Client(base_url=base, timeout=30) as client:
            for key, body in chunk:
                status, again = post(client, key)
                with lock:
                    statuses[status] += 1
                    if again != body:
                        rerun += 1

    threads = [threading.Thread(target=part, args=(keys[i::clients],)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return rerun, statuses


def runs_per_key(runs_dir: str) -> collections.Counter[str]:
    runs: collections.Counter[str] = collections.Counter()
    for name in os.listdir(runs_dir):
        with open(os.path.join(runs_dir, name)) as lines:
            for line in lines:
                runs[line.split(" ", 1)[0]] += 1
    return runs


def soak(engine: str, base_url: str, seconds: float, end_every_s: float, clients: int, workers: int) -> dict[str, Any]:
    from idemctl import Ledger

    with scratch_ledger(engine, base_url) as (url, end_all), tempfile.TemporaryDirectory() as tmp:
        with Ledger.open(url) as ledger:
            ledger.init()
        runs_dir = os.path.join(tmp, "runs")
        os.mkdir(runs_dir)
        log_path = os.path.join(tmp, "server.log")
        proc, base = start_server(url, workers, runs_dir, log_path)
        try:
            tally = Tally()
            stop = threading.Event()
            threads = [threading.Thread(target=load, args=(base, tally, i, stop)) for i in range(clients)]
            threads.append(threading.Thread(target=operator, args=(end_all, end_every_s, tally, stop)))
            started = time.monotonic()
            for thread in threads:
                thread.start()
            time.sleep(seconds)
            stop.set()
            for thread in threads:
                thread.join()
            elapsed = time.monotonic() - started
            time.sleep(PENDING_TTL_MS / 1000 + 0.5)  # every reservation left pending is stale now
            rerun, retry_statuses = retry_acknowledged(base, tally, clients)
        finally:
            stop_server(proc)
        with open(log_path, encoding="utf-8", errors="replace") as f:
            log = f.read()
        runs = runs_per_key(runs_dir)
    acked_twice = sum(1 for key in tally.acknowledged if runs[key] > 1)
    return {
        "engine": engine,
        "seconds": round(elapsed, 1),
        "workers": workers,
        "clients": clients,
        "end_every_s": end_every_s,
        "connections_ended": tally.ended,
        "requests": tally.requests,
        "acknowledged": len(tally.acknowledged),
        "rerun_after_ack": max(rerun, acked_twice),
        "not_stored": log.count("could not be stored"),
        "stored_again": log.count("done on a fresh connection"),
        "outcomes": dict(sorted(tally.outcomes.items())),
        "retry_outcomes": dict(sorted(retry_statuses.items())),
    }


def table(result: dict[str, Any]) -> str:
    others = ", ".join(f"{k}: {v}" for k, v in result["outcomes"].items() if not k.startswith("2")) or "none"
    rows = [
        ("engine", result["engine"]),
        ("run", f"{result['seconds']} s, uvicorn --workers {result['workers']}, {result['clients']} clients"),
        ("connections ended", f"{result['connections_ended']} (all of the app's, every {result['end_every_s']:g} s)"),
        ("requests", result["requests"]),
        ("acknowledged (2xx)", result["acknowledged"]),
        ("re-run after ack", result["rerun_after_ack"]),
        ("answers not stored", result["not_stored"]),
        ("stored again on a fresh connection", result["stored_again"]),
        ("other answers", others),
    ]
    return "\n".join(["| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=sorted(DEFAULT_URLS), default="postgres")
    parser.add_argument("--url", help="the server (default: the test suite's)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--end-every", type=float, default=2.0, help="seconds between two rounds of ended connections")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    result = soak(
        args.engine, args.url or DEFAULT_URLS[args.engine], args.seconds, args.end_every, args.clients, args.workers
    )
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0 if result["rerun_after_ack"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
