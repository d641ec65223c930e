"""What users of any Unix CLI expect of `idemctl`: monitoring checks that fail
in every output format, newline-delimited JSON listings, a closed pipe and
Ctrl-C that end quietly with the documented codes, completion, `-V`, NO_COLOR,
durations spelt one way, and options that only apply with another refused."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import shellingham
from typer.testing import CliRunner

from idemctl import Ledger, wall_clock_ms
from idemctl.cli import app
from idemctl.cli.documents import stats_prometheus
from idemctl.ledger import Operator
from tests.helpers import FakeClock, interruptible, read_terminal

IDEMCTL = Path(sys.executable).with_name("idemctl")
HOUR = 3_600_000


def cli(*args: str):
    result = CliRunner().invoke(app, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def ledger_with(path: Path, *, expired: int = 0, pending: int = 0, fenced: bool = False) -> None:
    """`expired` completed rows written 30 h ago, `pending` fresh pending rows,
    and (`fenced`) one fenced-out event."""
    clock = FakeClock(wall_clock_ms() - 30 * HOUR)
    with Ledger.open(path, clock=clock) as ledger:
        ledger.init()
        for i in range(expired):
            ledger.complete(ledger.claim("acct_A", f"old-{i:04d}", "fp"), 201, {}, b"{}")  # type: ignore[arg-type]
        clock.now = wall_clock_ms() - 1000
        for i in range(pending):
            ledger.claim("acct_P", f"p-{i:05d}", "fp")
        if fenced:
            late = ledger.claim("acct_F", "late", "fp")
            clock.now += 31_000
            ledger.complete(ledger.takeover("acct_F", "late", "fp"), 201, {}, b"{}")  # type: ignore[arg-type]
            ledger.complete(late, 201, {}, b"{}")  # type: ignore[arg-type]


# -- stats: a monitoring check fails whatever it writes ---------------------------------------
@pytest.mark.parametrize("fmt", ["text", "json", "prometheus"])
def test_a_failed_threshold_exits_1_in_every_format(tmp_path, fmt):
    db = tmp_path / "l.db"
    ledger_with(db, expired=3)
    result = cli("--db", str(db), "stats", "--max-expired", "2", "--format", fmt)
    assert result.exit_code == 1
    assert result.stderr == "check failed: 3 expired rows (max 2)\n"
    assert result.stdout  # the counts are still written
    if fmt == "prometheus":
        assert f'idemctl_ledger_rows{{ledger="{db}",state="expired"}} 3' in result.stdout.splitlines()
    passed = cli("--db", str(db), "stats", "--max-expired", "3", "--format", fmt)
    assert (passed.exit_code, passed.stderr) == (0, "")


def test_the_old_max_backlog_spelling_still_checks_the_expired_rows(tmp_path):
    db = tmp_path / "l.db"
    ledger_with(db, expired=3)
    result = cli("--db", str(db), "stats", "--max-backlog", "2", "--format", "prometheus")
    assert (result.exit_code, result.stderr) == (1, "check failed: 3 expired rows (max 2)\n")
    both = cli("--db", str(db), "stats", "--max-backlog", "2", "--max-expired", "2")
    assert (both.exit_code, both.stderr) == (2, "error: --max-backlog is the old name of --max-expired: give one\n")


def test_prometheus_output_file_is_written_even_when_a_check_fails(tmp_path):
    db = tmp_path / "l.db"
    ledger_with(db, expired=3, fenced=True)
    prom = tmp_path / "metrics" / "idemctl.prom"
    prom.parent.mkdir()
    result = cli("--db", str(db), "stats", "--format", "prometheus", "--max-fenced", "0", "--output", str(prom))
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == "check failed: 1 fenced-out events (max 0)\n"
    lines = prom.read_text().splitlines()
    assert f'idemctl_ledger_fenced_out_events{{ledger="{db}"}} 1' in lines
    assert os.listdir(prom.parent) == ["idemctl.prom"]  # the temporary file was renamed into place


def test_prometheus_writes_integers_exactly_and_a_zero_age_when_nothing_is_pending(tmp_path):
    db = tmp_path / "l.db"
    ledger_with(db, expired=40)
    with Ledger.open(db, create=False) as ledger:
        st, policy = ledger.operator.stats(), ledger.policy
    lines = cli("--db", str(db), "stats", "--format", "prometheus").stdout.splitlines()
    assert f'idemctl_ledger_storage_bytes{{ledger="{db}"}} {st.storage_bytes}' in lines
    assert f'idemctl_ledger_oldest_pending_age_seconds{{ledger="{db}"}} 0' in lines
    assert f'idemctl_ledger_retention_seconds{{ledger="{db}"}} 86400' in lines
    # When the counts were taken, to the millisecond: a file the cron stopped writing shows its age.
    taken = stats_prometheus("l.db", replace(st, now=1_700_000_000_123), policy).splitlines()
    assert 'idemctl_ledger_stats_timestamp_seconds{ledger="l.db"} 1700000000.123' in taken
    assert (
        'idemctl_ledger_stats_timestamp_seconds{ledger="l.db"} 1700000000'
        in stats_prometheus("l.db", replace(st, now=1_700_000_000_000), policy).splitlines()
    )
    # A size with more digits than `:g` keeps (it wrote 4.80543e+07).
    big = stats_prometheus("l.db", replace(st, storage_bytes=48_054_272), policy).splitlines()
    assert 'idemctl_ledger_storage_bytes{ledger="l.db"} 48054272' in big


def test_the_expired_count_has_one_name_in_text_json_and_watch(tmp_path):
    db = tmp_path / "l.db"
    ledger_with(db, expired=2)
    text = cli("--db", str(db), "stats").stdout
    assert "  expired          2  (past the 1 d retention: the sweep deletes them)" in text.splitlines()
    assert "past retention" not in text and "backlog" not in text
    assert json.loads(cli("--db", str(db), "stats", "--json").stdout)["expired"] == 2
    watched = cli("--db", str(db), "stats", "--watch", "--count", "1").stdout
    assert " expired=2 " in watched and "retention" not in watched


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--count", "3"], "--count only applies with --watch"),
        (["--interval", "5s"], "--interval only applies with --watch"),
        (["--watch", "--max-fenced", "0"], "--max-fenced only applies with a single stats run, not --watch"),
        (["--output", "x.prom"], "--output only applies with --format json or prometheus"),
        (["--json", "--format", "prometheus"], "give --json or --format prometheus, not both"),
    ],
)
def test_stats_options_that_only_apply_with_another_are_refused(tmp_path, args, message):
    db = tmp_path / "l.db"
    ledger_with(db)
    result = cli("--db", str(db), "stats", *args)
    assert (result.exit_code, result.stdout, result.stderr) == (2, "", f"error: {message}\n")


# -- --nl -----------------------------------------------------------------------------------
def test_pending_nl_writes_one_json_object_per_line(tmp_path):
    db = tmp_path / "l.db"
    ledger_with(db, pending=3)
    result = cli("--db", str(db), "pending", "--nl")
    assert (result.exit_code, result.stderr) == (0, "")
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["principal"], r["key"], r["state"]) for r in rows] == [
        ("acct_P", f"p-{i:05d}", "pending_fresh") for i in range(3)
    ]
    # Each line is the item the --json document lists (less what the clock changed since).
    listed = json.loads(cli("--db", str(db), "pending", "--json").stdout)["rows"]
    moving = {"now", "age_ms", "takeover_in_ms", "state_text"}
    assert [set(r) for r in rows] == [set(r) for r in listed]
    assert [{k: v for k, v in r.items() if k not in moving} for r in rows] == [
        {k: v for k, v in r.items() if k not in moving} for r in listed
    ]


def test_nl_says_on_stderr_when_the_limit_cut_the_listing(tmp_path):
    db = tmp_path / "l.db"
    ledger_with(db, pending=3)
    result = cli("--db", str(db), "pending", "--nl", "--limit", "2")
    assert result.exit_code == 0
    assert [json.loads(line)["key"] for line in result.stdout.splitlines()] == ["p-00000", "p-00001"]
    assert result.stderr == "more exist than --limit 2 let through (--limit 0 for all)\n"


def test_fenced_nl_writes_one_event_per_line(tmp_path):
    db = tmp_path / "l.db"
    ledger_with(db, fenced=True)
    result = cli("--db", str(db), "fenced", "--nl")
    assert (result.exit_code, result.stderr) == (0, "")
    (event,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert (event["principal"], event["key"], event["superseded_generation"], event["current_generation"]) == (
        "acct_F",
        "late",
        1,
        2,
    )
    assert [event] == json.loads(cli("--db", str(db), "fenced", "--json").stdout)["events"]


@pytest.mark.parametrize("command", ["pending", "fenced"])
def test_json_and_nl_together_are_refused(tmp_path, command):
    db = tmp_path / "l.db"
    ledger_with(db)
    result = cli("--db", str(db), command, "--json", "--nl")
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == "error: give --json (one document) or --nl (one object per line), not both\n"


# -- a closed pipe and Ctrl-C -------------------------------------------------------------------
def into_head(idemctl_args: str, head: str, *, timeout: float) -> subprocess.CompletedProcess[str]:
    """The installed idemctl piped into `head` (which closes the pipe
    early); its stderr is the idemctl's and then ``status <its exit status>``."""
    return subprocess.run(
        f"'{IDEMCTL}' {idemctl_args} | {head}; echo \"status ${{PIPESTATUS[0]}}\" >&2",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
@pytest.mark.parametrize("form", [[], ["--json"], ["--nl"]], ids=["table", "json", "nl"])
def test_a_closed_pipe_ends_quietly_with_141(tmp_path, form):
    db = tmp_path / "l.db"
    ledger_with(db, pending=3000)
    done = into_head(f"--db '{db}' pending --limit 0 {' '.join(form)}", "head -1", timeout=120)
    assert done.stderr == "status 141\n"  # nothing else: no traceback, no "Exception ignored"
    assert len(done.stdout.splitlines()) == 1


@pytest.mark.slow
def test_help_into_a_closed_pipe_ends_quietly_with_141():
    done = into_head("--help", "head -1 >/dev/null", timeout=60)
    assert done.stderr == "status 141\n"


@pytest.mark.slow
def test_ctrl_c_on_stats_watch_exits_130_quietly(tmp_path):
    db = tmp_path / "l.db"
    ledger_with(db)
    proc = subprocess.Popen(
        [str(IDEMCTL), "--db", str(db), "stats", "--watch", "--interval", "200ms"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # the first refresh: the watch is running
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (proc.returncode, err) == (130, "")


def test_ctrl_c_while_the_cli_is_still_being_imported_exits_130_without_a_traceback(monkeypatch, capsys):
    import _idemctl_start

    class Importing:
        def __getattr__(self, name: str):
            raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "idemctl.cli", Importing())
    with pytest.raises(SystemExit) as exited:
        _idemctl_start.main()
    assert exited.value.code == 130
    assert capsys.readouterr() == ("", "")


def test_ctrl_c_while_typer_builds_the_app_exits_130_without_a_traceback(monkeypatch, capsys):
    from idemctl.cli import core

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(core, "app", interrupted)
    with pytest.raises(SystemExit) as exited:
        core.main()
    assert exited.value.code == 130
    assert capsys.readouterr() == ("", "")


def test_ctrl_c_inside_a_command_exits_130_without_a_message(tmp_path, monkeypatch):
    db = tmp_path / "l.db"
    ledger_with(db)

    def interrupted(self: Operator) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Operator, "stats", interrupted)
    result = cli("--db", str(db), "stats")
    assert (result.exit_code, result.stdout, result.stderr) == (130, "", "")


# -- conventions ------------------------------------------------------------------------------
def test_dash_capital_v_prints_the_version():
    short, long = cli("-V"), cli("--version")
    assert short.exit_code == 0 and short.stdout == long.stdout and short.stdout.startswith("idemctl ")


def test_bare_idemctl_prints_the_help_and_exits_0():
    result = cli()
    assert result.exit_code == 0 and "Usage: idemctl" in result.stdout and result.stderr == ""


def test_completion_scripts_are_offered_for_the_shell(monkeypatch):
    # The flag names no shell: Typer detects the one it runs under, from the
    # process's ancestors. Here it is bash, whether or not a shell started pytest.
    monkeypatch.setattr(shellingham, "detect_shell", lambda *args, **kwargs: ("bash", "/bin/bash"))
    shown = CliRunner().invoke(app, ["--show-completion"], prog_name="idemctl")
    help_text = cli("--help").stdout
    assert "--install-completion" in help_text and "--show-completion" in help_text
    assert shown.exit_code == 0
    assert "_IDEMCTL_COMPLETE=complete_bash" in shown.stdout


@pytest.mark.slow
def test_completion_completes_commands_and_options():
    env = {**os.environ, "_IDEMCTL_COMPLETE": "complete_bash", "COMP_WORDS": "idemctl stats --max-f", "COMP_CWORD": "2"}
    done = subprocess.run([str(IDEMCTL)], env=env, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.split()) == (0, ["--max-fenced"])


@pytest.mark.slow
def test_no_color_removes_bold_too_on_a_terminal(tmp_path):
    db = tmp_path / "l.db"
    ledger_with(db, fenced=True)

    def on_a_terminal(*args: str, **env: str) -> bytes:
        master, slave = pty.openpty()
        proc = subprocess.Popen(
            [str(IDEMCTL), *args],
            stdout=slave,
            stderr=slave,
            env={**os.environ, "TERM": "xterm", "COLUMNS": "120", **env},
        )
        os.close(slave)
        seen = read_terminal(master)
        os.close(master)
        proc.wait(30)
        return seen

    for args in (
        ["--db", str(db), "inspect", "late", "-p", "acct_F"],
        ["stats", "--help"],
        ["--db", "nowhere.db", "stats"],
    ):
        assert b"\x1b[" in on_a_terminal(*args), args  # styled by default: the check below can fail
        assert b"\x1b[" not in on_a_terminal(*args, NO_COLOR="1"), args


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["sweep", "--pause", "50"],
            "Invalid value for '--pause': duration '50' needs a unit (ms, s, m, h or d), e.g. 50s",
        ),
        (
            ["stats", "--watch", "--interval", "5x"],
            "Invalid value for '--interval': cannot read duration '5x': use e.g. 500ms, 30s, 15m, 24h, 7d or 1h30m",
        ),
        (
            ["--ttl", "30", "stats"],
            "Invalid value for '--ttl': duration '30' needs a unit (ms, s, m, h or d), e.g. 30s",
        ),
        (["pending", "--limit", "-1"], "Invalid value for '--limit' / '-n': must be 0 or more, got -1"),
    ],
)
def test_bad_values_are_told_in_our_words_not_the_validation_librarys(args, message):
    result = cli(*args)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {message} (see ")
    assert "Value error" not in result.stderr and "Input should be" not in result.stderr


def test_sweep_pause_takes_a_duration_and_the_old_spelling_still_works(tmp_path):
    db = tmp_path / "l.db"
    ledger_with(db, expired=3)
    result = cli("--db", str(db), "sweep", "--pause", "1ms", "--batch-size", "2")
    assert result.exit_code == 0 and result.stdout.startswith("deleted 3 row(s) in ")
    old = cli("--db", str(db), "sweep", "--pause-ms", "1")
    assert old.exit_code == 0
    both = cli("--db", str(db), "sweep", "--pause", "1ms", "--pause-ms", "1")
    assert (both.exit_code, both.stderr) == (
        2,
        "error: --pause-ms is the old spelling of --pause: give one (e.g. --pause 50ms)\n",
    )


@pytest.mark.parametrize("option", [["--batch-size", "10"], ["--max-batches", "1"], ["--pause", "1s"]])
def test_sweep_dry_run_refuses_options_it_would_ignore(tmp_path, option):
    db = tmp_path / "l.db"
    ledger_with(db)
    result = cli("--db", str(db), "sweep", "--dry-run", *option)
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == f"error: {option[0]} does not apply with --dry-run, which deletes nothing\n"


def test_interrupt_and_pipe_exit_codes_are_in_the_help():
    text = " ".join(CliRunner().invoke(app, ["--help"], env={"COLUMNS": "300"}).stdout.split())
    assert "130 interrupted (Ctrl-C)" in text and "141 the reader of stdout went away (a closed pipe)" in text


# -- small things a newcomer trips on --------------------------------------------------------------
def test_a_duration_reads_the_same_wherever_it_is_shown(tmp_path):
    db = tmp_path / "l.db"
    with Ledger.open(db, clock=lambda: wall_clock_ms() - 1500) as ledger:
        ledger.init()
        ledger.complete(ledger.claim("acct_A", "order-42", "fp"), 201, {}, b"{}")  # type: ignore[arg-type]
    state = json.loads(cli("--db", str(db), "inspect", "order-42", "-p", "acct_A", "--json").stdout)["state_text"]
    # A day less a second or two is the 1 d retention the policy line shows, not "23 h 59 min".
    assert state.startswith("completed 2 s ago: replayed until ") and "(in 1 d);" in state
    assert "policy             TTL 30 s, retention 1 d" in cli("--db", str(db), "stats").stdout.splitlines()


FILL_SCENARIO = """
name = "big-backlog"
principal = "acct_B"

[[step]]
do = "fill"
count = 1500
expect = "filled"
"""


@pytest.mark.slow
def test_a_long_fill_shows_its_progress_on_a_terminal_and_nothing_piped(tmp_path):
    scenario = tmp_path / "big.toml"
    scenario.write_text(FILL_SCENARIO)
    piped = subprocess.run(
        [str(IDEMCTL), "simulate", "--file", str(scenario)], capture_output=True, text=True, timeout=120
    )
    assert (piped.returncode, piped.stderr) == (0, "")
    assert "1500 completed rows acct_B/" in piped.stdout
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [str(IDEMCTL), "simulate", "--file", str(scenario)],
        stdout=subprocess.DEVNULL,
        stderr=slave,
        env={**os.environ, "TERM": "xterm", "COLUMNS": "100"},
    )
    os.close(slave)
    seen = read_terminal(master)
    os.close(master)
    assert proc.wait(120) == 0
    assert b"step 1: fill" in seen and b"/1500" in seen


def test_ctrl_c_at_the_purge_prompt_exits_130_and_purges_nothing(tmp_path, monkeypatch):
    from idemctl.cli import sweep

    db = tmp_path / "l.db"
    ledger_with(db, expired=1)

    def ctrl_c_at_the_prompt() -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep, "_answer", ctrl_c_at_the_prompt)
    result = cli("--db", str(db), "purge", "old-0000", "--principal", "acct_A")
    assert (result.exit_code, result.stderr) == (
        130,
        "Purge acct_A/old-0000? The client's next retry will run the mutation again [y/N]: \n",
    )
    with Ledger.open(db, create=False) as ledger:
        assert ledger.lookup("acct_A", "old-0000") is not None


@pytest.mark.parametrize("option", [["--db", "x.db"], ["--ttl", "10s"]])
def test_fingerprint_refuses_ledger_options_without_a_key(option):
    result = cli("fingerprint", "-X", "POST", "--path", "/orders", *option)
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == f"error: {option[0]} only applies with --key (to compare with a stored row)\n"
