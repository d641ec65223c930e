"""The SQLite writer queue: every write statement waits its turn on an flock of
`<db>-idemctl.lock`, in the kernel, instead of in SQLite's polling busy
handler. Proven with real processes and threads on a real database file."""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing as mp
import os
import sqlite3
import threading

import pytest

from idemctl import Ledger, Outcome
from idemctl.errors import DatabaseLockedError
from tests.helpers import descriptors_of

fork = mp.get_context("fork")


def ok(body: bytes):
    return 201, {"content-type": "text/plain"}, b"made"


def _hold_queue(lock_path: str, held, release) -> None:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    held.set()
    release.wait(30)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


@contextlib.contextmanager
def queue_held_by_another_process(db: str):
    """A forked process holds `db`'s writer queue from entry until the
    yielded event is set (or the block ends)."""
    held, release = fork.Event(), fork.Event()
    holder = fork.Process(target=_hold_queue, args=(db + "-idemctl.lock", held, release))
    holder.start()
    try:
        assert held.wait(10)
        yield release
    finally:
        release.set()
        holder.join(10)


def _queue_is_free(lock_path: str) -> bool:
    fd = os.open(lock_path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    finally:
        os.close(fd)


def test_a_request_waits_for_the_queue_held_by_another_process_while_reads_do_not(db):
    ledger = Ledger.open(db)
    ledger.handle("acct", "done", "POST", "/o", {}, b"x", ok)
    with queue_held_by_another_process(db) as release:
        result: list[Outcome] = []
        writer = threading.Thread(
            target=lambda: result.append(ledger.handle("acct", "k1", "POST", "/o", {}, b"x", ok).outcome)
        )
        writer.start()
        writer.join(0.3)
        assert writer.is_alive() and result == []  # queued behind the other process
        # Reads never wait in the queue. (A replay does: its first step is
        # the claim, a write attempt that takes SQLite's write lock too.)
        assert ledger.operator.get("acct", "done").row.response_body == "made"
        assert ledger.lookup("acct", "k1") is None and ledger.operator.stats().total == 1
        release.set()
        writer.join(10)
        assert result == [Outcome.EXECUTED]
    assert ledger.lookup("acct", "k1").response_body == "made"
    assert _queue_is_free(db + "-idemctl.lock")
    ledger.close()


def test_the_queue_is_released_when_the_statement_fails(db):
    blocker = sqlite3.connect(db, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # a foreign writer that does not queue
    ledger = Ledger.open(db, busy_timeout_ms=50)
    calls: list[bytes] = []
    with pytest.raises(DatabaseLockedError):
        ledger.handle("acct", "k", "POST", "/o", {}, b"x", lambda b: (calls.append(b), ok(b))[1])
    assert calls == []
    assert _queue_is_free(db + "-idemctl.lock")
    blocker.execute("ROLLBACK")
    blocker.close()
    assert ledger.handle("acct", "k", "POST", "/o", {}, b"x", ok).outcome is Outcome.EXECUTED
    ledger.close()


def test_time_spent_queueing_is_taken_from_the_busy_timeout_and_then_restored(db):
    blocker = sqlite3.connect(db, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    ledger = Ledger.open(db, busy_timeout_ms=200)
    statements: list[str] = []
    try:
        with queue_held_by_another_process(db) as release:
            # Traced from here on: forking the holder closed the connections opened before.
            ledger.store.engine.admin().conn.set_trace_callback(statements.append)
            threading.Timer(0.35, release.set).start()
            with pytest.raises(DatabaseLockedError):
                ledger.claim("acct", "k", "fp")
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    pragmas = [s for s in statements if s.startswith("PRAGMA busy_timeout")]
    # Queued for >= 350 ms of a 200 ms budget: SQLite gets nothing more, so a
    # queue stuck behind a foreign writer fails within one busy timeout.
    assert pragmas == ["PRAGMA busy_timeout = 0", "PRAGMA busy_timeout = 200"]
    assert ledger.store.engine.read("PRAGMA busy_timeout", {}) == [(200,)]
    ledger.close()


def test_threads_of_one_process_take_turns_in_the_queue(db):
    ledger = Ledger.open(db)
    ledger.claim("acct", "warm", "fp")  # opens this thread's queue descriptor
    (fd,) = descriptors_of(db + "-idemctl.lock")  # the only thread that wrote so far
    fcntl.flock(fd, fcntl.LOCK_EX)  # as if this thread were mid-statement
    done = threading.Event()
    other = threading.Thread(target=lambda: (ledger.claim("acct", "t2", "fp"), done.set()))
    other.start()
    try:
        assert not done.wait(0.3)
        assert ledger.lookup("acct", "t2") is None
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
    other.join(10)
    assert done.is_set() and ledger.lookup("acct", "t2").generation == 1
    ledger.close()


def test_reads_and_opted_out_ledgers_never_create_the_lock_file(tmp_path):
    path = str(tmp_path / "ledger.db")
    Ledger.open(path, write_queue=False).init()
    opted_out = Ledger.open(path, write_queue=False)
    assert opted_out.handle("acct", "k", "POST", "/o", {}, b"x", ok).outcome is Outcome.EXECUTED
    assert opted_out.operator.sweep().keys_deleted == 0
    reader = Ledger.open(path)
    assert reader.operator.stats().total == 1 and reader.operator.get("acct", "k") is not None
    assert sorted(os.listdir(tmp_path)) == ["ledger.db", "ledger.db-shm", "ledger.db-wal"]
    reader.handle("acct", "k2", "POST", "/o", {}, b"x", ok)
    assert os.path.exists(path + "-idemctl.lock")
    for ledger in (opted_out, reader):
        ledger.close()


def _claim_many(path: str, worker: int, count: int, start, out) -> None:
    ledger = Ledger.open(path, synchronous="NORMAL")
    start.wait(10)
    won = sum(ledger.claim("acct", f"k{i}", "fp") is not None for i in range(count))
    ledger.close()
    out.put((worker, won))


def test_processes_queueing_on_one_file_claim_each_key_exactly_once(db):
    start, out = fork.Event(), fork.Queue()
    procs = [fork.Process(target=_claim_many, args=(db, w, 150, start, out)) for w in range(4)]
    for p in procs:
        p.start()
    start.set()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(10)
    assert sum(results.values()) == 150
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    with Ledger.open(db) as ledger:
        assert ledger.operator.stats().total == 150


def test_a_sweep_with_nothing_expired_takes_no_queue_turn_and_runs_no_delete(db):
    from idemctl import Policy

    clock = [1_700_000_000_000]
    ledger = Ledger.open(db, clock=lambda: clock[0], policy=Policy(pending_ttl_ms=1000, retention_ms=60_000))
    ledger.handle("acct", "old", "POST", "/o", {}, b"x", ok)
    statements: list[str] = []
    with queue_held_by_another_process(db) as release:
        # Traced from here on: forking the holder closed the connections opened before.
        ledger.store.engine.admin().conn.set_trace_callback(statements.append)
        # Nothing is past retention: answered at once although the queue is held.
        assert ledger.operator.sweep().keys_deleted == 0
        assert not any(s.lstrip().startswith("DELETE") for s in statements)
        clock[0] += 60_001
        result = []
        sweeper = threading.Thread(target=lambda: result.append(ledger.operator.sweep().keys_deleted))
        sweeper.start()
        sweeper.join(0.3)
        assert sweeper.is_alive() and result == []  # something to delete: it queues
        release.set()
        sweeper.join(10)
        assert result == [1]
    assert ledger.lookup("acct", "old") is None
    ledger.close()


def test_a_short_turn_in_the_queue_leaves_the_busy_timeout_alone(db):
    ledger = Ledger.open(db, busy_timeout_ms=5000)
    statements: list[str] = []
    with queue_held_by_another_process(db) as release:
        # Traced from here on: forking the holder closed the connections opened before.
        ledger.store.engine.admin().conn.set_trace_callback(statements.append)
        threading.Timer(0.05, release.set).start()
        assert ledger.claim("acct", "k", "fp").generation == 1  # waited ~50 ms of a 5 s budget
    assert [s for s in statements if s.startswith("PRAGMA")] == []
    assert ledger.store.engine.read("PRAGMA busy_timeout", {}) == [(5000,)]
    ledger.close()
