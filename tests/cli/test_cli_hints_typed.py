"""Every hint the CLI prints, typed as printed, makes progress.

Each test provokes one hint against a fresh ledger (a SQLite file, a new
PostgreSQL database, a new MariaDB database), takes the command(s) between
backquotes out of the printed line, runs them in a shell as an operator
would, and checks that the command that failed now works. The hint line is
read both piped and on a terminal (a pty): it must be the same line."""

from __future__ import annotations

import os
import pty
import re
import secrets
import select
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from idemctl import Ledger, fingerprint, wall_clock_ms
from tests.helpers import read_only_file

pytestmark = pytest.mark.slow  # every test starts the installed command, most several times

ENGINES = ["sqlite", "postgres", "mysql"]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
BACKQUOTED = re.compile(r"`([^`]+)`")


def _env() -> dict[str, str]:
    # `idemctl` in a hint is the one installed beside this interpreter.
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.pop("NO_COLOR", None)
    return env


@dataclass(frozen=True)
class Done:
    code: int
    stdout: str
    stderr: str


def idemctl(*args: str) -> Done:
    """The CLI as a process with stdout and stderr piped."""
    done = subprocess.run(["idemctl", *args], capture_output=True, text=True, env=_env(), timeout=120)
    return Done(done.returncode, done.stdout, done.stderr)


def idemctl_in_a_pty(*args: str) -> tuple[int, str]:
    """The CLI on a terminal: its output (stdout and stderr, as the terminal
    shows them) with colours and carriage returns removed, and its exit code."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the terminal is its stdin, stdout and stderr
        try:
            os.execvpe("idemctl", ["idemctl", *args], _env())
        finally:
            os._exit(127)
    out = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), ANSI.sub("", out.decode()).replace("\r\n", "\n")


def hint_line(*args: str) -> str:
    """The one error line a failing command prints, piped and on a terminal alike."""
    piped = idemctl(*args)
    assert piped.code == 2, piped
    assert piped.stdout == ""
    lines = piped.stderr.splitlines()
    assert len(lines) == 1, piped.stderr
    code, shown = idemctl_in_a_pty(*args)
    assert code == 2
    # (a terminal also shows the progress bar of a command that got that far)
    errors = [line for line in shown.splitlines() if line.startswith("error:")]
    assert errors == lines, "the terminal shows another line than the pipe"
    return lines[0]


def commands_in(line: str) -> list[str]:
    found = BACKQUOTED.findall(line)
    assert found, f"no command to type in: {line}"
    return found


def type_it(command: str, *, env: dict[str, str] | None = None) -> None:
    """Run a hint's command in a shell, as the operator would paste it."""
    done = subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, env={**_env(), **(env or {})}, timeout=120
    )
    assert done.returncode == 0, f"`{command}` failed: {done.stderr.strip()}"


# -- fresh databases ------------------------------------------------------------------------------
def _with_database(url: str, name: str) -> str:
    head, _, tail = url.partition("?")
    base = head.rsplit("/", 1)[0]
    return f"{base}/{name}" + (f"?{tail}" if tail else "")


def _pg_admin(url: str, statement: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(statement)  # type: ignore[arg-type]


def _mysql_admin(url: str, statement: str) -> None:
    import pymysql

    from idemctl.storage.mysql import MysqlEngine

    engine = MysqlEngine(url)
    kwargs = {k: v for k, v in engine._connect_kwargs.items() if k != "database"}
    engine.close()
    conn = pymysql.connect(**kwargs)
    try:
        with conn.cursor() as cur:
            cur.execute(statement)
    finally:
        conn.close()


@dataclass
class Fresh:
    """Places on one engine where no ledger (no database, no file) exists yet."""

    engine: str
    tmp: Path
    admin_url: str
    made: list[str]

    def place(self) -> str:
        name = f"idemctl_hint_{secrets.token_hex(5)}"
        self.made.append(name)
        if self.engine == "sqlite":
            return str(self.tmp / f"{name}.db")
        return _with_database(self.admin_url, name)

    def as_role(self, url: str, role: str) -> str:
        """`url` with `role` as its user instead of the administrator."""
        scheme, rest = url.split("://", 1)
        return f"{scheme}://{role}@{rest.split('@', 1)[1]}"


@pytest.fixture(params=ENGINES)
def fresh(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Fresh]:
    engine = request.param
    admin = ""
    if engine == "postgres":
        admin = request.getfixturevalue("postgres_server")
    elif engine == "mysql":
        admin = request.getfixturevalue("mysql_server")
    f = Fresh(engine, tmp_path, admin, [])
    yield f
    for name in f.made:
        if engine == "postgres":
            _pg_admin(admin, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        elif engine == "mysql":
            _mysql_admin(admin, f"DROP DATABASE IF EXISTS `{name}`")


def _source_with_a_row(tmp_path: Path) -> str:
    src = str(tmp_path / "source.db")
    with Ledger.open(src) as ledger:
        ledger.init()
        ledger.complete(ledger.claim("acct_A", "order-1", fingerprint("POST", "/x", [], b"")), 201, {}, b"{}")
    return src


# -- the hints ------------------------------------------------------------------------------------
def test_the_init_hint_of_a_missing_ledger_names_it_and_makes_it_usable(fresh: Fresh):
    target = fresh.place()
    line = hint_line("--db", target, "stats")
    # The location carries no password: printed as given, so it can be typed.
    assert commands_in(line) == [f"idemctl --db {shlex.quote(target)} init"]
    type_it(commands_in(line)[0])
    assert idemctl("--db", target, "stats").code == 0


def test_init_creates_a_missing_server_database_itself(fresh: Fresh):
    target = fresh.place()
    done = idemctl("--db", target, "init")
    assert done.code == 0, done.stderr
    assert done.stdout.splitlines()[-1].endswith("created (schema version 3)")
    if fresh.engine != "sqlite":
        assert done.stdout.splitlines()[0].split(": ")[1].startswith("created the database")
    assert idemctl("--db", target, "stats").code == 0


def test_copy_init_creates_a_missing_destination_and_copies(fresh: Fresh, tmp_path: Path):
    src, target = _source_with_a_row(tmp_path), fresh.place()
    done = idemctl("--db", src, "copy", "--to", target, "--init", "--json")
    assert done.code == 0, done.stderr
    assert '"rows_written": 1' in done.stdout or '"inserted": 1' in done.stdout, done.stdout
    inspected = idemctl("--db", target, "inspect", "order-1", "--principal", "acct_A")
    assert inspected.code == 0, inspected.stderr


def test_copy_dry_run_hint_names_the_destination_and_typing_it_lets_the_dry_run_through(fresh: Fresh, tmp_path: Path):
    src, target = _source_with_a_row(tmp_path), fresh.place()
    line = hint_line("--db", src, "copy", "--to", target, "--dry-run")
    assert line.startswith("error: the destination")
    assert commands_in(line) == [f"idemctl --db {shlex.quote(target)} init"]
    type_it(commands_in(line)[0])
    assert idemctl("--db", src, "copy", "--to", target, "--dry-run").code == 0
    without_init = hint_line("--db", src, "copy", "--to", fresh.place())
    assert without_init.endswith("pass --init to create or upgrade it")


def test_a_missing_directory_hint_makes_it_then_inits(tmp_path: Path):
    target = str(tmp_path / "not" / "yet" / "ledger.db")
    for command in ("init", "stats"):
        line = hint_line("--db", target, command)
        assert commands_in(line) == [f"mkdir -p {tmp_path / 'not' / 'yet'} && idemctl --db {target} init"], line
    type_it(commands_in(line)[0])
    assert idemctl("--db", target, "stats").code == 0


@pytest.mark.parametrize("fresh", ["postgres", "mysql"], indirect=True)
@pytest.mark.parametrize("command", ["init", "copy"])
def test_a_role_that_may_not_create_the_database_gets_the_admin_statement_then_the_same_command(
    fresh: Fresh, tmp_path: Path, command: str
):
    role = f"idemctl_hint_{secrets.token_hex(4)}"
    if fresh.engine == "postgres":
        _pg_admin(fresh.admin_url, f'CREATE ROLE "{role}" LOGIN NOCREATEDB')
        admin_env = {"PGUSER": "postgres"}  # the administrator's own identity
        if shutil.which("createdb") is None:
            if os.environ.get("CI"):
                pytest.fail("CI installs createdb (.ci/run)", pytrace=False)
            pytest.skip("createdb (the PostgreSQL client) is not installed")
    else:
        if shutil.which("mysql") is None:
            if os.environ.get("CI"):
                pytest.fail("CI installs the mysql client (.ci/run)", pytrace=False)
            pytest.skip("the mysql client is not installed")
        _mysql_admin(fresh.admin_url, f"CREATE USER '{role}'@'%'")
        admin_env = {}
    try:
        target = fresh.as_role(fresh.place(), role)
        args = ["--db", target, "init"]
        if command == "copy":
            args = ["--db", _source_with_a_row(tmp_path), "copy", "--to", target, "--init"]
        line = hint_line(*args)
        admin, again = commands_in(line)
        assert again == shlex.join(["idemctl", *args]), line
        type_it(admin, env=admin_env)
        type_it(again)
        assert idemctl("--db", target, "stats").code == 0
    finally:
        for name in fresh.made:
            if fresh.engine == "postgres":
                _pg_admin(fresh.admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if fresh.engine == "postgres":
            _pg_admin(fresh.admin_url, f'DROP ROLE IF EXISTS "{role}"')
        else:
            _mysql_admin(fresh.admin_url, f"DROP USER IF EXISTS '{role}'@'%'")


def test_the_read_only_hint_says_what_blocks_the_write_and_typing_it_lets_the_sweep_through(tmp_path: Path):
    db = tmp_path / "ro.db"
    with Ledger.open(db, clock=lambda: wall_clock_ms() - 30 * 3_600_000) as ledger:
        ledger.init()
        ledger.complete(ledger.claim("acct_A", "old", fingerprint("POST", "/x", [], b"")), 201, {}, b"{}")
    with read_only_file(db):
        line = hint_line("--db", str(db), "sweep")
        assert commands_in(line) == [f"chattr -i {db}"]
        type_it(commands_in(line)[0])
        done = idemctl("--db", str(db), "sweep")
    assert done.code == 0, done.stderr
    assert done.stdout.startswith("deleted 1 row(s)")


def test_the_simulation_s_see_it_with_command_shows_the_row(fresh: Fresh):
    target = fresh.place()
    assert idemctl("--db", target, "init").code == 0
    done = idemctl("simulate", "takeover", "--db", target)
    assert done.code == 0, done.stderr
    last = done.stdout.rstrip().splitlines()[-1]
    command = last.split("see it with: ", 1)[1]
    assert command == f"idemctl inspect order-42 --principal acct_A --db {shlex.quote(target)}"
    shown = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=_env(), timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("acct_A / order-42\n")


def test_a_url_with_a_password_is_never_printed_in_a_hint(postgres_server: str):
    secret = f"s3cret{secrets.token_hex(3)}"
    target = _with_database(postgres_server.replace("postgres@", f"postgres:{secret}@"), "idemctl_hint_absent")
    line = hint_line("--db", target, "stats")
    assert secret not in line
    assert "--db '<the same URL>' init" in line


# -- output on a terminal and piped ----------------------------------------------------------------
@pytest.fixture
def busy_ledger(tmp_path: Path) -> str:
    db = str(tmp_path / "busy.db")
    assert idemctl("--db", db, "init").code == 0
    assert idemctl("simulate", "takeover", "--db", db).code == 0  # a fenced-out event
    with Ledger.open(db) as ledger:
        ledger.claim("acct_B", "pay-1", fingerprint("POST", "/x", [], b""))  # a pending row
    return db


@pytest.mark.parametrize(
    ("args", "header"),
    [
        (["pending"], ["principal", "key", "gen", "age", "a", "retry", "now"]),
        (["fenced"], ["fenced", "at", "(UTC)", "age", "principal", "key", "late", "row", "status"]),
        (
            ["fenced", "--key", "order-42"],
            ["fenced", "at", "(UTC)", "age", "principal", "key", "late", "row", "status"],
        ),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) and v and v[0] != "principal" else None,
)
def test_a_listing_begins_with_its_header_piped_and_on_a_terminal(busy_ledger: str, args: list[str], header: list[str]):
    piped = idemctl("--db", busy_ledger, *args)
    assert piped.code == 0, piped.stderr
    assert piped.stdout.splitlines()[0].split() == header  # `idemctl pending | head -1` is the header
    code, shown = idemctl_in_a_pty("--db", busy_ledger, *args)
    assert code == 0
    assert shown.splitlines()[0].split() == header


def test_stats_notes_start_in_one_column_piped_and_on_a_terminal(busy_ledger: str):
    piped = idemctl("--db", busy_ledger, "stats")
    _, shown = idemctl_in_a_pty("--db", busy_ledger, "stats")
    for text in (piped.stdout, shown):
        columns = {line.index("(") for line in text.splitlines() if re.match(r"\s*[a-z ,-]+\s+\d+\s+\(", line)}
        assert len(columns) == 1, text


def test_stats_counts_of_any_width_line_up():
    from rich.console import Console

    from idemctl.cli.views import stats_grid
    from idemctl.outcomes import Stats
    from idemctl.policy import Policy

    st = Stats(
        now=0, total=123_456, pending_fresh=1, pending_stale=22, completed=3_001, expired=3_001, taken_over=0,
        fenced_out_events=7, oldest_pending_at=None, oldest_completed_at=None, oldest_row_at=None,
        storage_bytes=1, schema_version=3, expired_pending=0,
    )  # fmt: skip
    console = Console(width=200, record=True)
    with console.capture() as captured:
        console.print(stats_grid("x.db", st, Policy()))
    lines = captured.get().splitlines()
    counts = [line for line in lines if re.match(r"\s*(rows|pending|completed|expired|taken|fenced)", line)]
    assert len(counts) == 7
    ends = {re.match(r"\D*\d+", line).end() for line in counts}  # type: ignore[union-attr]
    assert len(ends) == 1, "\n".join(counts)
    assert len({line.index("(") for line in counts if "(" in line}) == 1


# -- shell completion --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("words", "expected"),
    [
        ("idemctl simulate ", ["happy", "reuse", "in-progress", "takeover", "race", "sweep"]),
        ("idemctl simulate ta", ["takeover"]),
        ("idemctl stats --format ", ["text", "json", "prometheus"]),
        ("idemctl --db x.db stats --format p", ["prometheus"]),
    ],
)
def test_bash_completion_offers_scenarios_and_formats(words: str, expected: list[str]):
    cword = len(words.split()) - (0 if words.endswith(" ") else 1)
    env = {**_env(), "_IDEMCTL_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(cword)}
    done = subprocess.run(["idemctl"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == expected


# -- what the docs say ------------------------------------------------------------------------------
def test_a_read_command_leaves_wal_and_shm_and_the_next_write_removes_them(tmp_path: Path):
    # docs/cli.md, "Files beside a SQLite ledger": a read-only connection may
    # not remove them; a writer closing last does.
    db = tmp_path / "demo.db"
    assert idemctl("--db", str(db), "init").code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.db"]
    for command in ("stats", "pending", "fenced"):
        assert idemctl("--db", str(db), command).code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.db", "demo.db-shm", "demo.db-wal"]
    assert (tmp_path / "demo.db-wal").stat().st_size == 0
    assert idemctl("simulate", "happy", "--db", str(db)).code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.db", "demo.db-idemctl.lock"]


def test_the_sweep_scenario_s_clock_step_says_what_the_clock_shows():
    done = idemctl("simulate", "sweep")
    assert done.code == 0, done.stderr
    advance = next(line for line in done.stdout.splitlines() if " advance " in line)
    assert advance.split()[:5] == ["+24:00:01.000", "clock", "advance", "1", "d"]
    assert advance.split()[5:8] == ["1", "s", "advanced"]
    assert "virtual clock +1 d 1 s" in done.stdout


def test_copy_init_into_a_missing_directory_says_mkdir_then_the_same_copy(tmp_path: Path):
    src = _source_with_a_row(tmp_path)
    target = str(tmp_path / "new" / "dir" / "copy.db")
    line = hint_line("--db", src, "copy", "--to", target, "--init")
    assert commands_in(line) == [f"mkdir -p {tmp_path / 'new' / 'dir'} && idemctl --db {src} copy --to {target} --init"]
    type_it(commands_in(line)[0])
    assert idemctl("--db", target, "inspect", "order-1", "--principal", "acct_A").code == 0


def _older_schema_ledger(path: Path) -> str:
    """A SQLite ledger as idemctl left it at schema version 2: no key_id."""
    import sqlite3

    with Ledger.open(str(path)) as ledger:
        ledger.init()
    conn = sqlite3.connect(path)
    try:
        conn.executescript(
            "DROP INDEX idx_idempotency_keys_key_id;"
            " ALTER TABLE idempotency_keys DROP COLUMN key_id;"
            " UPDATE idemctl_schema_version SET version = 2;"
        )
    finally:
        conn.close()
    return str(path)


def test_the_upgrade_hint_of_an_older_schema_upgrades_it_and_the_command_then_runs(tmp_path: Path):
    db = _older_schema_ledger(tmp_path / "older.db")
    line = hint_line("--db", db, "simulate", "takeover")
    assert "older ledger schema" in line
    assert commands_in(line) == [f"idemctl --db {shlex.quote(db)} init"]
    type_it(commands_in(line)[0])
    assert idemctl("--db", db, "simulate", "takeover").code == 0


def test_the_fenced_hint_of_a_recipe_only_ledger_adds_the_log(tmp_path: Path):
    import sqlite3

    db = str(tmp_path / "recipe.db")
    schema = Path(__file__).resolve().parents[2] / "schema" / "sqlite" / "0001_recipe.sql"
    conn = sqlite3.connect(db)
    try:
        conn.executescript(schema.read_text())
    finally:
        conn.close()
    before = idemctl("--db", db, "fenced")
    assert before.code == 0, before
    assert before.stdout.startswith("no fenced-out log: this ledger has only the recipe's table"), before.stdout
    (command,) = commands_in(before.stdout)
    assert command == f"idemctl --db {shlex.quote(db)} init"
    type_it(command)
    after = idemctl("--db", db, "fenced")
    assert after.code == 0 and "no fenced-out log" not in after.stdout, after
