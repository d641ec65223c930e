"""`idemctl stats --format prometheus` for node_exporter's textfile collector,
and `stats --watch`, refreshed piped and on a terminal."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from idemctl import Ledger, wall_clock_ms
from idemctl.cli import app
from tests.helpers import fingerprint_post_orders, read_terminal

IDEMCTL = Path(sys.executable).with_name("idemctl")


def ledger_with_rows(path: Path) -> None:
    wall = wall_clock_ms()
    with Ledger.open(path, clock=lambda: wall - 40_000) as old:
        old.init()
        stale = old.claim("acct", "stale", "fp")
        assert stale is not None
    with Ledger.open(path, clock=wall_clock_ms) as ledger:
        ledger.complete(ledger.claim("acct", "done", "fp"), 201, {}, b"")  # type: ignore[arg-type]
        late = ledger.claim("acct", "late", "fp", now=wall - 40_000)
        ledger.complete(ledger.takeover("acct", "late", "fp"), 201, {}, b"")  # type: ignore[arg-type]
        ledger.complete(late, 201, {}, b"")  # type: ignore[arg-type]


def test_prometheus_format_prints_the_ledger_state_as_gauges(tmp_path):
    db = tmp_path / "l.db"
    ledger_with_rows(db)
    result = CliRunner().invoke(app, ["--db", str(db), "stats", "--format", "prometheus"])
    assert result.exit_code == 0 and result.stderr == ""
    lines = result.stdout.splitlines()
    label = f'ledger="{db}"'
    assert lines[:11] == [
        "# HELP idemctl_ledger_rows Rows in the ledger by state, as idemctl stats counts them:"
        " a pending row past retention counts as pending_stale and as expired.",
        "# TYPE idemctl_ledger_rows gauge",
        f'idemctl_ledger_rows{{{label},state="pending_fresh"}} 0',
        f'idemctl_ledger_rows{{{label},state="pending_stale"}} 1',
        f'idemctl_ledger_rows{{{label},state="completed"}} 2',
        f'idemctl_ledger_rows{{{label},state="expired"}} 0',
        "# HELP idemctl_ledger_expired_pending_rows Pending rows past retention, counted in both pending_stale and expired.",
        "# TYPE idemctl_ledger_expired_pending_rows gauge",
        f"idemctl_ledger_expired_pending_rows{{{label}}} 0",
        "# HELP idemctl_ledger_taken_over_rows Rows whose reservation was taken over at least once.",
        "# TYPE idemctl_ledger_taken_over_rows gauge",
    ]
    assert f"idemctl_ledger_taken_over_rows{{{label}}} 1" in lines
    assert f"idemctl_ledger_fenced_out_events{{{label}}} 1" in lines
    assert f"idemctl_ledger_pending_ttl_seconds{{{label}}} 30" in lines
    age = next(line for line in lines if line.startswith("idemctl_ledger_oldest_pending_age_seconds"))
    assert 40 <= float(age.rsplit(" ", 1)[1]) < 100


def test_an_unknown_format_and_watch_with_json_are_refused_in_one_line(tmp_path):
    db = tmp_path / "l.db"
    ledger_with_rows(db)
    bad = CliRunner().invoke(app, ["--db", str(db), "stats", "--format", "xml"])
    assert (bad.exit_code, bad.stderr) == (2, "error: --format must be text, json or prometheus, got 'xml'\n")
    watch_json = CliRunner().invoke(app, ["--db", str(db), "stats", "--watch", "--json"])
    assert watch_json.exit_code == 2
    assert watch_json.stderr == (
        "error: --watch shows the text view; for json or prometheus, run stats on a schedule instead\n"
    )


def test_watch_piped_prints_one_line_per_refresh(tmp_path):
    db = tmp_path / "l.db"
    ledger_with_rows(db)
    done = subprocess.run(
        [str(IDEMCTL), "--db", str(db), "stats", "--watch", "--interval", "100ms", "--count", "3"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0 and done.stderr == ""
    lines = done.stdout.splitlines()
    assert len(lines) == 3
    began = lines[0].split(" ", 1)[0]
    for line in lines:
        assert line.split(" ", 1)[1] == (
            "rows=3 pending_fresh=0 pending_stale=1 completed=2 expired=0 taken_over=1 fenced_out=1 "
            f"since={began} new_fenced_out=0 expired_change=+0"
        )


def test_watch_piped_says_what_changed_since_the_watch_began(tmp_path):
    db = tmp_path / "l.db"
    ledger_with_rows(db)
    proc = subprocess.Popen(
        [str(IDEMCTL), "--db", str(db), "stats", "--watch", "--interval", "300ms", "--count", "4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    with Ledger.open(db) as ledger:  # a takeover and a late completion while the operator watches
        late = ledger.claim("acct", "new", "fp", now=wall_clock_ms() - 40_000)
        ledger.complete(ledger.takeover("acct", "new", "fp"), 201, {}, b"")  # type: ignore[arg-type]
        ledger.complete(late, 201, {}, b"")  # type: ignore[arg-type]
    rest, errors = proc.communicate(timeout=30)
    assert (proc.returncode, errors) == (0, "")
    began = first.split(" ", 1)[0]
    assert first.rstrip("\n").endswith(f"fenced_out=1 since={began} new_fenced_out=0 expired_change=+0")
    assert rest.splitlines()[-1].endswith(f"fenced_out=2 since={began} new_fenced_out=1 expired_change=+0")


def test_watch_on_a_terminal_is_a_live_view_that_calls_out_new_fenced_out_events(tmp_path):
    db = tmp_path / "l.db"
    ledger_with_rows(db)
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [str(IDEMCTL), "--db", str(db), "stats", "--watch", "--interval", "300ms", "--count", "6"],
        stdout=slave,
        stderr=slave,
        env={**os.environ, "TERM": "xterm", "COLUMNS": "120"},
    )
    os.close(slave)
    added = []

    def fence_one_while_watched(seen: bytes) -> None:
        if not added and b"refreshed" in seen:
            with Ledger.open(db) as ledger:  # a takeover and a late completion while the operator watches
                late = ledger.claim("acct", "new", "fp", now=wall_clock_ms() - 40_000)
                ledger.complete(ledger.takeover("acct", "new", "fp"), 201, {}, b"")  # type: ignore[arg-type]
                ledger.complete(late, 201, {}, b"")  # type: ignore[arg-type]
            added.append(True)

    seen = read_terminal(master, fence_one_while_watched)
    os.close(master)
    assert proc.wait(30) == 0
    text = seen.decode(errors="replace")
    assert "no new fenced-out events" in text
    words = " ".join(re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).split())
    assert f"1 new fenced-out event(s): see idemctl --db {db} fenced --since 1h" in words


def test_fingerprint_explains_the_json_form_and_matches_the_ledger_that_uses_it(tmp_path):
    from idemctl import Outcome, Policy

    db = tmp_path / "l.db"
    policy = Policy(fingerprint_body="json", fingerprint_ignore_fields=("sent_at",))
    with Ledger.open(db, policy=policy) as ledger:
        ledger.init()
        stored = ledger.handle(
            "acct",
            "k",
            "POST",
            "/orders",
            {"content-type": "application/json"},
            b'{"sku":"x","sent_at":1}',
            lambda body: (201, {}, b""),
        )
        assert stored.outcome is Outcome.EXECUTED
    args = [
        "--db",
        str(db),
        *fingerprint_post_orders("Content-Type: application/json", body='{ "sent_at": 2, "sku": "x" }'),
        "--key",
        "k",
        "-p",
        "acct",
    ]
    plain = CliRunner().invoke(app, args)
    assert plain.exit_code == 1  # byte for byte, another request: 409 reused
    canonical = CliRunner().invoke(app, [*args, "--json-body", "--ignore-field", "sent_at"])
    assert canonical.exit_code == 0, canonical.stderr
    lines = canonical.stdout.splitlines()
    assert lines[1] == "body: the canonical JSON form (key order and whitespace do not count), without sent_at"
    assert lines[2].startswith("matches the stored fingerprint: this request is replayed (201")
    doc = CliRunner().invoke(app, [*args, "--json-body", "--json"])
    assert '"body_form": "json"' in doc.stdout
    refused = CliRunner().invoke(app, [*args, "--ignore-field", "sent_at"])
    assert (refused.exit_code, refused.stderr) == (2, "error: --ignore-field needs --json-body\n")
