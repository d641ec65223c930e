"""Idempotent functions across real processes: a fingerprint that every
process computes alike, eight processes racing over 200 keys, and a worker
SIGKILLed inside the function whose call another process takes over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from idemctl import Status, wall_clock_ms
from idemctl.call_values import call_fingerprint
from tests.e2e.function_calls import make_fulfil
from tests.helpers import ROOT

pytestmark = pytest.mark.slow

PROCESSES = 8
KEYS = 200


def env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("IDEMCTL_")}
    return {**base, **extra}


def run_helper(*args: str, timeout: float = 120, **extra_env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.e2e.function_calls", *args],
        cwd=ROOT,
        env=env(**extra_env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def effect_lines(path: Path) -> list[tuple[str, int]]:
    if not path.exists():
        return []
    return [(line.split()[0], int(line.split()[1])) for line in path.read_text().splitlines()]


# -- the fingerprint --------------------------------------------------------------------------
ORDER = {"id": "o-1", "lines": [{"sku": "tea", "qty": 2, "price": 4.5}], "note": "thé", "gift": None}
# The same order as another process builds it: every dict in the reverse order.
ORDER_REVERSED_JSON = '{"gift":null,"note":"thé","lines":[{"price":4.5,"qty":2,"sku":"tea"}],"id":"o-1"}'


def test_another_process_with_another_hash_seed_and_dict_order_computes_the_same_fingerprint():
    code = (
        "import json, sys; from idemctl.call_values import call_fingerprint; "
        "order = json.loads(sys.argv[1]); assert list(order) == ['gift', 'note', 'lines', 'id']; "
        "print(call_fingerprint({'order': order}, name='fulfil'))"
    )
    fingerprints = set()
    for seed in ("0", "1", "4242"):
        done = subprocess.run(
            [sys.executable, "-c", code, ORDER_REVERSED_JSON],
            env={**env(), "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        fingerprints.add(done.stdout.strip())
    assert fingerprints == {call_fingerprint({"order": ORDER}, name="fulfil")}


def test_a_call_made_in_another_process_is_replayed_here_with_the_arguments_in_another_order(
    ledger_target, make_ledger, tmp_path
):
    ledger = make_ledger(clock_fn=wall_clock_ms)
    effects = tmp_path / "effects.log"
    done = run_helper("call", ledger_target, str(effects), ORDER_REVERSED_JSON)
    assert done.returncode == 0, done.stderr
    theirs = json.loads(done.stdout)["value"]
    fulfil = make_fulfil(ledger, str(effects))
    assert fulfil(ORDER) == theirs  # replayed: same fingerprint, no KeyReusedError
    assert [key for key, _ in effect_lines(effects)] == ["o-1"]


# -- eight processes, 200 keys --------------------------------------------------------------------
def test_eight_processes_racing_over_200_keys_run_each_call_exactly_once(ledger_target, make_ledger, tmp_path):
    ledger = make_ledger(clock_fn=wall_clock_ms)
    effects = tmp_path / "effects.log"
    go = tmp_path / "go"
    ids = [f"order-{i:03d}" for i in range(KEYS)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.e2e.function_calls",
                "race",
                ledger_target,
                str(effects),
                str(go),
                str(seed),
                *ids,
            ],
            cwd=ROOT,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in range(PROCESSES)
    ]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"go.{seed}.ready").exists() for seed in range(PROCESSES)):
        assert all(p.poll() is None for p in procs), "a racer exited before the start"
        assert time.monotonic() < deadline, "the racers never got ready"
        time.sleep(0.01)
    go.touch()  # all eight start together
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        reports.append(json.loads(out))

    lines = effect_lines(effects)
    assert len(lines) == KEYS
    ran_by = dict(lines)
    assert sorted(ran_by) == ids  # every key ran, and once
    # Every process got, for every key, the value of the one run that happened.
    for report in reports:
        assert report["by"] == ran_by
    assert len({pid for _, pid in lines}) > 1  # the runs really were spread over the processes
    stats = ledger.operator.stats()
    assert (stats.total, stats.completed, stats.taken_over, stats.fenced_out_events) == (KEYS, KEYS, 0, 0)


# -- SIGKILL inside the function --------------------------------------------------------------------
def test_a_worker_killed_inside_the_function_is_taken_over_by_another_after_the_ttl(
    ledger_target, make_ledger, tmp_path
):
    ledger = make_ledger(clock_fn=wall_clock_ms)
    ttl = {"IDEMCTL_PENDING_TTL": "500ms"}
    effects = tmp_path / "effects.log"
    mark = tmp_path / "stalled"
    order = json.dumps({"id": "o-killed", "sku": "tea", "qty": 1})
    stalled = subprocess.Popen(
        [sys.executable, "-m", "tests.e2e.function_calls", "stall", ledger_target, str(effects), str(mark), order],
        cwd=ROOT,
        env=env(**ttl),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        # Its pid written, not only the file made: a kill between the two left it empty.
        while not (mark.exists() and mark.read_text()):
            assert stalled.poll() is None, stalled.communicate()[1]
            assert time.monotonic() < deadline, "the worker never reached the function"
            time.sleep(0.01)
    finally:
        stalled.send_signal(signal.SIGKILL)
        stalled.wait(30)
    assert stalled.returncode == -signal.SIGKILL
    (pending,) = list(ledger.operator.pending())
    assert (pending.row.key, pending.row.generation) == ("o-killed", 1)

    done = run_helper("call", ledger_target, str(effects), order, **ttl)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["value"] == {"id": "o-killed", "by": effect_lines(effects)[0][1]}
    assert [key for key, _ in effect_lines(effects)] == ["o-killed"]  # the killed worker never reached the effect
    row = ledger.lookup("fulfilment", "o-killed")
    assert (row.status, row.generation) == (Status.COMPLETED, 2)
    assert list(ledger.operator.pending()) == []
    assert list(ledger.operator.fenced()) == []  # the killed worker never came back to complete late
    assert mark.read_text() == str(stalled.pid)
