"""The idemctl CLI commands through CliRunner: stdout and stderr checked
separately, then the ledger checked through the library."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from idemctl import Ledger, Policy, State, Status, fingerprint, wall_clock_ms
from idemctl.cli import app
from idemctl.outcomes import PurgeOutcome
from idemctl.schema import schema_files
from tests.helpers import fingerprint_post_orders

SECOND = 1000
MINUTE = 60 * SECOND
HOUR = 60 * MINUTE
FP = fingerprint("POST", "/orders", [("Content-Type", "application/json")], b'{"sku":"book"}')
JSON_HEADERS = (("Content-Type", "application/json"), ("Location", "/orders/42"))


# --help and tables are wrapped to this terminal width (tests/cli/conftest.py).
TERMINAL_COLUMNS = "200"


class Run:
    """A finished invocation; rich pads table cells, so stdout lines are right-stripped."""

    def __init__(self, result) -> None:
        self.exit_code = result.exit_code
        self.stdout = "".join(line.rstrip() + "\n" for line in result.stdout.splitlines())
        self.raw_stdout = result.stdout
        self.stderr = result.stderr


def cli(*args: str, input: str | bytes | None = None, env: dict[str, str] | None = None) -> Run:
    result = CliRunner().invoke(app, list(args), input=input, env=env)
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return Run(result)


def one_line(result) -> str:
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture
def at(clock):
    """Move the shared fake clock to "now minus ms" on the wall clock: the CLI reads the real time."""

    def move(ago_ms: int) -> int:
        clock.now = wall_clock_ms() - ago_ms
        return clock.now

    return move


def taken_over_row(ledger: Ledger, at, principal: str = "acct_A", key: str = "order-42", ago_ms: int = 3 * HOUR):
    """A row claimed, stalled past the TTL, taken over as generation 2 and
    completed, with the first owner's late completion fenced out."""
    at(ago_ms + 40 * SECOND)
    first = ledger.claim(principal, key, FP)
    at(ago_ms + 5 * SECOND)
    second = ledger.takeover(principal, key, FP)
    at(ago_ms)
    assert ledger.complete(second, 201, JSON_HEADERS, b'{"id":42,"by":"B"}').stored
    at(ago_ms - SECOND)
    assert not ledger.complete(first, 201, JSON_HEADERS, b'{"id":42,"by":"A"}').stored


# -- init ------------------------------------------------------------------------------------
def test_init_creates_the_schema_then_reports_already_up_to_date(tmp_path):
    db = tmp_path / "new.db"
    first = cli("init", "--db", str(db))
    assert (first.exit_code, first.stdout, first.stderr) == (0, f"{db}: created (schema version 3)\n", "")
    again = cli("--db", str(db), "init")
    assert (again.exit_code, again.stdout) == (0, f"{db}: already up to date (schema version 3)\n")
    with Ledger.open(db, create=False) as ledger:
        assert ledger.schema_version() == 3


def test_init_dry_run_on_a_missing_file_creates_nothing(tmp_path):
    db = tmp_path / "missing.db"
    result = cli("init", "--dry-run", "--db", str(db))
    assert result.exit_code == 0
    assert result.stdout == f"{db}: would create a new ledger (schema version 3); nothing written\n"
    assert result.stderr == ""
    assert list(tmp_path.iterdir()) == []


def test_init_upgrades_a_recipe_only_database_and_keeps_its_rows(tmp_path):
    db = tmp_path / "recipe.db"
    conn = sqlite3.connect(db)
    conn.executescript(next(f.sql for f in schema_files("sqlite") if f.version == 0))
    conn.execute(
        "INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, response_status, "
        "response_body, response_headers, created_at, updated_at) VALUES ('acct_A', 'k1', ?, 'completed', 1, 201, "
        "'{\"id\":1}', '{}', 1, 1)",
        (FP,),
    )
    conn.commit()
    conn.close()

    dry = cli("init", "--dry-run", "--db", str(db))
    assert (
        dry.stdout
        == f"{db}: would upgrade from 0 to 3 (adds idemctl tables and columns, no row touched); nothing written\n"
    )
    with Ledger.open(db, create=False, readonly=True) as ledger:
        assert ledger.schema_version() == 0

    done = cli("init", "--db", str(db))
    assert (done.exit_code, done.stdout) == (0, f"{db}: upgraded from 0 to 3\n")
    with Ledger.open(db, create=False) as ledger:
        assert ledger.schema_version() == 3
        assert ledger.lookup("acct_A", "k1").response_body == '{"id":1}'


def test_read_commands_work_on_a_recipe_only_database_and_write_nothing(tmp_path):
    db = tmp_path / "recipe.db"
    conn = sqlite3.connect(db)
    conn.executescript(next(f.sql for f in schema_files("sqlite") if f.version == 0))
    now = wall_clock_ms()
    conn.executemany(
        "INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, response_status, "
        "response_body, response_headers, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [
            (
                "acct_A",
                "done",
                FP,
                "completed",
                2,
                201,
                '{"id":1}',
                '{"content-type":"application/json"}',
                now - HOUR,
                now - HOUR,
            ),
            ("acct_A", "stuck", FP, "pending", 1, None, None, None, now - MINUTE, now - MINUTE),
            ("acct_A", "ancient", FP, "completed", 1, 201, "{}", "{}", now - 48 * HOUR, now - 48 * HOUR),
        ],
    )
    conn.commit()
    conn.close()
    before = db.read_bytes()

    inspect = cli("inspect", "done", "-p", "acct_A", "--db", str(db))
    assert inspect.exit_code == 0
    assert re.search(r"^generation\s+2 \(taken over once\)$", inspect.stdout, re.M)
    assert inspect.stdout.rstrip().endswith(
        f"fenced-out events: not recorded (this ledger has only the recipe's table; `idemctl --db {db} init` adds the log)"
    )
    pending = json.loads(cli("pending", "--json", "--db", str(db)).stdout)
    assert [(r["key"], r["takes_over_now"]) for r in pending["rows"]] == [("stuck", True)]
    stats = json.loads(cli("stats", "--json", "--db", str(db)).stdout)
    assert (stats["total"], stats["expired"], stats["taken_over"], stats["schema_version"]) == (3, 1, 1, 0)
    dry = json.loads(cli("sweep", "--dry-run", "--json", "--db", str(db)).stdout)
    assert dry["would_delete"] == 1
    assert db.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.db"]


def test_fenced_on_a_recipe_only_database_says_nothing_records_them(tmp_path):
    db = tmp_path / "recipe.db"
    conn = sqlite3.connect(db)
    conn.executescript(next(f.sql for f in schema_files("sqlite") if f.version == 0))
    conn.close()
    result = cli("fenced", "--db", str(db))
    assert result.exit_code == 0
    assert (
        result.stdout
        == f"no fenced-out log: this ledger has only the recipe's table; `idemctl --db {db} init` adds it\n"
    )
    as_json = json.loads(cli("fenced", "--json", "--db", str(db)).stdout)
    assert (as_json["fenced_log"], as_json["events"]) == (False, [])
    as_lines = cli("fenced", "--nl", "--db", str(db))
    assert (as_lines.exit_code, as_lines.stdout) == (0, "")
    assert (
        as_lines.stderr
        == f"no fenced-out log: this ledger has only the recipe's table; `idemctl --db {db} init` adds it\n"
    )


# -- inspect -----------------------------------------------------------------------------------
def test_inspect_completed_taken_over_row_shows_state_generation_response_and_fenced_event(
    make_ledger, ledger_target, at
):
    ledger = make_ledger()
    taken_over_row(ledger, at)
    result = cli("inspect", "order-42", "--principal", "acct_A", "--db", ledger_target)
    assert result.exit_code == 0 and result.stderr == ""
    out = result.stdout
    lines = [line.rstrip() for line in out.splitlines()]
    assert lines[0] == "acct_A / order-42"
    assert re.search(
        r"^state\s+completed 3 h ago: replayed until \S+:\d\dZ \(in 21 h\); the sweep may delete it after that$",
        out,
        re.M,
    )
    assert re.search(r"^status\s+completed$", out, re.M)
    assert re.search(r"^generation\s+2 \(taken over once\)$", out, re.M)
    assert re.search(rf"^fingerprint\s+{FP}$", out, re.M)
    assert re.search(r"^response\s+201 · 18 bytes, JSON$", out, re.M)
    assert re.search(r"^headers\s+content-type: application/json$", out, re.M)
    assert re.search(r"^\s+location: /orders/42$", out, re.M)
    assert '"by": "B"' in out  # the body, pretty-printed
    assert "fenced-out events (1): a late owner's answer was not stored" in out
    assert re.search(r"^\s*\S+Z\s+3 h ago\s+1\s+2\s+201$", out, re.M)


def test_inspect_pending_row_says_how_long_retries_get_409_and_who_takes_over(make_ledger, ledger_target, at):
    ledger = make_ledger()
    at(12 * SECOND)
    ledger.claim("acct_A", "order-7", FP)
    result = cli("inspect", "order-7", "-p", "acct_A", "--db", ledger_target)
    assert result.exit_code == 0
    assert re.search(
        r"^state\s+pending, 1[23] s old: retries get 409 for 1[678] s more, then the next retry takes over as generation 2$",
        result.stdout,
        re.M,
    )
    assert re.search(r"^response\s+none yet: the row is pending$", result.stdout, re.M)
    assert "fenced-out events: none" in result.stdout

    stale = cli("--ttl", "10s", "inspect", "order-7", "-p", "acct_A", "--db", ledger_target)
    assert re.search(
        r"^state\s+pending, 1[23] s old, past the 10 s TTL: the next retry takes over as generation 2$",
        stale.stdout,
        re.M,
    )


def test_inspect_json_has_the_documented_fields(make_ledger, ledger_target, at):
    ledger = make_ledger()
    taken_over_row(ledger, at)
    result = cli("inspect", "order-42", "-p", "acct_A", "--json", "--db", ledger_target)
    assert result.exit_code == 0 and result.stderr == ""
    doc = json.loads(result.stdout)
    assert sorted(doc) == sorted(
        [
            "found",
            "principal",
            "key",
            "status",
            "generation",
            "takeovers",
            "fingerprint",
            "created_at",
            "updated_at",
            "response",
            "state",
            "state_text",
            "now",
            "age_ms",
            "pending_ttl_ms",
            "retention_ms",
            "takeover_at",
            "takeover_in_ms",
            "takes_over_now",
            "replay_until",
            "sweep_after",
            "fenced_out",
        ]
    )
    assert (doc["found"], doc["status"], doc["state"], doc["generation"], doc["takeovers"]) == (
        True,
        "completed",
        "completed",
        2,
        1,
    )
    assert doc["response"] == {
        "status": 201,
        "headers": {"content-type": "application/json", "location": "/orders/42"},
        "body_kind": "json",
        "body_bytes": 18,
        "body": '{"id":42,"by":"B"}',
        "body_base64": None,
        "oversize_sentinel": False,
    }
    assert doc["replay_until"] == doc["updated_at"] + 24 * HOUR
    assert doc["takeover_at"] is None and doc["takes_over_now"] is False
    [event] = doc["fenced_out"]
    assert {
        k: event[k] for k in ("principal", "key", "superseded_generation", "current_generation", "computed_status")
    } == {
        "principal": "acct_A",
        "key": "order-42",
        "superseded_generation": 1,
        "current_generation": 2,
        "computed_status": 201,
    }


def test_inspect_shows_blob_bodies_as_hex_and_the_oversize_sentinel_as_such(make_ledger, ledger_target, at):
    ledger = make_ledger(policy=Policy(body_cap_bytes=64))
    at(MINUTE)
    blob = ledger.claim("acct_A", "blob", FP)
    ledger.complete(blob, 200, {"content-type": "application/octet-stream"}, b"\xff\x00\xfe" * 20)
    big = ledger.claim("acct_A", "big", FP)
    assert ledger.complete(big, 201, JSON_HEADERS, b"x" * 65).oversize

    out = cli("inspect", "blob", "-p", "acct_A", "--db", ledger_target).stdout
    assert re.search(r"^response\s+200 · 60 bytes, BLOB \(not UTF-8\): replayed byte for byte$", out, re.M)
    assert "ff 00 fe ff 00 fe" in out and out.rstrip().endswith("fenced-out events: none")
    doc = json.loads(cli("inspect", "blob", "-p", "acct_A", "--json", "--db", ledger_target).stdout)
    assert doc["response"]["body_kind"] == "blob" and doc["response"]["body"] is None
    assert doc["response"]["body_base64"] == "/wD+" * 20

    out = cli("inspect", "big", "-p", "acct_A", "--db", ledger_target).stdout
    assert re.search(r"^response\s+500 · no body: the real answer was over the body cap", out, re.M)
    doc = json.loads(cli("inspect", "big", "-p", "acct_A", "--json", "--db", ledger_target).stdout)
    assert doc["response"]["oversize_sentinel"] is True and doc["response"]["status"] == 500


def test_inspect_a_missing_row_exits_1_with_one_line(make_ledger, ledger_target):
    make_ledger()
    result = cli("inspect", "nope", "--principal", "acct_A", "--db", ledger_target)
    assert result.exit_code == 1
    assert result.stdout == ""
    assert (
        one_line(result) == "no row for principal 'acct_A' key 'nope': the next request with this key runs the mutation"
    )


def test_inspect_json_of_a_missing_row_is_a_document_saying_not_found_and_exits_1(make_ledger, ledger_target):
    make_ledger()
    result = cli("inspect", "nope", "--principal", "acct_A", "--json", "--db", ledger_target)
    assert result.exit_code == 1
    assert result.stdout == '{\n  "found": false,\n  "principal": "acct_A",\n  "key": "nope"\n}\n'
    assert (
        one_line(result) == "no row for principal 'acct_A' key 'nope': the next request with this key runs the mutation"
    )
    installed = subprocess.run(
        [
            str(Path(sys.executable).with_name("idemctl")),
            "inspect",
            "nope",
            "-p",
            "acct_A",
            "--json",
            "--db",
            ledger_target,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (installed.returncode, json.loads(installed.stdout)) == (
        1,
        {"found": False, "principal": "acct_A", "key": "nope"},
    )


# -- pending ----------------------------------------------------------------------------------
def seed_pending(ledger: Ledger, at) -> None:
    for principal, key, age in (
        ("acct_A", "fresh", 5 * SECOND),
        ("acct_B", "stale", 2 * MINUTE),
        ("acct_A", "old", HOUR),
    ):
        at(age)
        ledger.claim(principal, key, FP)
    at(10 * MINUTE)
    done = ledger.claim("acct_A", "done", FP)
    ledger.complete(done, 201, JSON_HEADERS, b"{}")


def test_pending_lists_oldest_first_with_whether_a_retry_takes_over_now(make_ledger, ledger_target, at):
    seed_pending(make_ledger(), at)
    result = cli("pending", "--db", ledger_target)
    assert result.exit_code == 0 and result.stderr == ""
    lines = [line for line in result.stdout.splitlines() if line.strip().startswith("acct_")]
    assert [line.split()[:3] for line in lines] == [
        ["acct_A", "old", "1"],
        ["acct_B", "stale", "1"],
        ["acct_A", "fresh", "1"],
    ]
    assert re.fullmatch(r"\s*acct_A\s+old\s+1\s+1 h\s+takes over as generation 2", lines[0])
    assert re.fullmatch(r"\s*acct_B\s+stale\s+1\s+2 min\s+takes over as generation 2", lines[1])
    assert re.fullmatch(r"\s*acct_A\s+fresh\s+1\s+[56] s\s+409 in progress for 2[345] s more", lines[2])
    assert result.stdout.splitlines()[-1] == "3 pending row(s), oldest first; TTL 30 s"


def test_pending_filters_stale_principal_and_limit_and_says_when_truncated(make_ledger, ledger_target, at):
    seed_pending(make_ledger(), at)
    stale = json.loads(cli("pending", "--stale", "--json", "--db", ledger_target).stdout)
    assert [r["key"] for r in stale["rows"]] == ["old", "stale"]
    assert all(r["takes_over_now"] for r in stale["rows"]) and stale["truncated"] is False
    only_a = json.loads(cli("pending", "--principal", "acct_A", "--json", "--db", ledger_target).stdout)
    assert [r["key"] for r in only_a["rows"]] == ["old", "fresh"]
    assert only_a["rows"][1]["state"] == "pending_fresh" and only_a["rows"][1]["takes_over_now"] is False
    limited = json.loads(cli("pending", "--limit", "1", "--json", "--db", ledger_target).stdout)
    assert [r["key"] for r in limited["rows"]] == ["old"] and limited["truncated"] is True
    text = cli("pending", "--limit", "1", "--db", ledger_target).stdout
    assert text.splitlines()[-1] == "1 pending row(s), oldest first; TTL 30 s; more exist (--limit 2 or 0 for all)"
    none = cli("pending", "--principal", "acct_C", "--db", ledger_target)
    assert (none.exit_code, none.stdout) == (0, "no pending rows\n")


# -- fenced -----------------------------------------------------------------------------------
def test_fenced_lists_events_newest_first_filtered_by_principal_and_since(make_ledger, ledger_target, at):
    ledger = make_ledger()
    taken_over_row(ledger, at, "acct_A", "old-one", ago_ms=3 * HOUR)
    taken_over_row(ledger, at, "acct_B", "new-one", ago_ms=10 * MINUTE)
    result = cli("fenced", "--db", ledger_target)
    assert result.exit_code == 0 and result.stderr == ""
    rows = [line.split() for line in result.stdout.splitlines() if "acct_" in line]
    assert [(r[-5], r[-4], r[-3], r[-2], r[-1]) for r in rows] == [
        ("acct_B", "new-one", "1", "2", "201"),
        ("acct_A", "old-one", "1", "2", "201"),
    ]
    assert result.stdout.splitlines()[-1].startswith("2 event(s), newest first; late: the superseded owner")

    recent = json.loads(cli("fenced", "--since", "1h", "--json", "--db", ledger_target).stdout)
    assert [e["key"] for e in recent["events"]] == ["new-one"]
    assert sorted(recent["events"][0]) == sorted(
        ["id", "principal", "key", "superseded_generation", "current_generation", "computed_status", "fenced_at"]
    )
    only_a = json.loads(cli("fenced", "-p", "acct_A", "--json", "--db", ledger_target).stdout)
    assert [e["key"] for e in only_a["events"]] == ["old-one"]
    limited = json.loads(cli("fenced", "--limit", "1", "--json", "--db", ledger_target).stdout)
    assert len(limited["events"]) == 1 and limited["truncated"] is True
    empty = cli("fenced", "--since", "1m", "--db", ledger_target)
    assert empty.stdout == "no fenced-out events in the last 1 min\n"


# -- stats -----------------------------------------------------------------------------------
def test_stats_counts_rows_by_state_expired_and_fenced_events(make_ledger, ledger_target, at):
    ledger = make_ledger()
    seed_pending(ledger, at)  # fresh, stale (2 min), stale (1 h), completed
    taken_over_row(ledger, at, ago_ms=3 * HOUR)  # completed, taken over, one fenced event
    at(30 * HOUR)
    expired = ledger.claim("acct_C", "ancient", FP)
    ledger.complete(expired, 201, JSON_HEADERS, b"{}")

    doc = json.loads(cli("stats", "--json", "--db", ledger_target).stdout)
    assert {
        k: doc[k]
        for k in ("total", "pending_fresh", "pending_stale", "completed", "expired", "taken_over", "fenced_out_events")
    } == {
        "total": 6,
        "pending_fresh": 1,
        "pending_stale": 2,
        "completed": 2,
        "expired": 1,
        "taken_over": 1,
        "fenced_out_events": 1,
    }
    assert doc["oldest_row_at"] == doc["oldest_completed_at"] < doc["oldest_pending_at"]
    assert (doc["pending_ttl_ms"], doc["retention_ms"], doc["schema_version"], doc["check_failed"]) == (
        30_000,
        86_400_000,
        3,
        [],
    )

    text = cli("stats", "--db", ledger_target)
    assert text.exit_code == 0 and text.stderr == ""
    assert re.search(r"^  expired\s+1  \(past the 1 d retention: the sweep deletes them\)$", text.stdout, re.M)
    assert re.search(r"^  pending, stale\s+2  \(the next retry takes over, whatever their age\)$", text.stdout, re.M)
    assert re.search(r"^fenced-out events\s+1$", text.stdout, re.M)


def test_stats_thresholds_make_a_cron_check_exit_1_with_one_line(make_ledger, ledger_target, at):
    ledger = make_ledger()
    taken_over_row(ledger, at)
    ok = cli("stats", "--max-fenced", "1", "--max-expired", "0", "--db", ledger_target)
    assert ok.exit_code == 0
    failed = cli("stats", "--max-fenced", "0", "--max-stale", "0", "--json", "--db", ledger_target)
    assert failed.exit_code == 1
    assert one_line(failed) == "check failed: 1 fenced-out events (max 0)"
    assert json.loads(failed.stdout)["check_failed"] == ["1 fenced-out events (max 0)"]


# -- purge -----------------------------------------------------------------------------------
def test_purge_with_yes_deletes_the_row_so_the_next_retry_runs_again(make_ledger, ledger_target, at):
    ledger = make_ledger()
    taken_over_row(ledger, at)
    result = cli("purge", "order-42", "--principal", "acct_A", "--yes", "--db", ledger_target)
    assert result.exit_code == 0 and result.stderr == ""
    assert result.stdout.splitlines()[-1] == (
        "purged acct_A/order-42 (completed, generation 2): the client's next retry runs the mutation again"
    )
    assert ledger.lookup("acct_A", "order-42") is None
    assert ledger.claim("acct_A", "order-42", FP).generation == 1


def test_purge_asks_first_and_keeps_the_row_when_declined(make_ledger, ledger_target, at):
    ledger = make_ledger()
    taken_over_row(ledger, at)
    declined = cli("purge", "order-42", "-p", "acct_A", "--db", ledger_target, input="n\n")
    assert declined.exit_code == 1
    assert declined.stderr.splitlines()[-1] == "not purged"
    assert "Purge acct_A/order-42? The client's next retry will run the mutation again [y/N]" in declined.stderr
    assert declined.stdout.startswith("acct_A / order-42 (generation 2): completed 3 h ago")
    no_answer = cli("purge", "order-42", "-p", "acct_A", "--db", ledger_target)
    assert no_answer.exit_code == 1
    assert no_answer.stderr.splitlines()[-1] == "not purged: no confirmation (pass --yes to skip the prompt)"
    assert ledger.lookup("acct_A", "order-42").generation == 2
    confirmed = cli("purge", "order-42", "-p", "acct_A", "--db", ledger_target, input="y\n")
    assert confirmed.exit_code == 0
    assert ledger.lookup("acct_A", "order-42") is None


def test_purge_refuses_a_fresh_pending_row_unless_forced(make_ledger, ledger_target, at):
    ledger = make_ledger()
    at(3 * SECOND)
    ledger.claim("acct_A", "running", FP)
    refused = cli("purge", "running", "-p", "acct_A", "--yes", "--db", ledger_target)
    assert refused.exit_code == 1
    assert re.fullmatch(
        r"refused: acct_A/running is pending and only [34] s old — its owner may still be running, and purging would let "
        r"a retry run the mutation twice; wait 2[567] s for the TTL, or pass --force",
        one_line(refused),
    )
    assert ledger.lookup("acct_A", "running") is not None
    forced = cli("purge", "running", "-p", "acct_A", "--yes", "--force", "--db", ledger_target)
    assert forced.exit_code == 0
    assert ledger.lookup("acct_A", "running") is None
    assert ledger.operator.purge("acct_A", "running").outcome is PurgeOutcome.NOT_FOUND


def test_purge_of_a_missing_row_exits_1(make_ledger, ledger_target):
    make_ledger()
    result = cli("purge", "ghost", "-p", "acct_A", "--yes", "--db", ledger_target)
    assert result.exit_code == 1 and result.stdout == ""
    assert (
        one_line(result)
        == "no row for principal 'acct_A' key 'ghost': the next request with this key runs the mutation"
    )


# -- fingerprint -------------------------------------------------------------------------------
def test_fingerprint_prints_the_recipe_hash():
    result = cli("fingerprint", "--method", "post", "--path", "/orders")
    assert (result.exit_code, result.stdout, result.stderr) == (
        0,
        "fc4d6d6663d197e95ef43ecc071614db7227f117beb78b985980d692380c7654\n",
        "",
    )


def test_fingerprint_reads_headers_and_the_body_from_a_file_or_stdin(tmp_path):
    body = tmp_path / "body.json"
    body.write_bytes(b'{"sku":"book"}')
    args = fingerprint_post_orders("Content-Type:  application/json ", "User-Agent: x")
    from_file = cli(*args, "--body-file", str(body))
    from_stdin = cli(*args, "--body-file", "-", input=b'{"sku":"book"}')
    from_text = cli(*args, "--body", '{"sku":"book"}')
    assert from_file.stdout == from_stdin.stdout == from_text.stdout == FP + "\n"
    doc = json.loads(cli(*args, "--body-file", str(body), "--json").stdout)
    assert doc == {
        "fingerprint": FP,
        "method": "POST",
        "path_and_query": "/orders",
        "headers": {"content-type": "application/json", "x-api-version": None},
        "body_bytes": 14,
        "body_form": "raw",
        "row": None,
        "matches": None,
        "verdict": None,
    }


def test_fingerprint_with_a_key_says_replay_reused_or_new(make_ledger, ledger_target, at):
    ledger = make_ledger()
    taken_over_row(ledger, at)
    same = fingerprint_post_orders("Content-Type: application/json", body='{"sku":"book"}')
    match = cli(*same, "--key", "order-42", "--principal", "acct_A", "--db", ledger_target)
    assert match.exit_code == 0
    assert match.stdout == f"{FP}\nmatches the stored fingerprint: this request is replayed (201, generation 2)\n"

    other = cli(*same[:-1], '{"sku":"pen"}', "--key", "order-42", "-p", "acct_A", "--db", ledger_target)
    assert other.exit_code == 1
    lines = other.stdout.splitlines()
    assert lines[1] == "does NOT match the stored fingerprint: this request gets 409 idempotency_key_reused"
    assert lines[2] == f"stored: {FP}"

    new = cli(*same, "--key", "order-43", "-p", "acct_A", "--json", "--db", ledger_target)
    assert new.exit_code == 1
    doc = json.loads(new.stdout)
    assert (doc["verdict"], doc["matches"], doc["row"]) == ("new", None, None)

    at(2 * SECOND)
    ledger.claim("acct_A", "busy", FP)
    busy = json.loads(cli(*same, "-k", "busy", "-p", "acct_A", "--json", "--db", ledger_target).stdout)
    assert (busy["verdict"], busy["matches"], busy["row"]["state"]) == ("in_progress", True, "pending_fresh")


# -- global options, help, version ----------------------------------------------------------------
def test_version_and_help_with_an_example_on_every_command():
    from idemctl import __version__

    version = cli("--version")
    assert (version.exit_code, version.stdout) == (0, f"idemctl {__version__}\n")
    top = cli("--help")
    assert top.exit_code == 0
    assert "Exit codes" in top.stdout and "130 interrupted" in top.stdout
    for command in ("init", "inspect", "pending", "fenced", "stats", "sweep", "purge", "fingerprint", "simulate"):
        page = cli(command, "--help")
        assert page.exit_code == 0, command
        assert "Example" in page.stdout and "idemctl " in page.stdout, command


def test_env_vars_choose_the_ledger_and_policy_and_command_options_override_them(
    make_ledger, ledger_target, at, tmp_path
):
    ledger = make_ledger()
    at(12 * SECOND)
    ledger.claim("acct_A", "k", FP)
    env = {"IDEMCTL_DB": ledger_target, "IDEMCTL_PENDING_TTL": "10s"}
    doc = json.loads(cli("inspect", "k", "-p", "acct_A", "--json", env=env).stdout)
    assert (doc["pending_ttl_ms"], doc["state"]) == (10_000, "pending_stale")
    doc = json.loads(cli("inspect", "k", "-p", "acct_A", "--json", "--ttl", "1m", env=env).stdout)
    assert (doc["pending_ttl_ms"], doc["state"]) == (60_000, "pending_fresh")
    elsewhere = cli("--db", str(tmp_path / "other.db"), "inspect", "k", "-p", "acct_A", "--db", ledger_target, "--json")
    assert json.loads(elsewhere.stdout)["key"] == "k"
    assert not (tmp_path / "other.db").exists()
    view = ledger.operator.get("acct_A", "k")
    assert view.state is State.PENDING_FRESH and view.row.status is Status.PENDING


def test_the_examples_in_the_cli_helpers_docstrings_hold():
    import doctest

    import idemctl.cli.documents
    import idemctl.cli.escaping
    import idemctl.cli.scenario
    import idemctl.cli.words
    import idemctl.durations

    modules = (idemctl.durations, idemctl.cli.escaping, idemctl.cli.words, idemctl.cli.documents, idemctl.cli.scenario)
    for module in modules:
        failed, attempted = doctest.testmod(module)
        assert failed == 0 and attempted > 0, module.__name__


@pytest.mark.parametrize(("answer", "code"), [("y\n", 0), ("n\n", 1), (None, 1)], ids=["yes", "no", "no-input"])
def test_purge_with_a_piped_answer_prints_nothing_of_the_prompt_on_stdout(answer, code, tmp_path):
    import os
    import subprocess
    import sys

    db = tmp_path / "ledger.db"
    with Ledger.open(db) as ledger:
        ledger.init()
        ledger.handle("acct_A", "order-42", "POST", "/orders", {}, b"{}", lambda body: (201, {}, b"made"))
    idemctl = os.path.join(os.path.dirname(sys.executable), "idemctl")
    done = subprocess.run(
        [idemctl, "--db", str(db), "purge", "order-42", "-p", "acct_A"],
        input=answer,
        stdin=subprocess.DEVNULL if answer is None else None,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == code, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("acct_A / order-42 (generation 1): completed")  # the row, before the question
    if answer == "y\n":
        assert lines[1:] == [
            "purged acct_A/order-42 (completed, generation 1): the client's next retry runs the mutation again"
        ]
    else:
        assert len(lines) == 1
    assert done.stderr.startswith(
        "Purge acct_A/order-42? The client's next retry will run the mutation again [y/N]: \n"
    )


def test_fingerprint_says_the_reuse_status_the_apps_policy_answers(tmp_path):
    db = tmp_path / "ledger.db"
    policy = Policy(reuse_status=422)
    with Ledger.open(db, policy=policy) as ledger:
        ledger.init()
        ledger.handle("acct_A", "k1", "POST", "/orders", {}, b"one", lambda body: (201, {}, b"made"))
        answered = ledger.handle("acct_A", "k1", "POST", "/orders", {}, b"two", lambda body: (201, {}, b"again"))
    assert answered.status == 422
    asked = [
        "--db",
        str(db),
        "fingerprint",
        "-X",
        "POST",
        "--path",
        "/orders",
        "--body",
        "two",
        "-k",
        "k1",
        "-p",
        "acct_A",
    ]
    by_policy = cli(*asked, "--reuse-status", "422")
    assert by_policy.exit_code == 1
    assert by_policy.stdout.splitlines()[1] == (
        "does NOT match the stored fingerprint: this request gets 422 idempotency_key_reused"
    )
    default = cli(*asked)
    assert default.stdout.splitlines()[1] == (
        "does NOT match the stored fingerprint: this request gets 409 idempotency_key_reused"
    )
    wrong = cli(*asked, "--reuse-status", "400")
    assert (wrong.exit_code, wrong.stdout) == (2, "")
    assert wrong.stderr == "error: --reuse-status must be 409 or 422 (the Policy's choices), got 400\n"
