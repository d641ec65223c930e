"""Redis servers the suite starts for itself: one standalone server and one
Redis Cluster of three primaries with a replica each, on free loopback ports
in a temporary directory, stopped afterwards (never the machine's own Redis
on 6379). Debian's redis-server package provides `redis-server` and
`redis-cli`; .ci/run installs it when missing."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from tests import ports


def missing() -> str | None:
    """Why Redis servers cannot be started here, or None."""
    for binary in ("redis-server", "redis-cli"):
        if shutil.which(binary) is None:
            return f"{binary} is not installed (Debian package redis-server)"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "the Redis engine's tests need redis-py: pip install -e '.[redis]'"
    return None


def free_port(*, bus: bool = False) -> int:
    """A free loopback port of this worker's slice (tests/ports.py), and
    its cluster bus port, 10000 above, free too when `bus`."""
    while True:
        port = ports.free_port()
        if not bus or ports.bindable(port + 10000):
            return port


class RedisServer:
    """One redis-server process in `folder` on `port`."""

    def __init__(self, folder: Path, port: int, *extra: str) -> None:
        self.folder, self.port = folder, port
        folder.mkdir(parents=True, exist_ok=True)
        args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder)]
        args += ["--save", "", "--appendonly", "no", "--protected-mode", "no", *extra]
        self.process = subprocess.Popen(
            args, stdout=(folder / "log").open("wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cli(self, *args: str) -> str:
        done = subprocess.run(
            ["redis-cli", "-h", "127.0.0.1", "-p", str(self.port), *args],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        return done.stdout.strip()

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server on {self.port} exited: {(self.folder / 'log').read_text()[-500:]}")
            if self.cli("ping") in ("PONG", "NOAUTH Authentication required."):  # answering: ready
                return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on {self.port} did not answer in {timeout_s} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    def kill(self) -> None:
        """Stop it at once, as a crash would (SIGKILL)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)


class Standalone:
    """One standalone server."""

    def __init__(self, *extra: str) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="idemctl-redis-"))
        self.server = RedisServer(self.folder, free_port(), *extra)

    def start(self) -> Standalone:
        self.server.wait_ready()
        return self

    @property
    def url(self) -> str:
        return self.server.url

    def flush(self) -> None:
        self.server.cli("flushall")

    def stop(self) -> None:
        self.server.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


class Cluster:
    """Three primaries and three replicas (redis-cli --cluster create
    --cluster-replicas 1)."""

    def __init__(self, nodes: int = 6) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="idemctl-redis-cluster-"))
        self.servers: list[RedisServer] = []
        ports: list[int] = []
        while len(ports) < nodes:
            port = free_port(bus=True)
            if port not in ports:
                ports.append(port)
        for port in ports:
            self.servers.append(
                RedisServer(
                    self.folder / str(port),
                    port,
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                )
            )

    def start(self) -> Cluster:
        for server in self.servers:
            server.wait_ready()
        nodes = [f"127.0.0.1:{s.port}" for s in self.servers]
        done = subprocess.run(
            ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "1", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-800:]} {done.stderr[-400:]}")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in s.cli("cluster", "info") for s in self.servers) and self._replicas_synced():
                return self
            time.sleep(0.1)
        raise RuntimeError("the Redis Cluster did not reach cluster_state:ok in 30 s")

    def _replicas_synced(self) -> bool:
        roles = [s.cli("info", "replication") for s in self.servers]
        replicas = [r for r in roles if "role:slave" in r]
        return len(replicas) == len(self.servers) // 2 and all("master_link_status:up" in r for r in replicas)

    @property
    def url(self) -> str:
        """A URL naming one node (a primary); the engine finds the rest."""
        return self.servers[0].url

    def primaries(self) -> list[RedisServer]:
        return [s for s in self.servers if "role:master" in s.cli("info", "replication")]

    def replicas(self) -> list[RedisServer]:
        return [s for s in self.servers if "role:slave" in s.cli("info", "replication")]

    def flush(self) -> None:
        for server in self.primaries():
            server.cli("flushall")

    def stop(self) -> None:
        for server in self.servers:
            with contextlib.suppress(Exception):
                server.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


class WithSentinel:
    """A primary, its replica and one Sentinel watching them (quorum 1)."""

    SERVICE = "ledger"

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="idemctl-redis-sentinel-"))
        self.primary = RedisServer(self.folder / "primary", free_port())
        self.replica = RedisServer(
            self.folder / "replica", free_port(), "--replicaof", "127.0.0.1", str(self.primary.port)
        )
        self.sentinel_port = free_port()
        conf = self.folder / "sentinel.conf"
        conf.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {self.folder}\n"
            f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.primary.port} 1\n"
            f"sentinel down-after-milliseconds {self.SERVICE} 1000\n"
            f"sentinel failover-timeout {self.SERVICE} 5000\n"
        )
        log = (self.folder / "sentinel.log").open("wb")
        self.sentinel = subprocess.Popen(
            ["redis-server", str(conf), "--sentinel"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )

    def start(self) -> WithSentinel:
        self.primary.wait_ready()
        self.replica.wait_ready()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if "master_link_status:up" in self.replica.cli("info", "replication"):
                return self
            time.sleep(0.1)
        raise RuntimeError("the replica did not catch up with its primary in 20 s")

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{self.SERVICE}"

    def stop(self) -> None:
        if self.sentinel.poll() is None:
            self.sentinel.terminate()
            self.sentinel.wait(10)
        for server in (self.primary, self.replica):
            with contextlib.suppress(Exception):
                server.stop()
        shutil.rmtree(self.folder, ignore_errors=True)
