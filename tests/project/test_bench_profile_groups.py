"""The benchmark's profiles group time by the package a function lives in,
found by each package's own folder: a checkout (or a parent folder) named
idemctl or redis must not pull the bench, or every file, into that group."""

from __future__ import annotations

import os

import idemctl
from bench.common import package_roots
from bench.inflight import PACKAGES, _group
from bench.redis_peers import PROFILE_GROUPS

# A checkout in a folder named idemctl, inside one named redis, beside a venv.
ROOTS = [
    ("/srv/redis/idemctl/idemctl/storage/", "idemctl's store"),
    ("/srv/redis/idemctl/idemctl/", "idemctl"),
    ("/srv/redis/idemctl/bench/", "the bench's caller and app"),
    ("/srv/redis/idemctl/.venv/lib/python3.11/site-packages/redis/", "redis-py"),
    ("/usr/lib/python3.11/asyncio/", "asyncio"),
]


def test_a_checkout_folder_named_idemctl_inside_one_named_redis_groups_each_file_by_its_own_package() -> None:
    checkout = "/srv/redis/idemctl/"
    assert _group(checkout + "bench/peers_systems.py", "call_asgi", ROOTS) == "the bench's caller and app"
    assert _group(checkout + "idemctl/asgi.py", "__call__", ROOTS) == "idemctl"
    assert _group(checkout + "idemctl/storage/redis/aio.py", "run", ROOTS) == "idemctl's store"
    assert _group(checkout + ".venv/lib/python3.11/site-packages/redis/client.py", "execute", ROOTS) == "redis-py"
    assert _group(checkout + ".venv/lib/python3.11/site-packages/anyio/_core.py", "run", ROOTS) == "other Python"
    assert _group("/usr/lib/python3.11/asyncio/events.py", "_run", ROOTS) == "asyncio"
    assert _group("~", "<method 'poll' of 'select.epoll' objects>", ROOTS) == "waiting for the server (epoll)"
    assert _group("~", "<built-in method _hashlib.openssl_sha256>", ROOTS) == "C calls and the rest"


def test_the_packages_are_found_in_their_installed_folders_the_deepest_first() -> None:
    roots = package_roots([*PROFILE_GROUPS, *PACKAGES])
    ours = os.path.join(os.path.dirname(os.path.abspath(idemctl.__file__)), "")
    found = dict(roots)
    assert found[ours] == "idemctl"
    assert found[os.path.join(ours, "storage", "")] == "idemctl's store"
    assert [root for root, _ in roots].index(os.path.join(ours, "storage", "")) < [root for root, _ in roots].index(
        ours
    )
    assert "asyncio" in found.values() and "the bench's caller and app" in found.values()
    # A package that is not installed is left out, not an error.
    assert package_roots([("no_such_package_here", "nothing")]) == []
