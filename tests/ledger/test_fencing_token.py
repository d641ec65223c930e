"""A reservation's fencing token survives the deletion of its row.

Generations restart at 1 when a deleted row is claimed again, so the
generation alone cannot tell an old owner from a new one: every claim and
takeover draws a token, and complete/release match it too."""

from __future__ import annotations

import os
import sqlite3

import pytest

from idemctl import Ledger, Outcome, Policy, Status, fingerprint
from idemctl.errors import SchemaOutdatedError
from idemctl.outcomes import InitAction
from idemctl.schema import schema_files
from idemctl.storage.statements import new_token

TTL = 30_000
DAY = 86_400_000


@pytest.fixture
def short(make_ledger):
    return make_ledger(policy=Policy(pending_ttl_ms=TTL))


def test_a_superseded_owner_cannot_complete_a_reclaimed_reservation(short, clock):
    # The reproduction from the report, step for step.
    a = short.claim("acct", "k", "fp")  # owner A, generation 1, stalls
    clock.advance(TTL + 1)
    b = short.takeover("acct", "k", "fp")  # owner B, generation 2: A is superseded
    assert short.release(b) is True  # B's mutation rolled back
    c = short.claim("acct", "k", "fp")  # owner C: generation 1 again
    assert (a.generation, c.generation) == (1, 1) and a.token != c.token
    late = short.complete(a, 201, {}, b"A")
    assert late.stored is False
    assert (late.event.superseded_generation, late.event.current_generation) == (1, 1)
    assert short.complete(c, 201, {}, b"C").stored is True
    row = short.lookup("acct", "k")
    assert (row.status, row.generation, row.body_bytes) == (Status.COMPLETED, 1, b"C")


def test_superseded_owner_cannot_release_a_newer_reservation(short, clock):
    a = short.claim("acct", "k", "fp")
    clock.advance(TTL + 1)
    b = short.takeover("acct", "k", "fp")
    short.release(b)
    c = short.claim("acct", "k", "fp")
    assert short.release(a) is False
    row = short.lookup("acct", "k")
    assert (row.status, row.generation) == (Status.PENDING, 1)
    assert short.complete(c, 200, {}, b"C").stored is True


def test_a_late_owner_of_a_purged_key_cannot_answer_a_different_request(short, clock):
    a = short.claim("acct", "k", fingerprint("POST", "/a", [], b"A"))
    clock.advance(TTL + 1)
    assert short.operator.purge("acct", "k").row.generation == 1  # stale: purge allowed
    body_b = b"B"
    b = short.handle("acct", "k", "POST", "/b", {}, body_b, lambda body: (201, {}, b"answer to B"))
    assert (b.outcome, b.body) == (Outcome.EXECUTED, b"answer to B")
    assert short.complete(a, 201, {}, b"answer to A").stored is False
    replay = short.handle("acct", "k", "POST", "/b", {}, body_b, lambda body: pytest.fail("ran again"))
    assert (replay.outcome, replay.body) == (Outcome.REPLAYED, b"answer to B")


def test_release_on_error_chain_never_lets_two_owners_run_at_once(short, clock):
    """A stalls past the TTL and fails, B takes over and fails, C runs; A's
    release must not delete C's live reservation (or D would run too)."""
    events: list[str] = []
    stash: dict[str, object] = {}

    def fails(name: str):
        def run(body: bytes):
            events.append(f"{name} runs")
            if name == "A":
                # While A stalls, B takes over and fails, and C starts.
                clock.advance(TTL + 1)
                with pytest.raises(RuntimeError):
                    short.handle("acct", "k", "POST", "/o", {}, b"x", fails("B"), release_on_error=True)
                c = short.claim("acct", "k", fingerprint("POST", "/o", [], b"x"))
                stash["c"] = c
                events.append("C runs")
            raise RuntimeError(name)

        return run

    with pytest.raises(RuntimeError, match="A"):
        short.handle("acct", "k", "POST", "/o", {}, b"x", fails("A"), release_on_error=True)
    # A's release found C's reservation, not its own: C still owns the key.
    row = short.lookup("acct", "k")
    assert (row.status, row.generation) == (Status.PENDING, 1)
    d = short.handle("acct", "k", "POST", "/o", {}, b"x", lambda body: pytest.fail("D ran while C runs"))
    assert d.outcome is Outcome.IN_PROGRESS
    assert short.complete(stash["c"], 201, {}, b"C").stored is True
    assert events == ["A runs", "B runs", "C runs"]


def test_a_stalled_owner_whose_row_was_swept_cannot_complete_the_next_claim(short, clock):
    a = short.claim("acct", "k", "fp")
    clock.advance(DAY + 1)
    assert short.operator.sweep().keys_deleted == 1
    c = short.claim("acct", "k", "fp")
    late = short.complete(a, 500, {}, b"A")
    assert late.stored is False
    assert short.lookup("acct", "k").status is Status.PENDING
    assert short.complete(c, 201, {}, b"C").stored is True
    assert [e.superseded_generation for e in short.operator.fenced(principal="acct", key="k")] == [1]


def test_each_claim_and_takeover_draws_a_new_token(short, clock):
    tokens = set()
    for i in range(50):
        r = short.claim("acct", f"k{i}", "fp")
        tokens.add(r.token)
        assert 0 < r.token < 2**63
    clock.advance(TTL + 1)
    taken = short.takeover("acct", "k0", "fp")
    tokens.add(taken.token)
    assert len(tokens) == 51


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")
def test_forked_workers_draw_different_tokens_from_their_parent_and_each_other():
    # A pre-fork server (gunicorn) forks its workers from one parent: each
    # must draw its own tokens, not the parent's sequence again.
    drawn = []
    for _ in range(2):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its first tokens, then gone
            os.write(write, ",".join(str(new_token()) for _ in range(3)).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            drawn.append(pipe.read())
        assert os.waitpid(pid, 0)[1] == 0
    parents = ",".join(str(new_token()) for _ in range(3))
    assert len({drawn[0], drawn[1], parents}) == 3
    assert all(0 < int(t) < 2**53 for t in ",".join([*drawn, parents]).split(","))


def _ledger_of_idemctl_0_1(path) -> list[tuple]:
    """A ledger as idemctl 0.1 left it: schema version 1, no token column."""
    conn = sqlite3.connect(path)
    for f in schema_files("sqlite"):
        if f.version <= 1:
            conn.executescript(f.sql)
    conn.execute("INSERT INTO idemctl_schema_version VALUES (1, 1)")
    rows = [
        ("acct", "done", "fp", "completed", 1, 201, "ok", "{}", 1_700_000_000_000, 1_700_000_000_000),
        ("acct", "stuck", "fp", "pending", 3, None, None, None, 1_700_000_000_000, 1_700_000_000_000),
    ]
    conn.executemany("INSERT INTO idempotency_keys VALUES (?,?,?,?,?,?,?,?,?,?)", rows)
    conn.execute(
        "INSERT INTO idemctl_fenced_out (principal, key, superseded_generation, current_generation, computed_status, fenced_at)"
        " VALUES ('acct', 'stuck', 2, 3, 201, 1700000000000)"
    )
    conn.commit()
    conn.close()
    return rows


def test_a_ledger_of_idemctl_0_1_is_read_then_upgraded_without_losing_a_row(tmp_path, clock):
    path = tmp_path / "old.db"
    rows = _ledger_of_idemctl_0_1(path)
    ledger = Ledger.open(path, clock=clock)
    assert ledger.schema_version() == 1
    assert ledger.operator.get("acct", "done").row.body_bytes == b"ok"
    assert [e.superseded_generation for e in ledger.operator.fenced()] == [2]
    with pytest.raises(SchemaOutdatedError):
        ledger.handle("acct", "new", "POST", "/", {}, b"", lambda b: pytest.fail("ran on an old schema"))
    result = ledger.init()
    assert (result.action, result.from_version, result.to_version) == (InitAction.UPGRADED, 1, 3)
    conn = sqlite3.connect(path)
    kept = conn.execute(
        "SELECT principal, key, fingerprint, status, generation, response_status, response_body, response_headers,"
        " created_at, updated_at, token FROM idempotency_keys ORDER BY key"
    ).fetchall()
    conn.close()
    assert kept == [(*row, None) for row in rows]
    # The stuck 0.1 reservation is taken over with a token, then completes.
    clock.now = 1_700_000_000_000 + 60_000
    taken = ledger.takeover("acct", "stuck", "fp")
    assert taken.generation == 4 and ledger.complete(taken, 200, {}, b"done").stored
    ledger.close()
