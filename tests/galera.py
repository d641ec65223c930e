"""A three-node MariaDB Galera cluster on this machine, for the tests that
need one: Debian's mariadbd and galera-4, each node on free ports (SQL,
group communication, IST, SST) with a data directory and a cnf file of its
own in one temporary directory, so the machine's MariaDB configuration is
never read (``--defaults-file``) nor touched. The first node bootstraps
(``--wsrep-new-cluster``), the others join by rsync SST one after the
other; `start` returns once all three are Synced in a Primary component of
three. `stop` kills every process and removes the directory.

Each node runs with ``innodb_flush_log_at_trx_commit=2``: an acknowledged
commit is in the other nodes' memory before the client hears of it, which
is what the tests ask of it, and two cores are spared an fsync a commit."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.ports import free_ports

MARIADBD = "/usr/sbin/mariadbd"
GALERA = "/usr/lib/galera/libgalera_smm.so"
INSTALL_DB = "mariadb-install-db"
NODES = 3
# The nodes run as `mysql` (mariadbd drops to it when started by root): an
# rsync SST daemon started by root would write as `nobody` and fail.
RUN_AS = "mysql"
START_TIMEOUT_S = 90.0


def missing() -> str | None:
    """Why no cluster can start here, or None."""
    for path in (MARIADBD, GALERA):
        if not os.path.exists(path):
            return f"{path} is missing (apt-get install galera-4 mariadb-server)"
    for tool in (INSTALL_DB, "rsync", "wsrep_sst_rsync"):
        if shutil.which(tool) is None:
            return f"{tool} is missing (apt-get install galera-4 mariadb-server rsync)"
    return None


@dataclass
class Node:
    index: int
    root: Path
    port: int
    gmcast_port: int
    ist_port: int
    sst_port: int
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def datadir(self) -> Path:
        return self.root / "data"

    @property
    def cnf(self) -> Path:
        return self.root / "my.cnf"

    @property
    def log(self) -> Path:
        return self.root / "error.log"

    def url(self, database: str, query: str = "") -> str:
        return f"mysql://root@127.0.0.1:{self.port}/{database}" + (f"?{query}" if query else "")

    def connect(self, database: str | None = None, **kwargs: Any) -> Any:
        import pymysql

        return pymysql.connect(
            host="127.0.0.1",
            port=self.port,
            user="root",
            database=database,
            autocommit=True,
            connect_timeout=5,
            **kwargs,
        )

    def status(self, name: str) -> str | None:
        """One wsrep status variable, or None while the node does not answer."""
        import pymysql

        try:
            with contextlib.closing(self.connect()) as conn, conn.cursor() as cur:
                cur.execute("SHOW GLOBAL STATUS LIKE %s", (name,))
                row = cur.fetchone()
        except pymysql.MySQLError:
            return None
        return str(row[1]) if row else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: the node dies mid-write, as in a power cut of its host."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class GaleraCluster:
    """Three nodes of one Galera cluster, started by `start` and gone after
    `stop`. ``galera=False``: one plain MariaDB server with the same
    settings otherwise (bench/galera.py's baseline)."""

    def __init__(self, *, galera: bool = True) -> None:
        self.galera = galera
        self.size = NODES if galera else 1
        self.base = Path(tempfile.mkdtemp(prefix="idemctl-galera-"))
        ports = free_ports(4 * self.size)
        self.nodes = [Node(i + 1, self.base / f"node{i + 1}", *ports[4 * i : 4 * i + 4]) for i in range(self.size)]

    # -- setup ------------------------------------------------------------------------
    def _write_cnf(self, node: Node) -> None:
        peers = ",".join(f"127.0.0.1:{n.gmcast_port}" for n in self.nodes)
        provider_options = ";".join(
            [
                f"gmcast.listen_addr=tcp://127.0.0.1:{node.gmcast_port}",
                f"ist.recv_addr=127.0.0.1:{node.ist_port}",
                "gcache.size=32M",
                # A killed peer is declared gone in a few seconds, not 30 (the default
                # suspect/inactive timeouts), so the survivors go on quickly.
                "evs.suspect_timeout=PT3S",
                "evs.inactive_timeout=PT6S",
                "evs.install_timeout=PT5S",
                "pc.wait_prim_timeout=PT30S",
            ]
        )
        node.cnf.write_text(
            "\n".join(
                [
                    "[mysqld]",
                    f"datadir={node.datadir}",
                    f"socket={node.root / 'mysqld.sock'}",
                    f"pid-file={node.root / 'mysqld.pid'}",
                    f"log-error={node.log}",
                    f"port={node.port}",
                    "bind-address=127.0.0.1",
                    f"user={RUN_AS}",
                    "skip-name-resolve=0",
                    "performance_schema=OFF",
                    "innodb_buffer_pool_size=64M",
                    "innodb_log_file_size=16M",
                    "innodb_flush_log_at_trx_commit=2",
                    "binlog_format=ROW",
                    "default_storage_engine=InnoDB",
                    "innodb_autoinc_lock_mode=2",
                    "max_connections=300",
                    *self._wsrep_lines(node, peers, provider_options),
                    "",
                ]
            )
        )

    def _wsrep_lines(self, node: Node, peers: str, provider_options: str) -> list[str]:
        if not self.galera:
            return ["wsrep_on=OFF"]
        return [
            "wsrep_on=ON",
            f"wsrep_provider={GALERA}",
            f"wsrep_cluster_address=gcomm://{peers}",
            "wsrep_cluster_name=idemctl_test",
            f"wsrep_node_name=node{node.index}",
            f"wsrep_node_address=127.0.0.1:{node.gmcast_port}",
            f"wsrep_provider_options={provider_options}",
            "wsrep_sst_method=rsync",
            f"wsrep_sst_receive_address=127.0.0.1:{node.sst_port}",
            "wsrep_slave_threads=2",
        ]

    def _install(self, datadir: Path) -> None:
        done = subprocess.run(
            [
                INSTALL_DB,
                "--no-defaults",
                f"--datadir={datadir}",
                f"--user={RUN_AS}",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
                "--innodb-log-file-size=16M",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=120,
        )
        if done.returncode != 0:
            # Its own words say why (a permission, a missing file), not the exit status alone.
            said = done.stderr.decode(errors="replace").strip()[-2000:] or "(nothing on stderr)"
            raise RuntimeError(f"{INSTALL_DB} exited with {done.returncode} for {datadir}: {said}")

    def _launch(self, node: Node, *extra: str) -> None:
        self._write_cnf(node)
        if os.geteuid() == 0:
            shutil.chown(node.cnf, RUN_AS, RUN_AS)
        node.process = subprocess.Popen(
            [MARIADBD, f"--defaults-file={node.cnf}", *extra],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _wait_synced(self, node: Node, size: int, deadline: float) -> None:
        while time.monotonic() < deadline:
            if not node.alive():
                raise RuntimeError(f"galera node{node.index} exited while starting:\n{node.log_tail()}")
            if not self.galera and node.status("uptime") is not None:
                return
            if node.status("wsrep_local_state_comment") == "Synced" and node.status("wsrep_cluster_size") == str(size):
                return
            time.sleep(0.2)
        raise RuntimeError(f"galera node{node.index} not Synced in a cluster of {size}:\n{node.log_tail()}")

    def _own(self) -> None:
        if os.geteuid() == 0:
            for path in [self.base, *self.base.rglob("*")]:
                shutil.chown(path, RUN_AS, RUN_AS)

    def start(self) -> GaleraCluster:
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            first = self.nodes[0]
            for node in self.nodes:
                node.datadir.mkdir(parents=True)
            self._own()
            self._install(first.datadir)
            self._launch(first, *(["--wsrep-new-cluster"] if self.galera else []))
            self._wait_synced(first, 1, deadline)
            for n, node in enumerate(self.nodes[1:], start=2):
                # A joiner's empty data directory is filled by the donor (rsync SST).
                self._launch(node)
                self._wait_synced(node, n, deadline)
            for node in self.nodes:
                self._wait_synced(node, self.size, deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def heal(self) -> None:
        """Start again any node a test killed, and wait until all three are
        Synced: the killed node rejoins by state transfer."""
        dead = [node for node in self.nodes if not node.alive()]
        if not dead:
            return
        deadline = time.monotonic() + START_TIMEOUT_S
        for node in dead:
            self._launch(node)
        for node in self.nodes:
            self._wait_synced(node, NODES, deadline)

    # -- use ---------------------------------------------------------------------------
    def create_database(self, name: str) -> None:
        """A database on every node: the other nodes apply the CREATE a
        little after node 1 returns, so each is asked with a causal read."""
        with contextlib.closing(self.nodes[0].connect()) as conn, conn.cursor() as cur:
            cur.execute(f"CREATE DATABASE {name} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
        for node in self.nodes[1:]:
            if node.alive():
                with contextlib.closing(node.connect()) as conn, conn.cursor() as cur:
                    cur.execute("SET SESSION wsrep_sync_wait = 1")
                    cur.execute("SELECT count(*) FROM information_schema.schemata WHERE schema_name = %s", (name,))
                    assert cur.fetchone() == (1,), f"node{node.index} lacks database {name}"

    def drop_database(self, name: str) -> None:
        for node in self.nodes:
            if node.alive():
                with contextlib.closing(node.connect()) as conn, conn.cursor() as cur:
                    cur.execute(f"DROP DATABASE IF EXISTS {name}")
                return

    def stop(self) -> None:
        for node in self.nodes:
            if node.process is not None and node.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(node.process.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    node.process.wait(timeout=30)
        # The rsync daemons an SST started outlive it when a node is killed mid-way.
        for pidfile in self.base.rglob("*.pid"):
            with contextlib.suppress(ValueError, OSError):
                pid = int(pidfile.read_text().strip() or "0")
                if pid > 0 and _is_under(pid, self.base):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.base, ignore_errors=True)


def _is_under(pid: int, base: Path) -> bool:
    """Whether the process `pid` runs with its files in `base` (never kill a stranger)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return str(base) in cmdline
