"""Every CLI command on a Redis Cluster of three primaries (the session's,
tests/conftest.py): `init`, `inspect`, `pending` (and `--stale`), `fenced`,
`stats`, `sweep` (batched, and `--dry-run`), `purge`, `copy` both ways with a
SQLite ledger, and `doctor`. The rows are put in buckets whose hash slots
sit on different primaries, so a listing, a count, a sweep or a copy that
missed a node would miss rows. The same commands on one server run in
test_cli_commands.py and test_cli_sweep.py."""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from idemctl import Ledger
from idemctl.storage.redis.keys import Layout
from tests import redis_servers

from .test_cli_commands import FP, HOUR, JSON_HEADERS, MINUTE, SECOND, at, cli, one_line, taken_over_row

# One worker: the module's tests share that worker's cluster rather than start one each.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_cli_on_redis_cluster")]

redis = pytest.importorskip("redis")

__all__ = ["at"]  # the fixture, shared with test_cli_commands.py

TERMINAL_COLUMNS = "200"
PREFIX = "idemctl"  # the layout of a URL without ?prefix=


@pytest.fixture
def cluster(redis_cluster: redis_servers.Cluster) -> redis_servers.Cluster:
    redis_cluster.flush()
    return redis_cluster


@pytest.fixture
def ledger(cluster: redis_servers.Cluster, clock) -> Iterator[Ledger]:
    opened = Ledger.open(cluster.url, clock=clock)
    opened.init()
    yield opened
    opened.close()


def primary_of(cluster: redis_servers.Cluster, principal: str, *keys: str) -> list[int]:
    """The ports of the primaries that hold the rows of (principal, key) for each key."""
    from redis.cluster import RedisCluster

    client = RedisCluster.from_url(cluster.url)
    try:
        return [int(client.get_node_from_key(Layout(PREFIX).where(principal, k)[2][0]).port) for k in keys]
    finally:
        client.close()


def keys_on_every_primary(cluster: redis_servers.Cluster, principal: str, stem: str, per_primary: int) -> list[str]:
    """`per_primary` keys `stem-N` whose rows live on each primary, in the order of N."""
    candidates = [f"{stem}-{n}" for n in range(64 * per_primary)]
    chosen: dict[int, list[str]] = {server.port: [] for server in cluster.primaries()}
    for key, port in zip(candidates, primary_of(cluster, principal, *candidates)):
        if len(chosen[port]) < per_primary:
            chosen[port].append(key)
    assert all(len(keys) == per_primary for keys in chosen.values()), chosen
    return sorted((k for keys in chosen.values() for k in keys), key=lambda k: int(k.rsplit("-", 1)[1]))


def test_init_then_inspect_pending_fenced_and_stats_see_rows_on_every_primary(cluster, ledger, at):
    fresh_url = cluster.url
    cluster.flush()
    created = cli("init", "--db", fresh_url)
    assert (created.exit_code, created.stdout, created.stderr) == (
        0,
        f"{fresh_url}: created (schema version 3)\n",
        "",
    )
    again = cli("init", "--db", fresh_url)
    assert (again.exit_code, again.stdout) == (0, f"{fresh_url}: already up to date (schema version 3)\n")

    pending = keys_on_every_primary(cluster, "acct_A", "pending", 1)
    fenced = keys_on_every_primary(cluster, "acct_B", "fenced", 1)
    assert len(set(primary_of(cluster, "acct_A", *pending))) == 3
    # Oldest first: 2 h, 1 h (both past the TTL), then 5 s (still running).
    for key, age in zip(pending, (2 * HOUR, HOUR, 5 * SECOND)):
        at(age)
        ledger.claim("acct_A", key, FP)
    for i, key in enumerate(fenced):
        taken_over_row(ledger, at, "acct_B", key, ago_ms=(3 - i) * 10 * MINUTE)

    listed = cli("pending", "--db", cluster.url)
    assert listed.exit_code == 0 and listed.stderr == ""
    rows = [line.split()[:3] for line in listed.stdout.splitlines() if line.startswith("acct_")]
    assert rows == [["acct_A", key, "1"] for key in pending]
    assert listed.stdout.splitlines()[-1] == "3 pending row(s), oldest first; TTL 30 s"
    stale = json.loads(cli("pending", "--stale", "--json", "--db", cluster.url).stdout)
    assert [(r["key"], r["takes_over_now"]) for r in stale["rows"]] == [(pending[0], True), (pending[1], True)]

    shown = cli("inspect", fenced[0], "--principal", "acct_B", "--db", cluster.url)
    assert shown.exit_code == 0 and shown.stderr == ""
    assert shown.stdout.splitlines()[0] == f"acct_B / {fenced[0]}"
    assert re.search(r"^generation\s+2 \(taken over once\)$", shown.stdout, re.M)
    assert "fenced-out events (1): a late owner's answer was not stored" in shown.stdout
    missing = cli("inspect", "ghost", "--principal", "acct_B", "--json", "--db", cluster.url)
    assert missing.exit_code == 1 and json.loads(missing.stdout)["found"] is False

    events = json.loads(cli("fenced", "--json", "--db", cluster.url).stdout)
    assert [e["key"] for e in events["events"]] == fenced[::-1]  # newest first
    assert {(e["superseded_generation"], e["current_generation"]) for e in events["events"]} == {(1, 2)}

    stats = json.loads(cli("stats", "--json", "--db", cluster.url).stdout)
    assert {
        k: stats[k] for k in ("total", "pending_fresh", "pending_stale", "completed", "taken_over", "fenced_out_events")
    } == {"total": 6, "pending_fresh": 1, "pending_stale": 2, "completed": 3, "taken_over": 3, "fenced_out_events": 3}


def test_sweep_dry_run_then_batches_drain_every_primary_and_purge_needs_force_for_a_fresh_row(cluster, ledger, at):
    old = keys_on_every_primary(cluster, "acct_A", "old", 3)
    at(30 * HOUR)
    for key in old:
        ledger.complete(ledger.claim("acct_A", key, FP), 201, JSON_HEADERS, b"{}")
    at(MINUTE)
    ledger.complete(ledger.claim("acct_A", "kept", FP), 201, JSON_HEADERS, b"{}")
    at(2 * SECOND)
    ledger.claim("acct_A", "running", FP)

    dry = json.loads(cli("sweep", "--dry-run", "--json", "--db", cluster.url).stdout)
    assert (dry["dry_run"], dry["would_delete"], dry["would_delete_fenced"]) == (True, 9, 0)
    assert ledger.operator.stats().total == 11

    swept = cli("sweep", "--batch-size", "4", "--json", "--db", cluster.url)
    assert swept.exit_code == 0 and swept.stderr == ""
    doc = json.loads(swept.stdout)
    # 9 rows in batches of 4: 4, 4, 1, then an empty batch (as on one server).
    assert (doc["deleted"], doc["batches"], doc["stopped"], doc["remaining"]) == (9, 4, "drained", 0)
    assert [ledger.lookup("acct_A", key) for key in old] == [None] * 9
    assert ledger.operator.stats().total == 2

    refused = cli("purge", "running", "-p", "acct_A", "--yes", "--db", cluster.url)
    assert refused.exit_code == 1 and one_line(refused).startswith("refused: acct_A/running is pending")
    forced = cli("purge", "running", "-p", "acct_A", "--yes", "--force", "--db", cluster.url)
    assert forced.exit_code == 0 and ledger.lookup("acct_A", "running") is None
    purged = cli("purge", "kept", "-p", "acct_A", "--yes", "--db", cluster.url)
    assert purged.stdout.splitlines()[-1] == (
        "purged acct_A/kept (completed, generation 1): the client's next retry runs the mutation again"
    )
    assert ledger.operator.stats().total == 0


def _rows(ledger: Ledger, principal: str, keys: list[str]) -> list[tuple[object, ...]]:
    out = []
    for key in keys:
        view = ledger.operator.get(principal, key)
        assert view is not None, key
        row = view.row
        out.append((key, row.status, row.generation, row.fingerprint, row.response_status, row.body_bytes))
    return out


def test_copy_from_the_cluster_to_sqlite_and_back_keeps_every_row_and_fenced_event(cluster, ledger, at, tmp_path: Path):
    done = keys_on_every_primary(cluster, "acct_A", "done", 2)
    for i, key in enumerate(done):
        at(HOUR - i * SECOND)
        ledger.complete(ledger.claim("acct_A", key, FP), 201, JSON_HEADERS, b'{"n":%d}' % i)
    taken_over_row(ledger, at, "acct_B", "late", ago_ms=HOUR)
    at(SECOND)
    ledger.claim("acct_A", "running", FP)
    before = _rows(ledger, "acct_A", [*done, "running"]) + _rows(ledger, "acct_B", ["late"])
    assert len(set(primary_of(cluster, "acct_A", *done))) == 3

    local = str(tmp_path / "copy.db")
    out = cli("copy", "--db", cluster.url, "--to", local, "--init", "--json")
    assert out.exit_code == 0, out.stderr
    doc = json.loads(out.stdout)
    assert (doc["copied"], doc["fenced_copied"]) == (8, 1)
    with sqlite3.connect(local) as conn:
        assert conn.execute("SELECT count(*) FROM idempotency_keys").fetchone() == (8,)
    with Ledger.open(local) as copy:
        assert _rows(copy, "acct_A", [*done, "running"]) + _rows(copy, "acct_B", ["late"]) == before

    cluster.flush()
    back = cli("copy", "--db", local, "--to", cluster.url, "--init", "--json")
    assert back.exit_code == 0, back.stderr
    assert (json.loads(back.stdout)["copied"], json.loads(back.stdout)["fenced_copied"]) == (8, 1)
    assert _rows(ledger, "acct_A", [*done, "running"]) + _rows(ledger, "acct_B", ["late"]) == before
    assert [e.key for e in ledger.operator.fenced()] == ["late"]
    listed = json.loads(cli("pending", "--json", "--db", cluster.url).stdout)
    assert [r["key"] for r in listed["rows"]] == ["running"]


def test_doctor_on_a_cluster_checks_each_primary_and_the_slot_coverage(cluster):
    assert cli("init", "--db", cluster.url).exit_code == 0
    result = cli("doctor", "--db", cluster.url)
    assert result.exit_code == 1 and result.stderr == ""  # warnings: no AOF, asynchronous replicas
    lines = result.stdout.splitlines()
    assert re.fullmatch(re.escape(cluster.url) + r" \(Redis \d+\.\d+\.\d+ \(cluster of 3 primaries\)\)", lines[0]), (
        lines[0]
    )
    warned = {
        int(m.group(1)) for m in (re.match(r"warning: 127\.0\.0\.1:(\d+): appendonly is no", x) for x in lines) if m
    }
    assert warned == {server.port for server in cluster.primaries()}
    assert lines[-1] == "ok: cluster_state ok, all 16384 slots served"
