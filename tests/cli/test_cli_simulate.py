"""`idemctl simulate`: built-in scenarios on a virtual clock, the real-process
race, operator-written scenario files, and the README's first command."""

from __future__ import annotations

import json
import os
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from idemctl import Ledger, Outcome, Status
from idemctl.cli import app
from idemctl.cli.scenario import builtin, parse_scenario
from idemctl.cli.simulation import run_scenario
from idemctl.errors import ScenarioError
from tests.helpers import ROOT

IDEMCTL = Path(sys.executable).with_name("idemctl")


# --help and tables are wrapped to this terminal width (tests/cli/conftest.py).
TERMINAL_COLUMNS = "200"


def simulate(*args: str, env: dict[str, str] | None = None):
    result = CliRunner().invoke(app, ["simulate", *args], env=env)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return result


def timeline(*args: str) -> dict:
    result = simulate(*args, "--json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    return json.loads(result.stdout)


def outcomes(doc: dict) -> list[tuple[str, str]]:
    return [(e["actor"], e["outcome"]) for e in doc["events"]]


def test_happy_claims_completes_and_replays_without_running_twice():
    doc = timeline("happy")
    assert doc["ok"] is True and doc["database"] is None
    assert outcomes(doc) == [("A", "executed"), ("clock", "advanced"), ("A", "replayed"), ("operator", "inspected")]
    executed, _, replayed, inspected = doc["events"]
    assert executed["http_status"] == replayed["http_status"] == 201
    assert replayed["t_ms"] == 2000 and replayed["row"] == {"status": "completed", "generation": 1}
    assert inspected["detail"].startswith("completed 2 s ago: replayed until ")


def test_reuse_answers_409_and_replays_nothing():
    doc = timeline("reuse")
    assert outcomes(doc)[2] == ("A", "reused")
    assert doc["events"][2]["http_status"] == 409
    assert doc["events"][2]["detail"] == "409 reused: same key, different fingerprint; nothing ran or replayed"


def test_in_progress_answers_409_with_retry_after_then_replays():
    doc = timeline("in-progress")
    assert outcomes(doc) == [
        ("A", "claimed"),
        ("clock", "advanced"),
        ("A-retry", "in_progress"),
        ("clock", "advanced"),
        ("A", "stored"),
        ("A-retry", "replayed"),
        ("operator", "inspected"),
    ]
    assert doc["events"][2]["detail"] == "409 in progress (Retry-After: 30); nothing ran"
    assert doc["events"][2]["row"] == {"status": "pending", "generation": 1}


def test_takeover_fences_out_the_late_owner_and_replays_the_new_generations_answer():
    doc = timeline("takeover")
    assert outcomes(doc) == [
        ("A", "claimed"),
        ("clock", "advanced"),
        ("B", "taken_over"),
        ("clock", "advanced"),
        ("A", "fenced_out"),
        ("clock", "advanced"),
        ("C", "replayed"),
        ("operator", "inspected"),
    ]
    ev = doc["events"]
    assert ev[1]["t_ms"] == 31_000  # past the 30 s TTL
    assert (ev[2]["generation"], ev[2]["row"]) == (2, {"status": "completed", "generation": 2})
    assert ev[2]["logs"] == ["WARNING took over stale reservation principal=acct_A key=order-42 as generation 2"]
    assert ev[4]["generation"] == 1 and ev[4]["row"] == {"status": "completed", "generation": 2}
    assert ev[4]["logs"][0].startswith(
        "ERROR fenced out: principal=acct_A key=order-42 generation=1 was superseded by generation 2"
    )
    assert ev[6]["detail"] == 'replayed 201 {"order":"order-42","by":"B"} from generation 2; nothing ran'


def test_builtin_waits_follow_the_ttl_the_operator_gives():
    doc = timeline("takeover", "--ttl", "2m")
    assert doc["pending_ttl_ms"] == 120_000 and doc["ok"] is True
    assert doc["events"][1]["t_ms"] == 121_000


def test_sweep_scenario_drains_the_backlog_in_bounded_batches_and_keeps_the_fresh_row():
    doc = timeline("sweep")
    sweeps = [e for e in doc["events"] if e["op"] == "sweep"]
    assert [(e["outcome"], e["deleted"]) for e in sweeps] == [
        ("swept", 20),
        ("swept", 20),
        ("swept", 5),
        ("drained", 0),
    ]
    assert doc["events"][-1]["outcome"] == "inspected" and doc["events"][-1]["row"]["status"] == "completed"


def test_the_timeline_table_shows_time_actor_step_outcome_and_row_after(tmp_path):
    result = simulate("takeover")
    assert result.exit_code == 0 and result.stderr == ""
    lines = [line.rstrip() for line in result.stdout.splitlines()]
    assert lines[0].startswith("scenario takeover: worker A claims and stalls past the TTL")
    assert "ledger a temporary ledger (deleted afterwards); TTL 30 s, retention 1 d" in lines[1]
    assert lines[2].split() == ["t", "actor", "step", "outcome", "row", "after"]
    rows = [line.split(None, 3) for line in lines if line.startswith("+")]
    assert [r[:2] for r in rows] == [
        ["+0:00:00.000", "A"],
        ["+0:00:31.000", "clock"],
        ["+0:00:31.000", "B"],
        ["+0:00:35.000", "clock"],
        ["+0:00:35.000", "A"],
        ["+0:00:36.000", "clock"],
        ["+0:00:36.000", "C"],
        ["+0:00:36.000", "operator"],
    ]
    assert any(
        line.startswith("+0:00:35.000  A")
        and "complete gen 1" in line
        and "fenced_out" in line
        and line.endswith("completed · gen 2")
        for line in lines
    )
    assert lines[-1] == "every step went as expected"
    assert any(line.startswith("log +0:00:35.000 ERROR fenced out:") for line in lines)


def test_takeover_into_a_named_ledger_leaves_the_row_and_runs_again_the_next_time(ledger_target, make_ledger):
    make_ledger()
    first = simulate("takeover", "--db", ledger_target)
    assert first.exit_code == 0, first.stderr
    shown = shlex.quote(ledger_target)  # the test URLs carry no password: printed as typed
    assert first.stdout.rstrip().splitlines()[-1] == (
        f"every step went as expected; see it with: idemctl inspect order-42 --principal acct_A --db {shown}"
    )
    second = simulate("takeover", "--db", ledger_target)
    assert second.exit_code == 0, second.stderr
    assert "reset first (left by an earlier run): acct_A/order-42" in second.stdout
    ledger = make_ledger(init=False, clock_fn=None)
    row = ledger.lookup("acct_A", "order-42")
    assert (row.status, row.generation, row.body_bytes) == (Status.COMPLETED, 2, b'{"order":"order-42","by":"B"}')
    events = list(ledger.operator.fenced(principal="acct_A", key="order-42"))
    assert [(e.superseded_generation, e.current_generation, e.computed_status) for e in events] == [(1, 2, 201)] * 2


def test_without_db_simulate_never_touches_the_default_or_the_env_ledger(tmp_path):
    env_db = tmp_path / "production.db"
    result = simulate("happy", env={"IDEMCTL_DB": str(env_db)})
    assert result.exit_code == 0
    assert not env_db.exists() and not (tmp_path / "idempotency.db").exists()
    assert list(tmp_path.iterdir()) == []
    named = simulate("happy")
    assert named.exit_code == 0
    assert list(tmp_path.iterdir()) == []
    # The global --db given on the command line counts as naming a ledger.
    with Ledger.open(tmp_path / "named.db") as ledger:
        ledger.init()
    on_command_line = CliRunner().invoke(app, ["--db", str(tmp_path / "named.db"), "simulate", "happy"])
    assert on_command_line.exit_code == 0, on_command_line.stderr
    with Ledger.open(tmp_path / "named.db", create=False) as ledger:
        assert ledger.lookup("acct_A", "order-1") is not None


def test_simulate_into_a_mistyped_path_is_refused_and_creates_nothing(tmp_path):
    missing = tmp_path / "idempotecy.db"
    result = simulate("takeover", "--db", str(missing))
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == f"error: no ledger at {missing} — run `idemctl --db {missing} init`\n"
    assert list(tmp_path.iterdir()) == []


def test_simulate_into_a_database_without_the_ledger_schema_is_refused_and_writes_nothing(ledger_target):
    if "://" not in ledger_target:
        sqlite3.connect(ledger_target).close()  # an empty SQLite file: some other database
    result = simulate("happy", "--db", ledger_target)
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr.startswith("error: ")
    assert result.stderr.endswith(f"has no idempotency ledger — run `idemctl --db {shlex.quote(ledger_target)} init`\n")
    with Ledger.open(ledger_target, create=False) as ledger:
        assert ledger.schema_version() is None


@pytest.mark.slow
def test_race_of_real_processes_runs_the_mutation_exactly_once(ledger_target, make_ledger):
    make_ledger()
    doc = timeline("race", "--workers", "6", "--db", ledger_target)
    workers = [e for e in doc["events"] if e["actor"].startswith("w")]
    assert len(workers) == 6
    pids = {e["pid"] for e in workers}
    assert len(pids) == 6 and os.getpid() not in pids
    ran = [e for e in workers if e["outcome"] in ("executed", "taken_over", "fenced_out")]
    assert len(ran) == 1
    assert all(e["outcome"] in ("in_progress", "replayed") for e in workers if e is not ran[0])
    summary = next(e for e in doc["events"] if e["actor"] == "race")
    assert summary["outcome"] == "raced" and summary["detail"].startswith("6 processes, 1 ran the mutation")
    row = make_ledger(init=False).lookup("acct_A", "order-99")
    assert (row.status, row.generation) == (Status.COMPLETED, 1)
    assert json.loads(row.response_body) == {"order": "order-99", "by": ran[0]["actor"]}
    assert doc["events"][-2]["outcome"] == "replayed"


# -- scenario files --------------------------------------------------------------------------------
INCIDENT = """
name = "incident-2211"
description = "a slow charge outlived the TTL"
principal = "acct_Z"
key = "pay-7"
ttl = "10s"
start = 2026-11-28T03:12:00Z

[[step]]
do = "claim"
actor = "worker-1"
expect = "claimed"

[[step]]
do = "advance"
by = "11s"

[[step]]
do = "takeover"
actor = "worker-2"
expect = "taken_over"

[[step]]
do = "complete"
actor = "worker-2"
response = { status = 202, body = '{"ok":true}', headers = { "Location" = "/pay/7" } }
expect = "stored"

[[step]]
do = "complete"
actor = "worker-1"
generation = 1
expect = "fenced_out"

[[step]]
do = "request"
actor = "client"
expect = "replayed"

[[step]]
do = "inspect"

[[step]]
do = "purge"
expect = "purged"

[[step]]
do = "request"
actor = "client"
expect = "executed"

[[step]]
do = "advance"
by = "25h"

[[step]]
do = "sweep"
batch = 5
until_empty = true
expect = "drained"
"""


def test_a_scenario_file_reproduces_an_incident_step_by_step(tmp_path):
    path = tmp_path / "incident.toml"
    path.write_text(INCIDENT)
    doc = timeline("--file", str(path))
    assert doc["scenario"] == "incident-2211" and doc["pending_ttl_ms"] == 10_000
    assert doc["start"] == 1_795_835_520_000  # 2026-11-28T03:12:00Z
    assert outcomes(doc) == [
        ("worker-1", "claimed"),
        ("clock", "advanced"),
        ("worker-2", "taken_over"),
        ("worker-2", "stored"),
        ("worker-1", "fenced_out"),
        ("client", "replayed"),
        ("A", "inspected"),
        ("A", "purged"),
        ("client", "executed"),
        ("clock", "advanced"),
        ("sweeper", "swept"),
        ("sweeper", "drained"),
    ]
    assert doc["events"][5]["detail"] == 'replayed 202 {"ok":true} from generation 2; nothing ran'
    # The row goes; its fenced-out event stays for the log's own 30-day retention.
    assert doc["events"][10]["deleted"] == 1 and doc["ok"] is True
    assert doc["events"][10]["detail"] == "batch 1 (at most 5): deleted 1 rows"


def test_a_failed_expectation_exits_1_with_one_line_after_the_table(tmp_path):
    path = tmp_path / "wrong.toml"
    path.write_text('[[step]]\ndo = "request"\n[[step]]\ndo = "request"\nexpect = "executed"\n')
    result = simulate("--file", str(path))
    assert result.exit_code == 1
    assert "replayed 201" in result.stdout and "expected executed" in result.stdout
    assert result.stderr == "simulation wrong: step 2 (A request) expected executed, got replayed\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[[step]]\ndo = "explode"\n',
            "step 1: unknown step 'explode' (one of: request, claim, takeover, complete, release, advance, sweep, inspect, purge, fill, race)",
        ),
        ('[[step]]\nactor = "A"\n', "step 1: missing `do`"),
        (
            '[[step]]\ndo = "claim"\n[[step]]\ndo = "complete"\ngeneraton = 1\n',
            "step 2 (do = \"complete\"): unknown field 'generaton'",
        ),
        ('[[step]]\ndo = "advance"\nby = "31"\n', "step 1 (do = \"advance\"): by: duration '31' needs a unit"),
        ('[[step]]\ndo = "advance"\n', 'step 1 (do = "advance"): missing `by`'),
        ('[[step]]\ndo = "request"\nexpect = "great"\n', "step 1 (do = \"request\"): expect 'great' is not an outcome"),
        ('[[step]]\ndo = "race"\nworkers = 1\n', 'step 1 (do = "race"): workers must be an integer >= 2, got 1'),
        (
            '[[step]]\ndo = "request"\nresponse = { status = "ok" }\n',
            'step 1 (do = "request"): response.status must be an integer >= 100',
        ),
        ('[[step]]\ndo = "complete"\n', "step 1 (do = \"complete\"): actor 'A' holds no reservation on acct_A/order-1"),
        ('name = "x"\n', "no steps: add at least one [[step]] table"),
        ('colour = "red"\n[[step]]\ndo = "request"\n', "unknown top-level field 'colour'"),
        ("[[step]\n", "invalid TOML: Expected ']]'"),
    ],
    ids=[
        "unknown-op",
        "missing-do",
        "unknown-field",
        "bad-duration",
        "missing-by",
        "bad-expect",
        "one-worker",
        "bad-status",
        "no-reservation",
        "no-steps",
        "unknown-top",
        "bad-toml",
    ],
)
def test_a_malformed_scenario_file_is_one_line_naming_the_bad_step(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    result = simulate("--file", str(path))
    assert result.exit_code == 2 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"error: {path}") and message in lines[0], lines[0]


def test_the_scenario_engine_is_usable_from_python():
    tl = run_scenario(builtin("takeover"))
    assert tl.ok and tl.database is None
    assert [e.outcome for e in tl.events if e.op.value == "request"] == [Outcome.TAKEN_OVER, Outcome.REPLAYED]
    with pytest.raises(ScenarioError, match="unknown scenario 'x'"):
        builtin("x")
    with pytest.raises(ScenarioError, match="step 1: must be a table"):
        parse_scenario({"step": ["claim"]})


# -- the README's first command ----------------------------------------------------------------------
@pytest.mark.slow
def test_readme_first_command_runs_twice_in_a_row_with_the_installed_script(tmp_path):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first = readme.split("```sh\n", 1)[1].split("\n```", 1)[0]
    assert first.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install . && ")
    chain = first.split("pip install . && ", 1)[1]
    assert chain == (
        "idemctl --db demo.db init && idemctl --db demo.db simulate takeover && "
        "idemctl --db demo.db inspect order-42 --principal acct_A"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("IDEMCTL_")}
    env["PATH"] = f"{IDEMCTL.parent}{os.pathsep}{env.get('PATH', '')}"
    for run in (1, 2):
        done = subprocess.run(["sh", "-c", chain], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (run, done.stdout, done.stderr)
        assert done.stderr == ""
        out = done.stdout
        assert ("demo.db: created (schema version 3)" if run == 1 else "already up to date") in out
        assert "every step went as expected" in out
        assert "acct_A / order-42" in out and "2 (taken over once)" in out
        assert f"fenced-out events ({run}): a late owner's answer was not stored" in out
    with Ledger.open(tmp_path / "demo.db", create=False) as ledger:
        row = ledger.lookup("acct_A", "order-42")
        assert (row.status, row.generation) == (Status.COMPLETED, 2)
    assert not (tmp_path / "idempotency.db").exists()  # the Flask example's ledger stays untouched


def test_a_complete_after_a_takeover_that_found_nothing_is_a_failed_step_not_a_crash(tmp_path):
    path = tmp_path / "early.toml"
    path.write_text(
        '[[step]]\ndo = "claim"\n[[step]]\ndo = "takeover"\nactor = "B"\n[[step]]\ndo = "complete"\nactor = "B"\n'
    )
    result = simulate("--file", str(path))
    assert result.exit_code == 1
    assert "not_taken_over" in result.stdout
    assert "actor B holds no reservation: its claim or takeover did not succeed" in result.stdout
    assert result.stderr == (
        "simulation early: step 3 (B complete) actor B holds no reservation: its claim or takeover did not succeed "
        "(give generation = N)\n"
    )


def test_the_documented_scenario_file_example_runs_as_documented(tmp_path):
    page = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    example = page.split("```toml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "incident.toml"
    path.write_text(example)
    doc = timeline("--file", str(path))
    assert outcomes(doc) == [
        ("worker-1", "claimed"),
        ("clock", "advanced"),
        ("client", "taken_over"),
        ("worker-1", "fenced_out"),
    ]
    assert doc["ok"] is True
    path.write_text(example.replace("generation = 1", "generaton = 1"))
    typo = simulate("--file", str(path))
    assert typo.exit_code == 2
    assert typo.stderr == (
        f"error: {path}: step 4 (do = \"complete\"): unknown field 'generaton' "
        "(allowed: actor, expect, generation, key, principal, response)\n"
    )


def test_a_race_worker_that_cannot_open_the_ledger_is_reported_not_hung(tmp_path):
    from idemctl import Policy
    from idemctl.cli.race import race_processes

    step = builtin("race", workers=2).steps[0]
    results = race_processes(str(tmp_path / "gone.db"), step, Policy(), 1_700_000_000_000)
    assert [(r.worker, r.outcome) for r in results] == [(1, None), (2, None)]
    assert all(r.error == f"LedgerNotFoundError: no ledger at {tmp_path / 'gone.db'}" for r in results)


def test_simulate_says_where_it_ran_and_never_prints_a_password(ledger_target, backend_name, make_ledger):
    make_ledger()
    target = ledger_target.replace("postgresql://postgres@", "postgresql://postgres:pw-s3cret@")
    text = simulate("happy", "--db", target)
    as_json = simulate("happy", "--db", target, "--json")
    assert text.exit_code == as_json.exit_code == 0, text.stderr
    assert "pw-s3cret" not in text.output and "pw-s3cret" not in as_json.output
    shown = json.loads(as_json.stdout)["database"]
    if backend_name == "sqlite":
        assert shown == ledger_target and f"ledger {ledger_target};" in text.stdout
    elif backend_name in (
        "mysql",
        "redis",
        "redis-cluster",
    ):  # the test servers have no password to hide: only the form is checked here
        assert shown == ledger_target and f"ledger {shown};" in text.stdout
    else:
        assert shown.startswith("postgresql://postgres@127.0.0.1") and f"ledger {shown};" in text.stdout


def test_completing_as_the_live_generation_stores_the_answer_and_records_no_fenced_event(
    ledger_target, make_ledger, tmp_path
):
    # The documented example with the wait shortened below the TTL: nothing takes
    # over, so worker-1 (generation 1) is still the owner when it completes.
    page = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    example = page.split("```toml\n", 1)[1].split("```", 1)[0]
    example = example.replace('by = "11s"', 'by = "5s"').replace('expect = "taken_over"', 'expect = "in_progress"')
    example = example.replace('expect = "fenced_out"', 'expect = "stored"')
    scenario = tmp_path / "incident.toml"
    scenario.write_text(example)
    make_ledger()
    result = simulate("--file", str(scenario), "--db", ledger_target, "--json")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    doc = json.loads(result.stdout)
    assert outcomes(doc) == [
        ("worker-1", "claimed"),
        ("clock", "advanced"),
        ("client", "in_progress"),
        ("worker-1", "stored"),
    ]
    assert doc["events"][-1]["detail"].startswith("stored 20")
    assert doc["events"][-1]["generation"] == 1
    ledger = make_ledger(init=False, clock_fn=None)
    row = ledger.lookup("acct_Z", "pay-7")
    assert (row.status, row.generation) == (Status.COMPLETED, 1)
    assert list(ledger.operator.fenced(principal="acct_Z", key="pay-7")) == []
    stats = CliRunner().invoke(app, ["--db", ledger_target, "stats", "--max-fenced", "0"])
    assert stats.exit_code == 0, (stats.stdout, stats.stderr)


def test_completing_as_a_generation_no_step_claimed_is_a_failed_step_that_writes_nothing(tmp_path):
    path = tmp_path / "made-up.toml"
    path.write_text('[[step]]\ndo = "claim"\n[[step]]\ndo = "complete"\nactor = "B"\ngeneration = 2\n')
    result = simulate("--file", str(path), "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert outcomes(doc)[-1] == ("B", "error")
    assert doc["events"][-1]["detail"] == (
        "no step claimed or took over generation 2 of acct_A/order-1: nothing to act as"
    )
    assert doc["events"][-1]["row"]["status"] == "pending"
