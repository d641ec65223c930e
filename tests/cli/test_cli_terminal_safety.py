"""What clients sent and what other programs wrote reaches the operator's
terminal escaped: no control byte, no bidi override, no rich markup from a
principal, header or body is ever written raw by the CLI's human output, while
`--json` keeps every string exact. Run through CliRunner and through the
installed `idemctl` command with stdout a pipe."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from idemctl import Ledger, wall_clock_ms
from idemctl.cli import app
from idemctl.cli.escaping import visible
from tests.helpers import clean_env

IDEMCTL = Path(sys.executable).with_name("idemctl")
SECOND = 1000
HOUR = 3600 * SECOND

# A client that wants to repaint the operator's screen, ring the bell, retitle
# the window (OSC), and hide text behind 8-bit CSI and a bidi override.
EVIL = "evil\x1b[2J\x1b[31m\x07"
EVIL_SHOWN = r"evil\x1b[2J\x1b[31m\x07"
MARKUP = "[bold red]boss[/] [link=https://evil.example]click[/link]"
BIDI = "acct\u202e\u2066\u200e\u200f\x7f\x85\u2028"
BIDI_SHOWN = r"acct\u202e\u2066\u200e\u200f\x7f\x85\u2028"
TEXT_BODY = "\x1b]0;pwned\x07hello\r\nworld\x9b\u202eend [b]x[/b]\n\tindented"
JSON_BODY = '{"note":"\u202e\x7f\x9b","esc":"\\u001b[2J"}'
FOREIGN_KEY = "for\x1beign\r\n"
FOREIGN_FP = "[red]fp[/]\x1b\u202e"
# Raw bytes that must never reach the terminal from stored text: ESC, CR, BEL,
# and the UTF-8 of CSI (U+009B), RLO (U+202E) and LRI (U+2066).
FORBIDDEN = [b"\x1b", b"\r", b"\x07", "\x9b".encode(), "\u202e".encode(), "\u2066".encode()]


@dataclass
class Done:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def lines(self) -> list[str]:
        # rich pads table cells: compare lines without trailing blanks
        return [line.rstrip() for line in self.stdout.splitlines()]


def assert_clean(text: str | bytes) -> None:
    raw = text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text
    for forbidden in FORBIDDEN:
        assert forbidden not in raw, (forbidden, raw)


def cli(*args: str) -> Done:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    done = Done(result.exit_code, result.stdout, result.stderr)
    assert_clean(done.stdout)
    assert_clean(done.stderr)
    return done


@pytest.fixture
def hostile_db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A ledger made by `idemctl init`, then filled through the library with a
    hostile client's rows, and by raw SQL with rows another program wrote."""
    clean_env(monkeypatch)
    path = str(tmp_path / "ledger.db")
    assert CliRunner().invoke(app, ["init", "--db", path]).exit_code == 0
    now = wall_clock_ms()
    t = [now - HOUR]
    with Ledger.open(path, clock=lambda: t[0]) as ledger:
        done = ledger.claim(EVIL, "order-1", "fp1")
        assert ledger.complete(done, 201, {"Content-Type": "text/plain", "Location": "/orders/1"}, TEXT_BODY).stored
        done = ledger.claim(BIDI, "order-3", "fp3")
        assert ledger.complete(done, 200, {"Content-Type": "application/json"}, JSON_BODY).stored
        # A late owner fenced out by a takeover: one fenced-out event for EVIL.
        late = ledger.claim(EVIL, "order-4", "fp4")
        t[0] += 35 * SECOND
        winner = ledger.takeover(EVIL, "order-4", "fp4")
        assert ledger.complete(winner, 201, {}, b"won").stored
        assert not ledger.complete(late, 202, {}, b"late").stored
        t[0] = now - SECOND  # fresh pending rows
        assert ledger.claim(MARKUP, "order-2", "fp2") is not None
        assert ledger.claim(EVIL, "order-5", "fp5") is not None
    conn = sqlite3.connect(path)
    try:
        insert = (
            "INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, response_status,"
            " response_body, response_headers, created_at, updated_at) VALUES (?, ?, ?, ?, 1, ?, ?, ?, ?, ?)"
        )
        conn.execute(
            insert,
            ("foreign", FOREIGN_KEY, FOREIGN_FP, "pending", None, None, None, now - 2 * SECOND, now - 2 * SECOND),
        )
        headers = json.dumps({"location": "/x\x1b[31m\r\nSet-Cookie: a=1", "[b]x[/b]": "v", "retry-after": 5})
        conn.execute(
            insert, ("foreign", "foreign-2", FOREIGN_FP, "completed", 201, "ok", headers, now - HOUR, now - HOUR)
        )
        conn.commit()
    finally:
        conn.close()
    return path


# -- inspect -------------------------------------------------------------------------------------
def test_inspect_shows_a_hostile_principal_and_text_body_escaped(hostile_db):
    done = cli("inspect", "order-1", "--principal", EVIL, "--db", hostile_db)
    assert done.exit_code == 0, done.stderr
    lines = done.lines
    assert lines[0] == rf"{EVIL_SHOWN} / order-1"
    assert "headers      content-type: text/plain" in lines
    assert "             location: /orders/1" in lines
    body = lines.index("body")
    # Line breaks and tabs of a body stay layout; the CR before one is shown.
    assert lines[body + 1 : body + 4] == [
        r"\x1b]0;pwned\x07hello\r",
        r"world\x9b\u202eend [b]x[/b]",
        "        indented",
    ]


def test_inspect_json_keeps_the_exact_principal_and_body(hostile_db):
    done = cli("inspect", "order-1", "--principal", EVIL, "--db", hostile_db, "--json")
    doc = json.loads(done.stdout)
    assert doc["principal"] == EVIL
    assert doc["response"]["body"] == TEXT_BODY
    assert doc["response"]["headers"] == {"content-type": "text/plain", "location": "/orders/1"}


def test_inspect_json_body_escapes_del_c1_and_bidi_inside_strings(hostile_db):
    done = cli("inspect", "order-3", "--principal", BIDI, "--db", hostile_db)
    assert done.exit_code == 0, done.stderr
    lines = done.lines
    assert lines[0] == f"{BIDI_SHOWN} / order-3"
    body = lines.index("body")
    assert lines[body + 1 : body + 5] == ["{", r'  "note": "\u202e\x7f\x9b",', r'  "esc": "\u001b[2J"', "}"]


def test_inspect_json_writes_del_c1_and_bidi_as_json_escapes_and_round_trips(hostile_db):
    done = cli("inspect", "order-3", "--principal", BIDI, "--db", hostile_db, "--json")
    assert r'"principal": "acct\u202e\u2066\u200e\u200f\u007f\u0085\u2028",' in done.stdout
    doc = json.loads(done.stdout)
    assert doc["principal"] == BIDI
    assert doc["response"]["body"] == JSON_BODY


def test_inspect_a_foreign_row_shows_its_headers_and_fingerprint_escaped_with_why_they_are_not_replayed(hostile_db):
    done = cli("inspect", "foreign-2", "--principal", "foreign", "--db", hostile_db)
    assert done.exit_code == 0, done.stderr
    lines = done.lines
    assert r"fingerprint  [red]fp[/]\x1b\u202e" in lines
    assert (
        r"headers      location: /x\x1b[31m\r\nSet-Cookie: a=1  (not replayed: its value contains CR, LF or NUL)"
        in lines
    )
    assert "             [b]x[/b]: v  (not replayed: its name is not a valid HTTP field name)" in lines
    assert "             retry-after: 5  (not replayed: its value is a JSON number, not a string)" in lines
    doc = json.loads(cli("inspect", "foreign-2", "--principal", "foreign", "--db", hostile_db, "--json").stdout)
    assert doc["fingerprint"] == FOREIGN_FP


def test_inspect_of_a_missing_row_names_the_hostile_principal_escaped_on_stderr(hostile_db):
    done = cli("inspect", "nothing", "--principal", EVIL, "--db", hostile_db)
    assert done.exit_code == 1
    assert done.stderr == (
        r"no row for principal 'evil\x1b[2J\x1b[31m\x07' key 'nothing': the next request with this key runs the mutation"
        "\n"
    )


# -- pending ------------------------------------------------------------------------------------
def test_pending_prints_markup_literally_and_control_characters_escaped(hostile_db):
    done = cli("pending", "--db", hostile_db)
    assert done.exit_code == 0, done.stderr
    # principal, key and generation; the age columns depend on the clock
    # the header, its rule, then the rows: no blank line first, no edge
    rows = [re.match(r"(.+?)   +(\S+) +(\d+) ", line) for line in done.lines[2:5]]
    assert [m.groups() if m else None for m in rows] == [
        ("foreign", r"for\x1beign\r\n", "1"),
        (MARKUP, "order-2", "1"),
        (EVIL_SHOWN, "order-5", "1"),
    ]


def test_pending_json_round_trips_the_exact_strings(hostile_db):
    doc = json.loads(cli("pending", "--db", hostile_db, "--json").stdout)
    pairs = {(r["principal"], r["key"]) for r in doc["rows"]}
    assert pairs == {("foreign", FOREIGN_KEY), (MARKUP, "order-2"), (EVIL, "order-5")}
    fps = {r["key"]: r["fingerprint"] for r in doc["rows"]}
    assert fps[FOREIGN_KEY] == FOREIGN_FP


# -- fenced --------------------------------------------------------------------------------------
def test_fenced_shows_the_principal_escaped_and_json_keeps_it_exact(hostile_db):
    done = cli("fenced", "--db", hostile_db)
    assert done.exit_code == 0, done.stderr
    events = [line for line in done.lines if "order-4" in line]
    assert len(events) == 1
    assert re.search(rf"   {re.escape(EVIL_SHOWN)}   +order-4   +1   +2   +202$", events[0]), events[0]
    doc = json.loads(cli("fenced", "--db", hostile_db, "--json").stdout)
    assert [(e["principal"], e["key"], e["computed_status"]) for e in doc["events"]] == [(EVIL, "order-4", 202)]


def test_inspect_lists_the_fenced_event_of_a_hostile_principal(hostile_db):
    done = cli("inspect", "order-4", "--principal", EVIL, "--db", hostile_db)
    assert done.exit_code == 0, done.stderr
    assert done.lines[0] == f"{EVIL_SHOWN} / order-4"
    assert any(line.startswith("fenced-out events (1)") for line in done.lines)


# -- purge and fingerprint -----------------------------------------------------------------------
def test_purge_echoes_the_hostile_principal_escaped(hostile_db):
    done = cli("purge", "order-1", "--principal", EVIL, "--yes", "--db", hostile_db)
    assert done.exit_code == 0, done.stderr
    assert done.lines[0].startswith(f"{EVIL_SHOWN} / order-1 (generation 1): completed ")
    assert (
        done.lines[1]
        == f"purged {EVIL_SHOWN}/order-1 (completed, generation 1): the client's next retry runs the mutation again"
    )


def test_fingerprint_shows_a_foreign_stored_fingerprint_escaped(hostile_db):
    done = cli(
        "fingerprint", "-X", "POST", "--path", "/orders", "--key", "foreign-2", "-p", "foreign", "--db", hostile_db
    )
    assert done.exit_code == 1
    assert done.lines[-1] == r"stored: [red]fp[/]\x1b\u202e"


def test_an_error_line_quoting_an_operator_argument_is_escaped(hostile_db, tmp_path):
    done = cli("fingerprint", "-X", "POST", "--path", "/", "--body-file", str(tmp_path / "no\x1b[2Jfile"))
    assert done.exit_code == 2
    assert done.stderr == f"error: cannot read --body-file {tmp_path}/no\\x1b[2Jfile: No such file or directory\n"


# -- the installed command, stdout a pipe ----------------------------------------------------------
def run_idemctl(*args: str, **env: str) -> subprocess.CompletedProcess[bytes]:
    """The installed console script, stdout and stderr pipes (not a terminal)."""
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith("IDEMCTL_") and k not in ("FORCE_COLOR", "NO_COLOR")
    }
    return subprocess.run(
        [str(IDEMCTL), *args], capture_output=True, env={**clean, "COLUMNS": "200", **env}, timeout=60
    )


@pytest.mark.slow
def test_the_installed_command_writes_no_raw_control_bytes_to_a_pipe(hostile_db):
    for args in (
        ["inspect", "order-1", "--principal", EVIL],
        ["inspect", "order-3", "--principal", BIDI],
        ["inspect", "foreign-2", "--principal", "foreign"],
        ["pending"],
        ["fenced"],
    ):
        done = run_idemctl(*args, "--db", hostile_db)
        assert done.returncode == 0, done.stderr
        assert_clean(done.stdout)
        assert_clean(done.stderr)
    inspected = run_idemctl("inspect", "order-1", "--principal", EVIL, "--db", hostile_db).stdout.decode()
    assert inspected.splitlines()[0].rstrip() == EVIL_SHOWN + " / order-1"
    exact = run_idemctl("inspect", "order-1", "--principal", EVIL, "--db", hostile_db, "--json").stdout
    assert_clean(exact)
    assert (json.loads(exact)["principal"], json.loads(exact)["response"]["body"]) == (EVIL, TEXT_BODY)
    listing = run_idemctl("pending", "--json", "--db", hostile_db).stdout
    assert_clean(listing)
    assert {(r["principal"], r["key"]) for r in json.loads(listing)["rows"]} == {
        ("foreign", FOREIGN_KEY),
        (MARKUP, "order-2"),
        (EVIL, "order-5"),
    }


@pytest.mark.slow
def test_with_colours_forced_only_rich_styles_reach_the_terminal_never_stored_sequences(hostile_db):
    # On a colour terminal rich writes its own SGR codes, so ESC itself is
    # expected; what must not appear is anything the client sent.
    done = run_idemctl("inspect", "order-1", "--principal", EVIL, "--db", hostile_db, FORCE_COLOR="1")
    as_json = run_idemctl("inspect", "order-3", "--principal", BIDI, "--db", hostile_db, FORCE_COLOR="1")
    for out in (done, as_json):  # a text body, then a highlighted JSON body
        assert out.returncode == 0, out.stderr
        assert b"\x1b[1m" in out.stdout  # the colour path really ran
        for forbidden in (b"\x1b[2J", b"\x1b]0;", b"\x07", b"\r", "\x9b".encode(), "\u202e".encode(), b"\x7f"):
            assert forbidden not in out.stdout
    assert rb"evil\x1b[2J\x1b[31m\x07 / order-1" in done.stdout
    assert rb"\u202e\x7f\x9b" in as_json.stdout


def test_visible_leaves_keys_and_ordinary_text_as_they_are():
    # An operator copies a key from the output into the next command.
    printable = "".join(chr(c) for c in range(0x20, 0x7F))
    assert visible(printable) == printable
    assert visible("café 注文 ñ") == "café 注文 ñ"
    assert visible("a\tb\nc", multiline=True) == "a\tb\nc"
    assert visible("a\tb\nc") == r"a\tb\nc"
    assert visible("\x00\x1f\x7f\x80\x9f\u00ad\u200b\u2069\ufeff\U000e0001") == (
        r"\x00\x1f\x7f\x80\x9f\xad\u200b\u2069\ufeff\U000e0001"
    )
