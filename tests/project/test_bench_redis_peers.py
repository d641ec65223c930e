"""The Redis peers benchmark still runs: `python -m bench.redis_peers
--quick` drives idemctl, idemkit and the raw redis-py floor through WSGI
threads and ASGI tasks at 1, 10 and 50 in flight on a redis-server of its
own, and its table renders. It asserts the shape of what was measured,
never how fast. The callgrind counts are left out (`--no-instructions`):
valgrind starting Python would be most of the test's time."""

from __future__ import annotations

import importlib.util

import pytest

from bench import report
from tests import redis_servers
from tests.helpers import quick_bench, skip_or_fail

pytestmark = pytest.mark.slow


def test_quick_redis_peers_benchmark_measures_every_door_level_and_kind_and_renders(tmp_path):
    skip_or_fail(redis_servers.missing(), "CI runs the Redis benchmark's quick run")
    missing_peer = (
        None if importlib.util.find_spec("idemkit") else "idemkit is not installed: pip install -e '.[bench]'"
    )
    skip_or_fail(missing_peer, "CI installs the bench extra")
    res = quick_bench("redis_peers", tmp_path / "work", "--no-instructions")
    assert (res["rounds"], res["requests_per_round"], res["idemkit_missing"]) == (2, 40, None)
    assert "instructions" not in res
    assert [(r["door"], r["level"], r["kind"]) for r in res["rows"]] == [
        (door, level, kind) for door in ("wsgi", "asgi") for level in (1, 10, 50) for kind in ("first", "replay")
    ]
    for row in res["rows"]:
        for figure in ("floor", "idemctl", "idemkit", "idemctl_vs_floor", "idemkit_vs_floor", "idemctl_vs_idemkit"):
            assert row[figure]["n"] == 2 and row[figure]["min"] > 0, (row["door"], row["level"], figure)
    assert set(res["profile"]) == {
        "wsgi_first_1",
        "wsgi_replay_1",
        "asgi_first_10",
        "asgi_replay_10",
        "asgi_first_10_idemkit",
        "asgi_replay_10_idemkit",
    }
    for name, shares in ((n, p["share"]) for n, p in res["profile"].items()):
        assert ("idemkit" in shares) == name.endswith("_idemkit"), (name, shares)
        assert (shares.get("idemctl's store", 0) > 0) == (not name.endswith("_idemkit")), (name, shares)
    table = report.redis_peers_table(res)
    assert table[0] == (
        "| (13) Redis | in flight | kind | raw redis-py floor/s | idemctl/s | ÷ floor | idemkit/s | ÷ floor "
        "| idemctl ÷ idemkit |"
    )
    assert sum(line.startswith(("| WSGI, threads | ", "| ASGI, tasks | ")) for line in table) == 12
    assert any(
        line.startswith("Where the time goes (cProfile") and "On ASGI a first call spends" in line for line in table
    )


def test_the_redis_instruction_counts_render_as_ratios_to_the_floor_or_say_why_they_are_missing():
    counts = {
        ("wsgi", "floor"): (400_000, 160_000),
        ("wsgi", "idemctl"): (800_000, 640_000),
        ("asgi", "floor"): (700_000, 300_000),
        ("asgi", "idemctl"): (1_200_000, 900_000),
        ("asgi", "idemkit"): (1_200_000, 1_000_000),
    }
    rows = [
        {
            "door": door,
            "system": system,
            "kind": kind,
            "instructions": count,
            "vs_floor": round(count / counts[door, "floor"][k], 2),
        }
        for (door, system), pair in counts.items()
        for k, (kind, count) in enumerate(zip(("first", "replay"), pair))
    ]
    shown = report._redis_instructions({"requests_per_segment": 50, "rows": rows})
    assert shown[1:8] == [
        "| (13) instructions a request on Redis (callgrind) | first call | ÷ floor | replay | ÷ floor |",
        "|---|---|---|---|---|",
        "| raw redis-py (SET NX + SET XX; GET) | 400 000 | 1.00 | 160 000 | 1.00 |",
        "| idemctl, WSGI `IdempotencyMiddleware` | 800 000 | 2.00 | 640 000 | 4.00 |",
        "| raw `redis.asyncio` (SET NX + SET XX; GET) | 700 000 | 1.00 | 300 000 | 1.00 |",
        "| idemctl, ASGI `IdempotencyMiddleware` | 1 200 000 | 1.71 | 900 000 | 3.00 |",
        "| idemkit, ASGI `IdempotencyMiddleware` + `RedisBackend` | 1 200 000 | 1.71 | 1 000 000 | 3.33 |",
    ]
    # 1.5x idemkit's rate leaves 1 200 000 / 1.5 - 700 000 above the floor.
    assert shown[-1].endswith(
        "would leave 100 000 instructions for everything else (the ASGI exchange, the contract, the request's "
        "fingerprint), where idemkit spends 500 000."
    )
    assert report._redis_instructions({"missing": "valgrind is not installed"}) == [
        "",
        "(13) instructions: not counted (valgrind is not installed).",
    ]
