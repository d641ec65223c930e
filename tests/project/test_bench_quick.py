"""The benchmark harness still runs: `python -m bench --quick` measures every
benchmark at tiny sizes. It asserts nothing about speed (that is bench/'s
job, as ratios in one run); only that each benchmark ran and the table came out."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench import peers_systems
from tests.helpers import ROOT

pytestmark = pytest.mark.slow


def test_quick_benchmark_run_exits_0_and_renders_every_table(tmp_path):
    out = tmp_path / "quick.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--dir", str(tmp_path / "work"), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,  # valgrind starting Python is most of it
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["quick"] is True
    benchmarks = results["benchmarks"]
    assert list(benchmarks) == [
        "cycle",
        "middleware",
        "contention",
        "growth",
        "sweep",
        "memory",
        "postgres",
        "mysql",
        "asgi",
        "group_commit",
        "instructions",
    ]
    assert [name for name, res in benchmarks.items() if "error" in res] == []
    # Everything built in this repository must be measured, never skipped.
    for name in ("cycle", "middleware", "contention", "growth", "sweep", "memory", "asgi", "group_commit"):
        assert "missing" not in benchmarks[name], benchmarks[name]
    assert len(benchmarks["contention"]["configs"]) == 12
    assert all(c["error_count"] == 0 for c in benchmarks["contention"]["configs"])
    assert len(benchmarks["group_commit"]["configs"]) == 16
    assert all(c["error_count"] == 0 for c in benchmarks["group_commit"]["configs"])
    sweep = benchmarks["sweep"]
    assert sweep["cli"]["live_rows_after"] == sweep["live_rows"]
    assert sweep["cli"]["deleted"] == sweep["expired_rows"]
    assert benchmarks["memory"]["requests"] == 2000
    table = proc.stdout
    for heading in (
        "| (1) request cycle |",
        "| (2) middleware, in-process |",
        "| (3) contention |",
        "| (4) growth: rows already present |",
        "| (5) sweep:",
        "| (6) memory |",
        "| (8) ASGI middleware, in-process |",
        "| (8) event-loop lag:",
        "| (9) group commit",
    ):
        assert heading in table, heading
    assert "quick mode: not figures" in table
    # Instructions are counted wherever valgrind is installed, and otherwise shown as a gap.
    instructions = benchmarks["instructions"]
    if "missing" in instructions:
        assert "_instructions: **gap**" in table
    else:
        assert "| (0) instructions per request |" in table
        assert [r["name"] for r in instructions["rows"]][:7] == [
            "raw_first",
            "raw_replay",
            "handle_first",
            "handle_after_response",
            "handle_replay",
            "handle_reused",
            "handle_in_progress",
        ]
        assert all(r["instructions"] > 0 for r in instructions["rows"])
    # PostgreSQL is measured when its server answers, and otherwise shown as a gap, never silently dropped.
    assert ("| (7) PostgreSQL |" in table) or ("_postgres: **gap**" in table)
    assert ("| (7b) MariaDB |" in table) or ("_mysql: **gap**" in table)
    # The big backlog copies are removed as soon as the sweep benchmark is done with them.
    assert not (tmp_path / "work" / "backlog.db").exists()


def test_quick_run_with_peers_adds_them_to_only_and_renders_the_peers_section(tmp_path):
    out = tmp_path / "peers.json"
    page = tmp_path / "performance.md"
    work = tmp_path / "work"
    run = [sys.executable, "-m", "bench", "--dir", str(work), "--out", str(out)]
    proc = subprocess.run(
        [*run, "--quick", "--peers", "--only", "cycle"], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    benchmarks = json.loads(out.read_text())["benchmarks"]
    # --peers comes on top of what --only selects.
    assert list(benchmarks) == ["cycle", "peers"]
    peers = benchmarks["peers"]
    if "missing" in peers:  # the peers or a store are absent here: a gap, never silently dropped
        # Under CI only peers that are not installed (the bench extra) may be a gap.
        not_installed = set(peers_systems.missing()) & {"idemkit", "powertools"}
        assert not os.environ.get("CI") or not_installed, peers["missing"]
        assert "_peers: **gap**" in proc.stdout
        return
    assert "error" not in peers, peers
    assert peers["versions"]["idemkit"] and peers["versions"]["aws-lambda-powertools"]
    assert [row["id"] for row in peers["throughput"]["rows"]] == [
        "idemctl_wsgi",
        "idemkit_wsgi",
        "idemctl_asgi",
        "idemkit_asgi",
        "idemctl_function",
        "powertools",
    ]
    assert set(peers["facts"]) == {"idemctl", "idemkit", "powertools"}
    assert peers["facts"]["idemctl"]["race"]["executions"] == 1
    assert peers["facts"]["idemctl"]["late_writer"]["stored_after_a"] == "B"
    # The page renders the peers section from the same results.
    rendered = subprocess.run(
        [*run, "--report", "--page", str(page)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert rendered.returncode == 0, rendered.stderr[-3000:]
    text = page.read_text()
    for heading in ("| (10) peers, in-process, same callers |", "| (10) correctness facts |"):
        assert heading in text and heading in proc.stdout, heading
    assert "idemkit 1.0.2" in text or f"idemkit {peers['versions']['idemkit']}" in text
    assert "non-durable reference (Redis without persistence)" in text


def test_quick_in_flight_run_measures_every_level_and_renders_its_tables(tmp_path):
    out = tmp_path / "inflight.json"
    run = [sys.executable, "-m", "bench", "--dir", str(tmp_path / "work"), "--out", str(out)]
    proc = subprocess.run(
        [*run, "--quick", "--only", "inflight"], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())["benchmarks"]["inflight"]
    if "missing" in res:  # no PostgreSQL driver here: a gap, never silently dropped
        assert not os.environ.get("CI"), res["missing"]
        assert "_inflight: **gap**" in proc.stdout
        return
    assert "error" not in res, res
    assert list(res["levels"]) == ["1", "10", "50"]
    for row in res["levels"].values():
        assert set(row) == {"first", "replay"}
        assert all(cell["idemctl"]["n"] == res["rounds"] for cell in row.values())
        for cell in row.values():
            # Both drivers' floors in the same rounds, the faster one the limit every ratio is taken against.
            assert cell["limit"] == max(("psycopg", "asyncpg"), key=lambda d: cell[f"floor_{d}"]["median"])
            assert cell["floor"] == cell[f"floor_{cell['limit']}"]
            assert {"idemctl_fastapi_vs_floor", "idemctl_psycopg_vs_floor"} <= set(cell)
    # The same paths in instructions: every segment counted, each floor 1.00 of itself.
    ins = res["instructions"]
    assert "missing" not in ins or not os.environ.get("CI"), ins
    if "missing" not in ins:
        counted = {(r["door"], r["system"], r["kind"]): r for r in ins["rows"]}
        assert {(door, system) for door, system, _ in counted} == {
            ("asgi", "floor-asyncpg"),
            ("asgi", "floor-psycopg"),
            ("asgi", "idemctl"),
            ("asgi", "idemctl-psycopg"),
            ("sync", "floor"),
            ("sync", "handle"),
        }
        assert counted[("asgi", "floor-asyncpg", "first")]["vs_floor"] == 1.0
        assert counted[("sync", "floor", "replay")]["vs_floor"] == 1.0
        assert all(r["instructions"] > 0 for r in counted.values())
        # Where the instructions go: every C function's own cost in one part, so the parts add up to the total.
        for kind in ("first", "replay"):
            for system in ("idemctl", "floor-asyncpg"):
                row = counted[("asgi", system, kind)]
                assert abs(sum(row["parts"].values()) - row["instructions"]) <= len(row["parts"]), row
            assert counted[("asgi", "idemctl", kind)]["parts"]["SHA-256 (OpenSSL)"] > 0
            assert counted[("asgi", "floor-asyncpg", kind)]["parts"]["SHA-256 (OpenSSL)"] == 0
        assert "parts" not in counted[("sync", "handle", "first")]
        census = ins["census"]
        assert set(census) == {"idemctl:first", "idemctl:replay", "floor-asyncpg:first", "floor-asyncpg:replay"}
        assert census["idemctl:first"]["idemctl"] > census["idemctl:replay"]["idemctl"] > 0
        assert "idemctl" not in census["floor-asyncpg:first"]
        assert census["idemctl:first"]["event-loop turns"] > census["floor-asyncpg:first"]["event-loop turns"] > 0
    # This process's CPU time per request at one in flight, for every system.
    for cell in res["levels"]["1"].values():
        assert {"asyncpg", "psycopg", "idemctl", "idemctl_fastapi", "idemctl_psycopg"} <= set(cell["cpu_us"])
        assert all(v["median"] > 0 and v["n"] == res["rounds"] for v in cell["cpu_us"].values())
    assert "cpu_us" not in res["levels"]["10"]["first"]
    headings = ["| (8)/(10) ASGI + PostgreSQL, in flight |", "| (8) event-loop lag: a 1 ms ticker, 50 first"]
    if "missing" not in ins:
        headings += [
            "| (8)/(10), (7) instructions a request on PostgreSQL (callgrind) |",
            "| part | floor, first call | idemctl, first call | above the floor |",
            "Python functions entered per request",
        ]
    for heading in headings:
        assert heading in proc.stdout, heading
