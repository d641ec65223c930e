"""Human output never loses a character to the terminal's width: piped (stdout
not a terminal) every record is one whole line without trailing blanks, so
`idemctl fenced | grep <key>` finds the event with its status; on a narrow
terminal a listing that cannot fit becomes one block per record rather than
dropping a column or breaking a key. Run through the installed `idemctl` at
COLUMNS=80, with a pipe and with a pseudo-terminal."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest

from idemctl import Ledger, wall_clock_ms
from idemctl.durations import iso
from tests.helpers import read_terminal

IDEMCTL = Path(sys.executable).with_name("idemctl")
DAY = 86_400_000
# Principals longer than a column of an 80-column table, and UUID keys.
P1 = "acct_live_9f2c1b7e4d3a4e21b6c8f0a1d2e3f4a5"
P2 = "org_enterprise_customer_with_a_long_name_42"
K1 = "3f1c2a9e-8b7d-4c6e-9a5f-0e1d2c3b4a59"
K2 = "7d3e0f4b-2c1a-4b9e-8f6d-5a4c3b2e1d0f"
K3 = "b2c4e6f8-1a3b-4c5d-8e9f-0a1b2c3d4e5f"
K4 = "e1d2c3b4-a5f6-4e7d-9c8b-7a6f5e4d3c2b"
FENCED_SUMMARY = (
    "2 event(s), newest first; late: the superseded owner's generation, row: the generation holding the row, "
    "status: what the late owner computed (not stored). Each means a mutation may have run twice"
)

pytestmark = pytest.mark.slow  # every test starts the installed command


def env(columns: int = 80, **extra: str) -> dict[str, str]:
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("IDEMCTL_") and k not in ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TERM")
    }
    return {**clean, "COLUMNS": str(columns), **extra}


def piped(*args: str) -> str:
    """The installed idemctl with stdout a pipe, at 80 columns."""
    done = subprocess.run([str(IDEMCTL), *args], capture_output=True, text=True, env=env(), timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def on_terminal(*args: str, columns: int) -> str:
    """The installed idemctl with stdout a pseudo-terminal `columns` wide;
    rich's styles are taken out, and the terminal's CR LF read as LF."""
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            [str(IDEMCTL), *args], stdout=slave, stderr=subprocess.PIPE, env=env(columns, TERM="xterm")
        )
        os.close(slave)
        seen = read_terminal(master)
        proc.wait(timeout=60)
    finally:
        os.close(master)
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
    if proc.stderr:
        proc.stderr.close()
    return re.sub(r"\x1b\[[0-9;]*m", "", seen.decode().replace("\r\n", "\n"))


@pytest.fixture
def wide_rows_db(tmp_path: Path) -> str:
    """Two fenced-out events and two stale pending rows, on long principals
    and UUID keys; every instant whole days back, so that the ages printed
    ("2 d ago") are the same however long the test takes."""
    path = str(tmp_path / "ledger.db")
    now = wall_clock_ms()
    t = [0]
    with Ledger.open(path, clock=lambda: t[0]) as ledger:
        ledger.init()
        for i, (principal, key, status) in enumerate(((P1, K1, 201), (P2, K2, 202))):
            t[0] = now - 2 * DAY - 60_000 + i * 10_000
            late = ledger.claim(principal, key, "fp")
            t[0] += 35_000
            assert ledger.complete(ledger.takeover(principal, key, "fp"), 201, {}, b"{}").stored
            t[0] += 5_000
            assert not ledger.complete(late, status, {}, b"{}").stored
        for principal, key, days in ((P1, K3, 3), (P2, K4, 2)):
            t[0] = now - days * DAY
            ledger.claim(principal, key, "fp")
    return path


def fenced_times(wide_rows_db: str) -> list[str]:
    with Ledger.open(wide_rows_db, create=False) as ledger:
        return [iso(e.fenced_at, millis=False) for e in ledger.operator.fenced()]


# -- piped --------------------------------------------------------------------------------------
def test_piped_fenced_keeps_each_event_whole_on_one_line_so_grep_finds_key_and_status(wide_rows_db):
    out = piped("fenced", "--db", wide_rows_db)
    newer, older = fenced_times(wide_rows_db)
    # The header first (`idemctl fenced | head -1`), no edge, no blank line.
    assert out.splitlines() == [
        "fenced at (UTC)        age       principal                                     key"
        "                                    late   row   status",
        "─" * 137,
        f"{newer}   2 d ago   {P2}   {K2}      1     2      202",
        f"{older}   2 d ago   {P1}    {K1}      1     2      201",
        FENCED_SUMMARY,
    ]
    # What `idemctl fenced | grep <key>` and `| grep 201` print.
    assert [line for line in out.splitlines() if K1 in line] == [
        f"{older}   2 d ago   {P1}    {K1}      1     2      201"
    ]
    assert [line for line in out.splitlines() if "201" in line] == [
        f"{older}   2 d ago   {P1}    {K1}      1     2      201"
    ]


def test_piped_pending_keeps_each_row_whole_on_one_line_without_trailing_blanks(wide_rows_db):
    out = piped("pending", "--db", wide_rows_db)
    assert out.splitlines() == [
        "principal                                     key                                    gen   age   a retry now",
        "─" * 123,
        f"{P1}    {K3}   1     3 d   takes over as generation 2",
        f"{P2}   {K4}   1     2 d   takes over as generation 2",
        "2 pending row(s), oldest first; TTL 30 s",
    ]


def test_piped_inspect_writes_long_lines_whole_without_padding(wide_rows_db):
    out = piped("inspect", K2, "--principal", P2, "--db", wide_rows_db)
    with Ledger.open(wide_rows_db, create=False) as ledger:
        row = ledger.lookup(P2, K2)
    (newer, _) = fenced_times(wide_rows_db)
    assert out.splitlines() == [
        f"{P2} / {K2}",
        "state        completed 2 d ago, past the 1 d retention: still replayed until a sweep deletes it "
        f"(any sweep since {iso(row.updated_at + DAY, millis=False)}); after that a retry runs the mutation again",
        "status       completed",
        "generation   2 (taken over once)",
        "fingerprint  fp",
        f"created      {iso(row.created_at)} (2 d ago)",
        f"updated      {iso(row.updated_at)} (2 d ago)",
        "response     201 · 2 bytes, JSON",
        "headers      (none stored)",
        "body",
        "{}",
        "",
        "fenced-out events (1): a late owner's answer was not stored; the mutation may have run twice",
        "fenced at (UTC)        age       late   row   status",
        "─" * 52,
        f"{newer}   2 d ago      1     2      202",
    ]


def test_piped_stats_lines_are_not_wrapped_or_padded(wide_rows_db, tmp_path):
    deep = tmp_path / "var" / "lib" / "payments-api-with-a-long-deployment-name" / "idempotency"
    deep.mkdir(parents=True)
    ledger_path = deep / "ledger.db"
    os.rename(wide_rows_db, ledger_path)
    with Ledger.open(ledger_path, create=False) as ledger:
        st = ledger.operator.stats()
    out = piped("stats", "--db", str(ledger_path))
    assert out.splitlines() == [
        f"ledger             {ledger_path} (schema version 3)",
        "rows               4",
        "  pending, fresh   0  (retries get 409 in progress)",
        "  pending, stale   2  (the next retry takes over, whatever their age)",
        "  completed        0  (retries are replayed)",
        "  expired          4  (past the 1 d retention: the sweep deletes them; 2 of them pending, also counted as stale)",
        "taken over         2  (rows with generation > 1)",
        "fenced-out events  2",
        f"oldest pending     {iso(st.oldest_pending_at)} (3 d ago)",
        f"oldest completed   {iso(st.oldest_completed_at)} (2 d ago)",
        f"size               {st.storage_bytes:,} bytes",
        "policy             TTL 30 s, retention 1 d",
    ]


SCENARIO = f"""
name = "incident-2211"
description = "a charge for an enterprise customer outlived the TTL, and its worker's late answer was fenced out"
principal = "{P2}"
key = "{K2}"
ttl = "10s"
start = 2026-11-28T03:12:00Z

[[step]]
do = "claim"
actor = "worker-1"

[[step]]
do = "advance"
by = "11s"

[[step]]
do = "complete"
actor = "worker-1"
expect = "stored"
"""


def test_piped_simulate_writes_the_timeline_unwrapped(tmp_path):
    path = tmp_path / "incident.toml"
    path.write_text(SCENARIO)
    out = piped("simulate", "--file", str(path))
    assert out.splitlines() == [
        "scenario incident-2211: a charge for an enterprise customer outlived the TTL, and its worker's late answer "
        "was fenced out",
        "ledger a temporary ledger (deleted afterwards); TTL 10 s, retention 1 d; virtual clock from "
        "2026-11-28T03:12:00.000Z",
        "t             actor     step            outcome           row after",
        "+0:00:00.000  worker-1  claim           claimed           pending · gen 1",
        "              claimed generation 1; the mutation starts and stalls",
        "+0:00:11.000  clock     advance 11 s    advanced",
        "              virtual clock +11 s",
        "+0:00:11.000  worker-1  complete gen 1  stored            completed · gen 1",
        f'              stored 201 {{"order":"{K2}","by":"worke… as generation 1',
        "every step went as expected",
    ]


# -- on a terminal --------------------------------------------------------------------------------
def test_on_an_80_column_terminal_fenced_events_become_blocks_with_every_field_whole(wide_rows_db):
    out = on_terminal("fenced", "--db", wide_rows_db, columns=80)
    newer, older = fenced_times(wide_rows_db)
    lines = [line.rstrip() for line in out.splitlines()]
    assert lines[:15] == [
        f"fenced at (UTC)  {newer}",
        "age              2 d ago",
        f"principal        {P2}",
        f"key              {K2}",
        "late             1",
        "row              2",
        "status           202",
        "",
        f"fenced at (UTC)  {older}",
        "age              2 d ago",
        f"principal        {P1}",
        f"key              {K1}",
        "late             1",
        "row              2",
        "status           201",
    ]
    # The summary is prose: on a terminal rich wraps it between words.
    assert " ".join(line.strip() for line in lines[15:]) == FENCED_SUMMARY


def test_on_an_80_column_terminal_pending_rows_become_blocks(wide_rows_db):
    out = on_terminal("pending", "--db", wide_rows_db, columns=80)
    assert [line.rstrip() for line in out.splitlines()] == [
        f"principal    {P1}",
        f"key          {K3}",
        "gen          1",
        "age          3 d",
        "a retry now  takes over as generation 2",
        "",
        f"principal    {P2}",
        f"key          {K4}",
        "gen          1",
        "age          2 d",
        "a retry now  takes over as generation 2",
        "2 pending row(s), oldest first; TTL 30 s",
    ]


def test_on_a_wide_terminal_the_listing_is_a_table_and_a_narrower_one_folds_only_the_prose(wide_rows_db):
    wide = [line.rstrip() for line in on_terminal("pending", "--db", wide_rows_db, columns=200).splitlines()]
    assert wide[2:4] == [
        f"{P1}    {K3}   1     3 d   takes over as generation 2",
        f"{P2}   {K4}   1     2 d   takes over as generation 2",
    ]
    narrower = [line.rstrip() for line in on_terminal("pending", "--db", wide_rows_db, columns=112).splitlines()]
    assert narrower[2:6] == [
        f"{P1}    {K3}   1     3 d   takes over as",
        " " * 97 + "generation 2",
        f"{P2}   {K4}   1     2 d   takes over as",
        " " * 97 + "generation 2",
    ]


def test_on_a_terminal_a_value_wider_than_the_terminal_is_written_whole_for_the_terminal_to_wrap(tmp_path):
    principal = "acct_" + "x" * 115  # 120 characters, at 80 columns
    path = str(tmp_path / "ledger.db")
    with Ledger.open(path, clock=lambda: wall_clock_ms() - 2 * DAY) as ledger:
        ledger.init()
        assert ledger.complete(ledger.claim(principal, K1, "fp"), 201, {}, b"{}").stored
        ledger.claim(principal, K2, "fp")
    listing = [line.rstrip() for line in on_terminal("pending", "--db", path, columns=80).splitlines()]
    assert listing[0:2] == [f"principal    {principal}", f"key          {K2}"]
    inspected = on_terminal("inspect", K1, "--principal", principal, "--db", path, columns=80)
    assert inspected.splitlines()[0] == f"{principal} / {K1}"


ISO_MS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def test_on_a_40_column_terminal_stats_and_inspect_keep_every_timestamp_whole(wide_rows_db):
    with Ledger.open(wide_rows_db) as ledger:
        row = ledger.lookup(P1, K1)
        assert row is not None
    stats = on_terminal("--db", wide_rows_db, "stats", columns=40)
    inspected = on_terminal("--db", wide_rows_db, "inspect", K1, "-p", P1, columns=40)
    assert all(len(line.rstrip()) <= 40 for line in stats.splitlines()), stats
    # Oldest pending and oldest completed: each timestamp on one line, its label above it.
    assert len(ISO_MS.findall(stats)) == 2, stats
    assert {"fenced-out events", "oldest pending", "oldest completed"} <= {line.rstrip() for line in stats.splitlines()}
    assert {iso(row.created_at), iso(row.updated_at)} <= set(ISO_MS.findall(inspected)), inspected


@pytest.mark.parametrize(
    ("command", "whole"),
    [
        (["inspect"], ["-p, --principal PRINCIPAL", "--retention DURATION"]),
        (["purge"], ["-p, --principal PRINCIPAL"]),
        (["fingerprint"], ["-X, --method METHOD", "--reuse-status STATUS", "-H, --header 'NAME: VALUE'"]),
        (["stats"], ["--max-expired N", "--interval DURATION"]),
        ([], ["--busy-timeout DURATION", "-V, --version"]),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) and v and not v[0].startswith("-") else None,
)
def test_help_on_a_40_column_terminal_cuts_no_option_name_or_metavar(command, whole):
    done = subprocess.run([str(IDEMCTL), *command, "--help"], capture_output=True, text=True, env=env(40), timeout=60)
    assert (done.returncode, done.stderr) == (0, "")
    lines = done.stdout.splitlines()
    assert all(len(line) <= 40 for line in lines), done.stdout
    assert not re.search(r"\w…", done.stdout)  # a word cut short ("--prin…"); "host=…" is the help's own
    for words in whole:
        assert any(line.lstrip().startswith(words) for line in lines), (words, done.stdout)
    assert "\\[" not in done.stdout
