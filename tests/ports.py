"""Free loopback ports for the servers the tests start (PgBouncer, Galera
nodes, Prometheus, uvicorn), safe while pytest-xdist runs several workers.

Asking the kernel for port 0 and closing the socket hands the port back:
another worker asking a moment later may be given the same one before the
first worker's server has bound it. Here each worker picks from its own
slice of ports, so two workers never hand out the same port, and a process
hands out every port of its slice once before any again (a server that has
not bound its port yet is not given away twice). The slices lie below the kernel's ephemeral range
(32768 and up by default), where the kernel never puts the client end of a
connection or a port-0 bind of its own. Each port is still checked with a
bind before it is handed out (another program may hold it), and the walk
starts at a random place in the slice so that two test runs on one machine
rarely try the same ports first.
"""

from __future__ import annotations

import os
import random
import socket
import threading

# Ports FIRST .. FIRST + SLICE * SLICES - 1, one slice per worker (gw0, gw1, ...).
FIRST = 20000
SLICE = 1000
SLICES = 12

_lock = threading.Lock()
_handed_out: set[int] = set()


def worker_index() -> int:
    """This process's pytest-xdist worker number (gw3 -> 3); 0 without xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    digits = name.removeprefix("gw")
    return int(digits) if digits.isdigit() else 0


def bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports that nothing listens on and that no other
    worker of this run is given, nor (until the slice is used up) an earlier
    call in this process."""
    start = FIRST + (worker_index() % SLICES) * SLICE
    offset = random.randrange(SLICE)
    ports: list[int] = []
    with _lock:
        for attempt in range(2):
            if attempt:
                # The whole slice has been handed out once: the servers given
                # the first of them have long bound them (or are gone), and
                # the bind check skips whatever is still held.
                _handed_out.difference_update(range(start, start + SLICE))
            for step in range(SLICE):
                port = start + (offset + step) % SLICE
                if port in _handed_out or port in ports or not bindable(port):
                    continue
                ports.append(port)
                if len(ports) == n:
                    _handed_out.update(ports)
                    return ports
    raise RuntimeError(f"no {n} free loopback ports left in {start}-{start + SLICE - 1}")


def free_port() -> int:
    """One port, as `free_ports`."""
    (port,) = free_ports(1)
    return port
