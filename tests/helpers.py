"""Helpers the test modules share (fixtures live in conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib
import json
import os
import re
import secrets
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import pytest

from idemctl import Ledger
from idemctl.cli.simulation import VirtualClock
from idemctl.storage.engine import Params, Rows
from idemctl.storage.sqlite import SqliteEngine

# Test data lives inside the checkout, so a clone anywhere runs the suite.
# The checkout the suite runs from: docs, examples and bench are read from it.
ROOT = Path(__file__).resolve().parent.parent


# Milliseconds since the epoch, counted on the monotonic clock (the same in
# every process of the machine): the clock of tests that race renewals
# against a TTL. The lease keeper schedules its renewals on the monotonic
# clock; a step of the wall clock (time sync on a busy CI machine) would age
# a row it renewed on time and fail such a test for nothing idemctl did.
STEADY_EPOCH_MS = time.time_ns() // 1_000_000 - time.monotonic_ns() // 1_000_000


def steady_ms() -> int:
    return STEADY_EPOCH_MS + time.monotonic_ns() // 1_000_000


def interruptible() -> None:
    """`preexec_fn` for a child that a test sends Ctrl-C (SIGINT): its SIGINT
    as a terminal gives it. A program started from a shell without job
    control (a background `&` in a script) inherits SIGINT ignored, and
    Python then keeps ignoring it: Ctrl-C would never reach the command."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


VECTORS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vectors")

# The environment variables idemctl.config reads (the CLI's defaults), and the
# retired names it refuses.
IDEMCTL_ENV = (
    "IDEMCTL_DB",
    "IDEMCTL_PENDING_TTL",
    "IDEMCTL_RETENTION",
    "IDEMCTL_FENCED_RETENTION",
    "IDEMCTL_BUSY_TIMEOUT",
    "IDEMCTL_PENDING_TTL_MS",
    "IDEMCTL_RETENTION_MS",
)


def read_terminal(master: int, on_output: Callable[[bytes], object] | None = None) -> bytes:
    """What the other end of a pseudo-terminal wrote, read as it writes (a
    full terminal buffer would block it) until it closes its end;
    `on_output(seen so far)` after each read. The caller closes `master`."""
    seen = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the terminal's other end is closed
            break
        if not chunk:
            break
        seen += chunk
        if on_output is not None:
            on_output(seen)
    return seen


def quick_bench(module: str, workdir: Path, *extra: str) -> Any:
    """What ``python -m bench.<module> --quick [extra...]`` prints (its
    JSON), run from the checkout with its files under `workdir`; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", "--quick", "--dir", str(workdir), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def missing_driver(module: str, tests: str, extra: str) -> str | None:
    """Why `tests` cannot run here when `module` (an engine of idemctl's)
    cannot import its driver: the extra that brings it; None when it can."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return f"{tests} tests need the driver: pip install -e '.[{extra}]' ({exc.name} is missing)"
    return None


def fingerprint_post_orders(*headers: str, body: str | None = None) -> list[str]:
    """The CLI's `fingerprint` of a POST /orders with these headers (and body)."""
    args = ["fingerprint", "-X", "POST", "--path", "/orders"]
    for header in headers:
        args += ["-H", header]
    return args if body is None else [*args, "--body", body]


def sqlite_ledger_of_version(path: str | os.PathLike[str], version: int) -> None:
    """A SQLite ledger at `path` whose schema says `version` (one a newer
    idemctl would write), on top of this idemctl's own."""
    with Ledger.open(path) as ledger:
        ledger.init()
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("INSERT INTO idemctl_schema_version (version, applied_at) VALUES (?, 0)", (version,))


def skip_or_fail(reason: str | None, under_ci: str) -> None:
    """Skip the test with `reason`, or, under CI (env ``CI`` set), which
    must run it, fail with ``under_ci: reason``; nothing when `reason` is None."""
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{under_ci}: {reason}", pytrace=False)
    pytest.skip(reason)


class FakeClock(VirtualClock):
    """The simulator's virtual clock, started at a fixed instant so that every
    run of a test sees the same times."""

    def __init__(self, start: int = 1_700_000_000_000) -> None:
        super().__init__(start)


def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path | None = None, *, columns: str | None = None) -> None:
    """Run the CLI as if on a machine with no IDEMCTL_* settings: in
    `tmp_path` (when given), and `columns` wide (the width `--help` is
    wrapped to)."""
    for name in IDEMCTL_ENV:
        monkeypatch.delenv(name, raising=False)
    if columns is not None:
        monkeypatch.setenv("COLUMNS", columns)
    if tmp_path is not None:
        monkeypatch.chdir(tmp_path)


@contextlib.contextmanager
def read_only_file(path: str | os.PathLike[str]) -> Iterator[None]:
    """Make a file truly read-only for root too (chattr +i), or skip with the reason."""
    path = os.fspath(path)
    done = subprocess.run(["chattr", "+i", path], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot make {path} immutable here: {done.stderr.strip() or 'chattr failed'}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", path], check=False)


def for_one_test(
    url: str, engine_class: type[Any], monkeypatch: pytest.MonkeyPatch, drop: Callable[[], None]
) -> Iterator[str]:
    """`url` for one test; afterwards every engine of `engine_class` the test
    opened is closed (pools a test forgot to close would hold server
    connections for the rest of the run), then `drop()` removes what the
    test's database held and ends whatever is still connected."""
    opened: list[Any] = []
    real_init = engine_class.__init__

    def tracking_init(self: Any, *args: object, **kwargs: object) -> None:
        real_init(self, *args, **kwargs)
        opened.append(self)

    monkeypatch.setattr(engine_class, "__init__", tracking_init)
    try:
        yield url
    finally:
        for engine in opened:
            engine.close()
        drop()


def postgres_test_schema(base: str, monkeypatch: pytest.MonkeyPatch, *, via: str | None = None) -> Iterator[str]:
    """A private schema on the test server for one test, as a URL whose
    search_path holds only that schema, so processes started by the test reach
    the same isolated ledger by URL. Dropped afterwards with everything the
    test left open in it. `via`: the URL leads through this pooler's URL
    (the schema is still made and dropped on the server itself)."""
    import psycopg

    from idemctl.storage import postgres

    schema = f"t_{secrets.token_hex(6)}"
    app = f"idemctl-test-{schema}"
    sep = "&" if "?" in (via or base) else "?"
    url = f"{via or base}{sep}options=-csearch_path%3D{schema}&application_name={app}"
    with psycopg.connect(base, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")

    def drop() -> None:
        with psycopg.connect(base, autocommit=True) as admin:
            # A pooler keeps its idle server connections (the last client's
            # application_name on them) for the next test: only a busy one,
            # which could hold a lock on the schema, is ended.
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = %s AND pid <> pg_backend_pid()" + (" AND state <> 'idle'" if via else ""),
                (app,),
            )
            admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")

    yield from for_one_test(url, postgres.PostgresEngine, monkeypatch, drop)


def mysql_test_database(base: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A database of its own on the MariaDB/MySQL test server for one test,
    as a URL, so processes started by the test reach the same isolated
    ledger. Dropped afterwards, after ending every connection still in it."""
    import pymysql

    from idemctl.storage import mysql

    name = f"t_{secrets.token_hex(6)}"
    url = base.split("?", 1)[0].rsplit("/", 1)[0] + f"/{name}" + (f"?{base.split('?', 1)[1]}" if "?" in base else "")

    def admin() -> pymysql.connections.Connection:
        return pymysql.connect(**{**mysql_connect_args(base), "database": None})

    with contextlib.closing(admin()) as conn, conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE {name} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")

    def drop() -> None:
        with contextlib.closing(admin()) as conn, conn.cursor() as cur:
            cur.execute(
                "SELECT id FROM information_schema.processlist WHERE db = %s AND id <> CONNECTION_ID()", (name,)
            )
            for (thread_id,) in cur.fetchall():
                with contextlib.suppress(pymysql.MySQLError):
                    cur.execute(f"KILL {int(thread_id)}")
            cur.execute(f"DROP DATABASE IF EXISTS {name}")

    yield from for_one_test(url, mysql.MysqlEngine, monkeypatch, drop)


_T = TypeVar("_T")

# One file for every test process on this machine: the MariaDB server is shared.
_INNODB_TRX_GATE = Path(os.environ.get("TMPDIR", "/tmp")) / "idemctl-tests-innodb-trx.gate"
_INNODB_TRX_QUIET_S = 0.15


def read_innodb_trx(read: Callable[[], _T]) -> _T:
    """Run `read` (a query on information_schema.innodb_trx) so that it sees fresh rows.

    InnoDB refreshes that table only when nobody has read it for 100 ms, so two
    workers polling the same server every 150 ms keep it stale for each other
    forever. Readers take turns through one file lock, each at least 150 ms
    after the last read by anyone.
    """
    with open(_INNODB_TRX_GATE, "a+") as gate:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            gate.seek(0)
            last = float(gate.read() or 0)
            time.sleep(max(0.0, last + _INNODB_TRX_QUIET_S - time.monotonic()))
            try:
                return read()
            finally:
                gate.seek(0)
                gate.truncate()
                gate.write(repr(time.monotonic()))
                gate.flush()
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)


def descriptors_of(path: str | os.PathLike[str]) -> list[int]:
    """This process's open descriptors on the file at `path`."""
    target = os.path.realpath(path)
    found = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}") == target:
                found.append(int(name))
    return found


def sqlite_connections_open(path: str | os.PathLike[str]) -> int:
    """How many SQLite connections this process holds open on the WAL ledger
    at `path`: SQLite opens the -wal file once per connection and closes it
    with the connection. (Descriptors of the database file itself it may keep
    for reuse after a connection closed, so those do not count connections.)"""
    return len(descriptors_of(f"{os.fspath(path)}-wal"))


class EveryWriteInOneTransaction(SqliteEngine):
    """A SQLite engine whose every write, even one with no other to share a
    commit with, runs as a group commit's batch runs (`write_batch`: its own
    transaction), so that a test with one thread drives that path too."""

    def write(self, sql: str, params: Params) -> Rows:
        (outcome,) = self.write_batch([(sql, params)])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def mysql_connect_args(url: str) -> dict[str, Any]:
    """pymysql's arguments for a plain connection to the database a test's
    mysql:// URL names (user, password, host, port), with the server's own
    session defaults."""
    parts = urlsplit(url)
    return {
        "user": unquote(parts.username or ""),
        "password": unquote(parts.password or ""),
        "host": unquote(parts.hostname or "127.0.0.1"),
        "port": parts.port or 3306,
        "database": unquote(parts.path.lstrip("/")),
        "charset": "utf8mb4",
        "autocommit": True,
    }


class RecipeWriter:
    """A writer that stores the Idempotency-Key header as it came, with the
    recipe Worker's own statements (the recipe's D1 SQL; on MariaDB, the
    form idemctl used there before it parsed sf-strings): the rows such a
    writer left in a ledger, and a writer of that kind still running during
    a rolling deployment. Its own connection, outside idemctl."""

    def __init__(self, target: str) -> None:
        self.mysql = target.startswith(("mysql://", "mariadb://"))
        self.postgres = target.startswith(("postgres://", "postgresql://"))
        if self.postgres:
            import psycopg
            from psycopg.conninfo import conninfo_to_dict, make_conninfo

            # The URL's `-c name=value` options are set inside each
            # statement's transaction, not sent at connect: a PgBouncer in
            # front of the server (the pgbouncer-* engines) refuses them.
            params = conninfo_to_dict(target)
            options = str(params.pop("options", "") or "")
            words = options.replace("-c ", "-c").split()
            self.settings = [tuple(w[2:].split("=", 1)) for w in words if w.startswith("-c") and "=" in w]
            self.conn: Any = psycopg.connect(make_conninfo("", **params), autocommit=True, prepare_threshold=None)
        elif self.mysql:
            import pymysql

            self.conn = pymysql.connect(**mysql_connect_args(target))
        else:
            import sqlite3

            self.conn = sqlite3.connect(target, timeout=30, isolation_level=None, check_same_thread=False)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> RecipeWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, sql: str, params: tuple[Any, ...]) -> tuple[int, list[tuple[Any, ...]]]:
        if self.postgres or self.mysql:
            sql = sql.replace("?", "%s")
        if self.mysql:
            sql = re.sub(r"(?<![\w`])key(?![\w`])", "`key`", sql)
        if self.postgres:
            with self.conn.transaction(), self.conn.cursor() as cur:
                for name, value in self.settings:
                    cur.execute("SELECT set_config(%s, %s, true)", (name, value))
                cur.execute(sql, params)
                return cur.rowcount, list(cur.fetchall()) if cur.description else []
        cur = self.conn.cursor()
        try:
            cur.execute(sql, params)
            rows = list(cur.fetchall()) if cur.description else []
            return cur.rowcount, rows
        finally:
            cur.close()

    def body(self, text: str) -> Any:
        return text if not (self.postgres or self.mysql) else text.encode()

    def insert_completed(
        self, principal: str, key: str, fingerprint: str, status: int, headers: str, body: str, at: int
    ) -> None:
        """A completed row, exactly as the recipe's claim and completion leave it (no token)."""
        self._run(
            "INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, response_status,"
            " response_body, response_headers, created_at, updated_at)"
            " VALUES (?, ?, ?, 'completed', 1, ?, ?, ?, ?, ?)",
            (principal, key, fingerprint, status, self.body(body), headers, at, at),
        )

    def claim(self, principal: str, key: str, fingerprint: str, at: int) -> bool:
        """The recipe's claim; False when the key is taken. A unique index
        it does not name (idemctl's key_id) makes it raise instead, as the
        recipe's Worker would: it then runs nothing."""
        if self.mysql:
            count, _ = self._run(
                "INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, created_at, updated_at)"
                " VALUES (?, ?, ?, 'pending', 1, ?, ?) ON DUPLICATE KEY UPDATE generation = generation",
                (principal, key, fingerprint, at, at),
            )
            return count == 1
        _, rows = self._run(
            "INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, created_at, updated_at)"
            " VALUES (?, ?, ?, 'pending', 1, ?, ?) ON CONFLICT (principal, key) DO NOTHING RETURNING key, generation",
            (principal, key, fingerprint, at, at),
        )
        return bool(rows)

    def complete(self, principal: str, key: str, status: int, headers: str, body: str, at: int) -> None:
        self._run(
            "UPDATE idempotency_keys SET status = 'completed', response_status = ?, response_body = ?,"
            " response_headers = ?, updated_at = ? WHERE principal = ? AND key = ? AND generation = 1"
            " AND status = 'pending'",
            (status, self.body(body), headers, at, principal, key),
        )


# -- the store's statements, told apart -----------------------------------------------
# The decision loop asks the store for statements (Store.run), never for
# operations by name: a test that holds or breaks one step wraps `run` and
# tells the statement by its text.
_STEP_TEXTS = ("CLAIM", "CLAIM_OR_READ", "LOOKUP", "TAKEOVER", "COMPLETE", "COMPLETED_AS", "RELEASE", "RECORD_FENCED")


def step_of(op: Any) -> str | None:
    """Which request-path statement `op` (a Statement, Turn or Tables) runs,
    by the name of its text in idemctl.storage.statements, lower case
    ("claim_or_read", "complete", ...); None for any other."""
    from idemctl.storage import statements
    from idemctl.storage.store_base import Statement

    if type(op) is not Statement:
        return None
    store = op.store
    if op.sql == store.sql(store.dialect.now_sql):
        return "database_now"
    for name in _STEP_TEXTS:
        try:
            if op.sql == store.sql(getattr(statements, name)):
                return name.lower()
        except Exception:  # a text this engine has no form of
            continue
    return None


def wrap_store_run(store: Any, around: Any) -> Any:
    """Make `store.run(op)` call `around(step_of(op), run_it)` (run_it()
    runs the op for real) on this store object only; returns the real run,
    to put back with ``store.run = real``."""
    real = store.run

    def run(op: Any) -> Any:
        return around(step_of(op), lambda: real(op))

    store.run = run
    return real


def drained(count: Callable[[], int], within_s: float) -> int:
    """`count()` once it is 0, or at the end of `within_s` seconds: server
    connections a client closed leave pg_stat_activity a moment later."""
    deadline = time.monotonic() + within_s
    while (left := count()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def handled_in_a_forked_child(ledger: Ledger, key: str, probe: Callable[[Ledger], int]) -> tuple[int, int]:
    """Fork; the child runs one request for `key` on the parent's ledger,
    reports `probe(ledger)` (which connection it used) and the answer's
    status, closes its copy of the ledger and exits. Returns what the child
    reported, once it has exited cleanly."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            answer = ledger.handle("acct", key, "POST", "/o", {}, b"{}", lambda body: (201, {}, b"{}"))
            os.write(write_end, json.dumps([probe(ledger), answer.status]).encode())
            ledger.close()  # closes the child's connections only
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    _, status = os.waitpid(child, 0)
    report = os.read(read_end, 1000)
    os.close(read_end)
    assert os.waitstatus_to_exitcode(status) == 0
    child_probe, child_status = json.loads(report)
    return child_probe, child_status


def post_scope(key: str, *, path: str = "/orders", body_length: int = 2, **more: Any) -> dict[str, Any]:
    """The ASGI scope of one POST carrying an Idempotency-Key (and `more` keys)."""
    return {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"idempotency-key", key.encode()), (b"content-length", str(body_length).encode())],
        **more,
    }


async def asgi_exchange(app: Any, scope: dict[str, Any], body: bytes = b"{}") -> list[dict[str, Any]]:
    """Run `app` for one request whose body is `body` in one message; every
    message it sent. A further receive waits, as a client that stays does."""
    sent: list[dict[str, Any]] = []
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


@dataclass
class Reply:
    """An answer as a test's client saw it: the status as its server gives
    it (a WSGI status line, or a number), header pairs, the body."""

    status: int | str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k.lower() == name.lower()]
        return values[0] if values else None

    @property
    def lowered(self) -> list[tuple[str, str]]:
        return [(k.lower(), v) for k, v in self.headers]

    @property
    def code(self) -> int:
        return int(str(self.status)[:3])

    def json(self) -> Any:
        return json.loads(self.body)
