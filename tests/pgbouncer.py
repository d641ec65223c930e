"""PgBouncer in front of the test PostgreSQL server, in its default
configuration apart from where it listens, how it authenticates (trust, with
an auth_file) and its pool mode: Debian's `pgbouncer` binary on a free port,
in a temporary directory, run as the `postgres` user (it refuses root)."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.helpers import skip_or_fail
from tests.ports import free_port

POOL_MODES = ("session", "transaction", "statement")
# The user PgBouncer runs as when the tests run as root.
RUN_AS = "postgres"


class PgBouncer:
    """One running PgBouncer: `url(path_and_query)` is a URL through it."""

    def __init__(self, mode: str, port: int, directory: Path, process: subprocess.Popen[bytes], user: str) -> None:
        self.mode, self.port, self.directory, self.process, self.user = mode, port, directory, process, user

    def url(self, dbname: str = "test", query: str = "") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{dbname}" + (f"?{query}" if query else "")

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.directory / "pgbouncer.log").read_text(errors="replace")
        return ""


def missing_reason() -> str | None:
    """Why PgBouncer cannot run here, or None."""
    if shutil.which("pgbouncer") is None and not Path("/usr/sbin/pgbouncer").exists():
        return "PgBouncer is not installed (apt-get install -y pgbouncer)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(RUN_AS)
        except KeyError:
            return f"PgBouncer refuses to run as root and there is no {RUN_AS!r} user to run it as"
    return None


@contextlib.contextmanager
def running_pgbouncer(
    mode: str, server_url: str, *, ignore_options: bool = False, any_database: bool = False, check: bool = True
) -> Iterator[PgBouncer]:
    """PgBouncer in `mode` pooling in front of the server at `server_url`
    (a postgresql:// URL), until the block ends. `ignore_options`: with the
    usual workaround for clients that send startup options,
    ``ignore_startup_parameters = options`` (it then drops them silently).
    `any_database`: with the fallback entry ``* =`` that passes any database
    name on to the server (a database created later is reachable through it).
    `check`: wait until a connection through it reaches the server (without,
    only until it listens: for a server that is not there)."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    params = conninfo_to_dict(server_url.split("?", 1)[0])
    user = str(params.get("user") or "postgres")
    directory = Path(tempfile.mkdtemp(prefix=f"idemctl-pgbouncer-{mode}-"))
    port = free_port()
    (directory / "users.txt").write_text(f'"{user}" ""\n')
    (directory / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"{params.get('dbname', 'test')} = host={params.get('host', '127.0.0.1')} port={params.get('port', 5432)}"
        f" dbname={params.get('dbname', 'test')}\n"
        + (f"* = host={params.get('host', '127.0.0.1')} port={params.get('port', 5432)}\n" if any_database else "")
        + "[pgbouncer]\n"
        # Its wait after a failed login (15 s by default) shortened, though
        # still past libpq's 5 s connect_timeout: a database created through
        # it times out once, as in production, and a test waits 8 s, not 15.
        + ("server_login_retry = 8\n" if any_database else "")
        + "listen_addr = 127.0.0.1\n"
        f"listen_port = {port}\n"
        f"unix_socket_dir = {directory}\n"
        "auth_type = trust\n"
        f"auth_file = {directory / 'users.txt'}\n"
        f"pool_mode = {mode}\n"
        f"logfile = {directory / 'pgbouncer.log'}\n"
        + ("ignore_startup_parameters = options\n" if ignore_options else "")
    )
    binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    command = [binary, str(directory / "pgbouncer.ini")]
    if os.geteuid() == 0:
        entry = pwd.getpwnam(RUN_AS)
        os.chown(directory, entry.pw_uid, entry.pw_gid)
        for child in directory.iterdir():
            os.chown(child, entry.pw_uid, entry.pw_gid)
        command[1:1] = ["-u", RUN_AS]
    # Its log goes to the logfile too; a pipe nobody reads would block it once full.
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    bouncer = PgBouncer(mode, port, directory, process, user)
    try:
        deadline = time.monotonic() + 15
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"pgbouncer exited with {process.returncode}: {bouncer.log()[-2000:]}")
            try:
                if check:
                    psycopg.connect(bouncer.url(str(params.get("dbname", "test"))), connect_timeout=2).close()
                else:
                    socket.create_connection(("127.0.0.1", port), timeout=2).close()
                break
            except (psycopg.Error, OSError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"pgbouncer did not accept connections: {bouncer.log()[-2000:]}") from None
                time.sleep(0.1)
        yield bouncer
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if not os.environ.get("IDEMCTL_TEST_KEEP_PGBOUNCER"):  # its log, to read after a failure
            shutil.rmtree(directory, ignore_errors=True)


def start_or_skip(
    mode: str, server_url: str, *, ignore_options: bool = False, any_database: bool = False, check: bool = True
) -> contextlib.AbstractContextManager[PgBouncer]:
    """`running_pgbouncer`, or skip (fail under CI) with the reason it cannot run."""
    skip_or_fail(missing_reason(), "CI runs the PgBouncer tests")
    return running_pgbouncer(mode, server_url, ignore_options=ignore_options, any_database=any_database, check=check)
