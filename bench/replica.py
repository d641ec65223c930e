"""A PostgreSQL primary and a streaming standby, started from the installed
binaries in a temporary directory, for failover measurements.

Both clusters listen on 127.0.0.1 only, on ports the OS reports free, with
their sockets in a temporary directory (in /dev/shm where there is one):
the machine's own server is never touched. As root, every server command runs as the `postgres` OS user
(PostgreSQL refuses to run as root). `ReplicaPair.unavailable()` says why a
pair cannot be started here, for a test to skip with that reason.

    with ReplicaPair.start(synchronous=True) as pair:
        url = pair.url()            # both hosts, target_session_attrs=read-write
        pair.kill_primary()         # pg_ctl stop -m immediate
        pair.promote_standby()      # pg_ctl promote

Leaving the block stops both servers (immediately) and removes the
directory, whatever happened inside it."""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

BIN_ENV = "IDEMCTL_TEST_PG_BIN"
TOOLS = ("initdb", "pg_ctl", "pg_basebackup", "postgres")
STARTUP_TIMEOUT_S = 60
# initdb's output, made once per process and copied for each pair: initdb is
# most of a pair's start-up time. Removed when the process exits.
_TEMPLATES: dict[tuple[str, ...], Path] = {}
_TEMPLATE_LOCK = threading.Lock()


class PairError(RuntimeError):
    """A server command failed; the message carries its output."""


def find_bindir() -> str | None:
    """The directory holding initdb, pg_ctl and pg_basebackup: $IDEMCTL_TEST_PG_BIN,
    else the newest /usr/lib/postgresql/N/bin, else the one beside `initdb` on PATH."""
    candidates = []
    if os.environ.get(BIN_ENV):
        candidates.append(os.environ[BIN_ENV])
    versions = glob.glob("/usr/lib/postgresql/*/bin")
    candidates += sorted(
        versions, key=lambda p: int(p.split("/")[-2]) if p.split("/")[-2].isdigit() else 0, reverse=True
    )
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(os.path.dirname(on_path))
    for bindir in candidates:
        if all(os.access(os.path.join(bindir, tool), os.X_OK) for tool in TOOLS):
            return bindir
    return None


def _runas_prefix() -> list[str] | None:
    """How to run a server command: as ourselves, or as root through
    `runuser -u postgres --` (None: root without a postgres user or runuser)."""
    if os.geteuid() != 0:
        return []
    try:
        import pwd

        pwd.getpwnam("postgres")
    except KeyError:
        return None
    runuser = shutil.which("runuser")
    return [runuser, "-u", "postgres", "--"] if runuser else None


def _scratch_dir() -> str | None:
    """Where the clusters go: memory (/dev/shm) where there is one, since the
    measurement is of processes, not disks, and a loaded disk makes copying a
    cluster take seconds; else the system's temporary directory."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Link:
    """The replication connection's path, through this process: it can stall
    (stop forwarding, as a congested network or a busy standby would) and be
    severed, dropping whatever WAL it still holds."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.flowing = threading.Event()
        self.flowing.set()
        self.severed = threading.Event()
        self.sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="replication-link", daemon=True).start()

    def _accept(self) -> None:
        while not self.severed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                while not self.flowing.is_set():
                    if self.severed.wait(0.05):
                        return  # what it held is lost with the link
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def stall(self) -> None:
        self.flowing.clear()

    def sever(self) -> None:
        self.severed.set()
        with self._lock:
            sockets, self.sockets = self.sockets, []
        for s in [self.listener, *sockets]:
            # shutdown wakes a thread blocked in recv (close alone does not)
            # and tells the standby at once that its primary is gone.
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()


@dataclass
class ReplicaPair:
    bindir: str
    root: Path
    runas: list[str]
    primary_port: int
    standby_port: int
    synchronous: bool
    link: Link
    started: list[Path] = field(default_factory=list)

    @staticmethod
    def unavailable() -> str | None:
        """Why a pair cannot be started on this machine, or None."""
        if find_bindir() is None:
            return (
                "the failover harness needs PostgreSQL's initdb, pg_ctl and pg_basebackup "
                f"(install the server package or set {BIN_ENV})"
            )
        runas = _runas_prefix()
        if runas is None:
            return "running as root, the failover harness needs a `postgres` OS user and runuser to start servers as"
        if runas:
            probe = tempfile.mkdtemp(prefix="idemctl-failover-probe-", dir=_scratch_dir())
            try:
                shutil.chown(probe, user="postgres", group=None)
                writable = (
                    subprocess.run([*runas, "test", "-w", probe], capture_output=True, timeout=30).returncode == 0
                )
            finally:
                shutil.rmtree(probe, ignore_errors=True)
            if not writable:
                return f"the `postgres` OS user cannot write to a directory under {os.path.dirname(probe)} (set TMPDIR)"
        return None

    @classmethod
    @contextlib.contextmanager
    def start(cls, *, synchronous: bool, synchronous_commit: str = "on") -> Iterator[ReplicaPair]:
        reason = cls.unavailable()
        if reason:
            raise PairError(reason)
        runas = _runas_prefix() or []
        root = Path(tempfile.mkdtemp(prefix="idemctl-failover-", dir=_scratch_dir()))
        primary, standby = _free_port(), _free_port()
        while standby == primary:
            standby = _free_port()
        pair = cls(str(find_bindir()), root, runas, primary, standby, synchronous, Link(primary))
        try:
            if runas:
                shutil.chown(root, user="postgres", group=None)
            os.chmod(root, 0o700)
            pair._start(synchronous_commit)
            yield pair
        finally:
            pair.stop()

    # -- paths and commands -------------------------------------------------------------
    @property
    def primary_dir(self) -> Path:
        return self.root / "primary"

    @property
    def standby_dir(self) -> Path:
        return self.root / "standby"

    def _run(self, tool: str, *args: str, timeout: float = STARTUP_TIMEOUT_S) -> str:
        cmd = [*self.runas, os.path.join(self.bindir, tool), *args]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["LC_ALL"] = "C"
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=self.root)
        if done.returncode != 0:
            raise PairError(
                f"{tool} {' '.join(args)} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}"
            )
        return done.stdout

    def _append_conf(self, datadir: Path, lines: list[str]) -> None:
        # Written by us and then read by the server as the postgres user:
        # postgresql.auto.conf is read last, so these lines win.
        with open(datadir / "postgresql.auto.conf", "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")

    def _pg_ctl_start(self, datadir: Path) -> None:
        self.started.append(datadir)  # first: a start that times out may still leave a server to stop
        self._run("pg_ctl", "-D", str(datadir), "-l", str(datadir.with_suffix(".log")), "-w", "-t", "60", "start")

    def _template(self) -> Path:
        key = (self.bindir, *self.runas)
        with _TEMPLATE_LOCK:
            done = _TEMPLATES.get(key)
            if done is not None and (done / "PG_VERSION").exists():
                return done
            root = Path(tempfile.mkdtemp(prefix="idemctl-failover-initdb-", dir=_scratch_dir()))
            atexit.register(shutil.rmtree, root, ignore_errors=True)
            if self.runas:
                shutil.chown(root, user="postgres", group=None)
            os.chmod(root, 0o700)
            data = root / "data"
            self._run(
                "initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync",
                "--wal-segsize=1",  # MB: less to copy for each pair and each standby
            )  # fmt: skip
            _TEMPLATES[key] = data
            return data

    def _start(self, synchronous_commit: str) -> None:
        template = self._template()
        copied = subprocess.run(
            [*self.runas, "cp", "-a", str(template), str(self.primary_dir)], capture_output=True, text=True, timeout=60
        )
        if copied.returncode != 0:
            raise PairError(f"copying {template} failed: {copied.stderr.strip()}")
        self._append_conf(
            self.primary_dir,
            [
                "listen_addresses = '127.0.0.1'",
                f"port = {self.primary_port}",
                f"unix_socket_directories = '{self.root}'",
                "max_connections = 60",
                "shared_buffers = '16MB'",
                "wal_level = replica",
                "max_wal_senders = 4",
                "wal_keep_size = '64MB'",
                "min_wal_size = '4MB'",
                # A process failure, not a power cut, is what is measured:
                # the OS keeps every write either way, and fsync would only
                # slow a shared machine down.
                "fsync = off",
                "full_page_writes = off",
                "logging_collector = off",
            ],
        )
        self._pg_ctl_start(self.primary_dir)
        self._run(
            "pg_basebackup", "-h", "127.0.0.1", "-p", str(self.primary_port), "-U", "postgres",
            "-D", str(self.standby_dir), "-R", "-X", "stream", "--checkpoint=fast", "--no-sync",
        )  # fmt: skip
        self._append_conf(
            self.standby_dir,
            [
                f"port = {self.standby_port}",
                "hot_standby = on",
                # The startup process may sleep this long before it notices a
                # promotion request that came while it waited for WAL (5 s by
                # default): the measured outage would be that sleep.
                "wal_retrieve_retry_interval = '100ms'",
                f"primary_conninfo = 'host=127.0.0.1 port={self.link.port} user=postgres application_name=standby'",
            ],
        )
        self._pg_ctl_start(self.standby_dir)
        if self.synchronous:
            # Only on the primary, after the copy: a promoted standby that
            # still named a synchronous standby would wait for one forever.
            self.sql(
                self.primary_port,
                "ALTER SYSTEM SET synchronous_standby_names = '*'",
                f"ALTER SYSTEM SET synchronous_commit = '{synchronous_commit}'",
                "SELECT pg_reload_conf()",
            )
        self.wait_streaming()

    def sql(self, port: int, *statements: str) -> list[tuple[object, ...]]:
        """Run statements on one server in autocommit; the last one's rows."""
        import psycopg

        rows: list[tuple[object, ...]] = []
        with psycopg.connect(self.url(port), autocommit=True, connect_timeout=5) as conn:
            for statement in statements:
                cur = conn.execute(statement)
                rows = cur.fetchall() if cur.description else []
        return rows

    def wait_streaming(self, timeout_s: float = 30) -> None:
        want = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + timeout_s
        while True:
            rows = self.sql(self.primary_port, "SELECT state, sync_state FROM pg_stat_replication")
            if rows and rows[0] == ("streaming", want):
                return
            if time.monotonic() > deadline:
                raise PairError(f"the standby is not streaming ({want}) after {timeout_s:g} s: {rows}")
            time.sleep(0.1)

    def wait_caught_up(self, timeout_s: float = 30) -> None:
        """Until the standby has replayed everything the primary has written so far."""
        lsn = self.sql(self.primary_port, "SELECT pg_current_wal_lsn()::text")[0][0]
        deadline = time.monotonic() + timeout_s
        replayed = "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn" % repr(lsn)
        while self.sql(self.standby_port, replayed) != [(True,)]:
            if time.monotonic() > deadline:
                raise PairError(f"the standby has not replayed up to {lsn} after {timeout_s:g} s")
            time.sleep(0.02)

    # -- what a test does ------------------------------------------------------------------
    def url(self, port: int | None = None, *, dbname: str = "postgres", query: str = "") -> str:
        """One server's URL, or (no port) both hosts with target_session_attrs=read-write."""
        if port is not None:
            return f"postgresql://postgres@127.0.0.1:{port}/{dbname}" + (f"?{query}" if query else "")
        hosts = f"127.0.0.1:{self.primary_port},127.0.0.1:{self.standby_port}"
        params = "target_session_attrs=read-write" + (f"&{query}" if query else "")
        return f"postgresql://postgres@{hosts}/{dbname}?{params}"

    def stall_replication(self) -> None:
        """From now on the standby receives nothing more from the primary."""
        self.link.stall()

    def kill_primary(self) -> None:
        """The primary's processes go at once, without a checkpoint, as in a crash."""
        self._run("pg_ctl", "-D", str(self.primary_dir), "-m", "immediate", "-w", "stop")
        self.link.sever()

    def stop_standby(self) -> None:
        """The standby's processes go at once: a synchronous primary's commits
        wait for it from now on (the primary keeps running)."""
        self._run("pg_ctl", "-D", str(self.standby_dir), "-m", "immediate", "-w", "stop")

    def start_standby(self) -> None:
        """Start the stopped standby again; returns once it streams again
        (as a synchronous standby on a synchronous pair)."""
        log = str(self.standby_dir.with_suffix(".log"))
        self._run("pg_ctl", "-D", str(self.standby_dir), "-l", log, "-w", "-t", "60", "start")
        self.wait_streaming()

    def standby_running(self) -> bool:
        return (self.standby_dir / "postmaster.pid").exists()

    def promote_standby(self) -> None:
        self._run("pg_ctl", "-D", str(self.standby_dir), "-w", "-t", "60", "promote")

    def stop(self) -> None:
        self.link.sever()
        for datadir in reversed(self.started):
            if (datadir / "postmaster.pid").exists():
                with contextlib.suppress(Exception):
                    self._run("pg_ctl", "-D", str(datadir), "-m", "immediate", "-w", "-t", "30", "stop", timeout=40)
        self.started.clear()
        shutil.rmtree(self.root, ignore_errors=True)
