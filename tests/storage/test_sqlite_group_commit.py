"""SQLite group commit (`Ledger.open(path, group_commit=True)`): concurrent
writes of one process share a transaction and its fsync, and each caller
gets exactly what its statement would have given alone, only once the
commit holding it is done. Proven with real threads, processes and files.

Batches are forced where a test needs one: the test holds the writer queue
(an flock of `<db>-idemctl.lock`, as another process would), the first
writer becomes the leader and waits there with its own statement, and the
statements that arrive meanwhile make up the next batch."""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing as mp
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from idemctl import Ledger, StorageError
from idemctl.errors import DatabaseLockedError
from idemctl.storage.sqlite import SqliteEngine
from idemctl.storage.sqlite import group_commit as group_commit_module

fork = mp.get_context("fork")
PRINCIPAL = "acct"


def ok(body: bytes) -> tuple[int, dict[str, str], bytes]:
    return 201, {"content-type": "text/plain"}, b"made " + body


@pytest.fixture
def open_ledger(db: str) -> Iterator[Callable[..., Ledger]]:
    opened: list[Ledger] = []

    def factory(**kw: Any) -> Ledger:
        ledger = Ledger.open(db, **kw)
        opened.append(ledger)
        return ledger

    yield factory
    for ledger in opened:
        ledger.close()


def engine_of(ledger: Ledger) -> SqliteEngine:
    engine = ledger.store.engine
    assert isinstance(engine, SqliteEngine)
    return engine


def run_threads(n: int, target: Callable[[int], None]) -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def body(i: int) -> None:
        try:
            start.wait(10)
            target(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert errors == []


@contextlib.contextmanager
def writer_queue_held(db: str) -> Iterator[None]:
    """Hold `db`'s writer queue, as another process's writer would."""
    fd = os.open(db + "-idemctl.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def flock_waiters(db: str) -> int:
    """How many descriptors wait to lock `db`'s writer queue (/proc/locks
    lists each blocked flock as `-> FLOCK ...` with the file's inode)."""
    inode = os.stat(db + "-idemctl.lock").st_ino
    with open("/proc/locks") as locks:
        return sum(1 for line in locks if "->" in line and "FLOCK" in line and f":{inode} " in line)


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


class ForcedBatch:
    """Calls started one by one (each queued before the next starts), while
    the writer queue is held: the first leads and commits alone once the
    queue is free, every later one lands in the next batch, in order."""

    def __init__(self, db: str, engine: SqliteEngine) -> None:
        self.db, self.engine = db, engine
        self.results: dict[int, object] = {}
        self.threads: list[threading.Thread] = []

    def queued(self) -> int:
        return self.engine.statements_waiting

    def add(self, call: Callable[[], object]) -> None:
        n = len(self.threads)

        def body() -> None:
            try:
                self.results[n] = call()
            except BaseException as exc:
                self.results[n] = exc

        thread = threading.Thread(target=body)
        thread.start()
        self.threads.append(thread)
        if n == 0:
            wait_until(lambda: flock_waiters(self.db) == 1 and self.queued() == 0, "the leader to take its statement")
        else:
            wait_until(lambda: self.queued() == n, f"call {n} to queue")

    def wait(self) -> list[object]:
        for t in self.threads:
            t.join(30)
        assert not any(t.is_alive() for t in self.threads), "a caller hung"
        return [self.results[i] for i in range(len(self.threads))]


def test_it_is_off_by_default_and_never_batches_a_memory_ledger(db):
    with Ledger.open(db) as plain, Ledger.open(":memory:", group_commit=True) as memory:
        assert engine_of(plain).group_commit is False
        assert engine_of(memory).group_commit is False
    with Ledger.open(db, group_commit=True) as batched:
        assert engine_of(batched).group_commit is True


def test_32_threads_claim_and_complete_distinct_keys_each_exactly_once_in_real_batches(open_ledger):
    ledger = open_ledger(group_commit=True)
    engine = engine_of(ledger)
    per_thread = 25
    outcomes: list[tuple[str, bool, bool]] = []

    def work(i: int) -> None:
        for j in range(per_thread):
            key = f"t{i}-{j}"
            reservation = ledger.claim(PRINCIPAL, key, "fp")
            assert reservation is not None and reservation.generation == 1
            stored = ledger.complete(reservation, 201, {}, key.encode()).stored
            again = ledger.claim(PRINCIPAL, key, "fp")
            outcomes.append((key, stored, again is None))

    run_threads(32, work)
    assert len(outcomes) == 32 * per_thread
    assert all(stored and refused for _, stored, refused in outcomes)
    for key, _, _ in outcomes:
        row = ledger.lookup(PRINCIPAL, key)
        assert row is not None and row.body_bytes == key.encode()
    # 3 statements a pair (the refused claim writes nothing but is one all the same).
    assert engine.statements_committed == 3 * 32 * per_thread
    assert engine.statements_committed / engine.batches_committed > 1


def test_32_threads_claiming_one_key_have_exactly_one_winner(open_ledger):
    ledger = open_ledger(group_commit=True)
    for round_ in range(5):
        winners: list[int] = []

        def claim(i: int, key: str = f"contested-{round_}") -> None:
            reservation = ledger.claim(PRINCIPAL, key, "fp")
            if reservation is not None:
                winners.append(i)
                assert ledger.complete(reservation, 201, {}, str(i).encode()).stored

        run_threads(32, claim)
        assert len(winners) == 1
        row = ledger.lookup(PRINCIPAL, f"contested-{round_}")
        assert row is not None and row.body_bytes == str(winners[0]).encode()


def test_mean_batch_is_above_one_under_16_threads_of_handle(open_ledger):
    ledger = open_ledger(group_commit=True)
    engine = engine_of(ledger)

    def work(i: int) -> None:
        for j in range(40):
            assert ledger.handle(PRINCIPAL, f"h{i}-{j}", "POST", "/o", {}, b"x", ok).outcome.value == "executed"

    run_threads(16, work)
    assert engine.statements_committed == 2 * 16 * 40
    mean = engine.statements_committed / engine.batches_committed
    assert mean > 1.5, f"{engine.batches_committed} commits for {engine.statements_committed} statements"


def test_a_failing_statement_fails_only_its_own_caller_and_its_batch_mates_commit(db, open_ledger):
    ledger = open_ledger(group_commit=True)
    engine = engine_of(ledger)
    store = ledger.store
    batch = ForcedBatch(db, engine)
    with writer_queue_held(db):
        batch.add(lambda: store.claim(PRINCIPAL, "lead", "fp", 11, 1000))
        batch.add(lambda: store.claim(PRINCIPAL, "a", "fp", 12, 1000))
        batch.add(lambda: store.claim(PRINCIPAL, "bad", None, 13, 1000))  # type: ignore[arg-type]  # NOT NULL
        batch.add(lambda: store.claim(PRINCIPAL, "a", "fp", 14, 1000))  # a batch-mate already holds it
        batch.add(lambda: store.claim(PRINCIPAL, "b", "fp", 15, 1000))
        batch.add(lambda: engine.write("INSERT INTO no_such_table VALUES (1)", {}))
        batch.add(lambda: store.complete((PRINCIPAL, "a", 1, 12), (201, b"done", "{}"), 1001))
    lead, a, bad, a_again, b, nonsense, completed = batch.wait()
    assert (lead, a, a_again, b, completed) == (1, 1, None, 1, True)
    assert isinstance(bad, StorageError) and "NOT NULL" in str(bad)
    assert isinstance(nonsense, StorageError) and "no_such_table" in str(nonsense)
    # The leader alone, then the other six in one transaction.
    assert (engine.batches_committed, engine.statements_committed) == (2, 5)
    assert ledger.lookup(PRINCIPAL, "bad") is None
    row = ledger.lookup(PRINCIPAL, "a")
    assert row is not None and row.body_bytes == b"done"


def test_a_statement_that_fails_after_writing_a_row_leaves_none_of_it_and_its_batch_mates_commit(db, open_ledger):
    ledger = open_ledger(group_commit=True)
    engine = engine_of(ledger)
    store = ledger.store
    two_rows_the_second_refused = (
        "INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, created_at, updated_at) "
        "VALUES (:p, 'half-1', 'fp', 'pending', 1, 1, 1), (:p, 'half-2', NULL, 'pending', 1, 1, 1)"
    )
    batch = ForcedBatch(db, engine)
    with writer_queue_held(db):
        batch.add(lambda: store.claim(PRINCIPAL, "lead", "fp", 11, 1000))
        batch.add(lambda: store.claim(PRINCIPAL, "before", "fp", 12, 1000))
        batch.add(lambda: engine.write(two_rows_the_second_refused, {"p": PRINCIPAL}))
        batch.add(lambda: store.claim(PRINCIPAL, "after", "fp", 13, 1000))
    lead, before, half, after = batch.wait()
    assert (lead, before, after) == (1, 1, 1)
    assert isinstance(half, StorageError) and "NOT NULL" in str(half)
    # The failed INSERT's first row was written before its second failed: undone with it.
    assert ledger.lookup(PRINCIPAL, "half-1") is None
    assert (engine.batches_committed, engine.statements_committed) == (2, 3)


def test_a_batch_that_cannot_begin_fails_every_statement_and_stores_none(db, open_ledger):
    ledger = open_ledger(group_commit=True, busy_timeout_ms=300)
    engine = engine_of(ledger)
    blocker = sqlite3.connect(db, isolation_level=None)
    batch = ForcedBatch(db, engine)
    with writer_queue_held(db):
        blocker.execute("BEGIN IMMEDIATE")  # SQLite's own write lock, outside the writer queue
        for key in ("lead", "x", "y", "z"):
            batch.add(lambda key=key: ledger.claim(PRINCIPAL, key, "fp"))
    results = batch.wait()
    blocker.execute("ROLLBACK")
    blocker.close()
    assert all(isinstance(r, DatabaseLockedError) for r in results), results
    assert engine.batches_committed == 0
    assert [ledger.lookup(PRINCIPAL, k) for k in ("lead", "x", "y", "z")] == [None] * 4
    # The ledger works again at once.
    assert ledger.claim(PRINCIPAL, "x", "fp") is not None


def scripted(store: Any) -> list[Callable[[], object]]:
    """Claims, duplicates, completions right and wrong, a takeover, a
    release, a fenced-out event and a failing statement: each later step
    depends on what the earlier ones wrote."""
    return [
        lambda: store.claim(PRINCIPAL, "k1", "fp", 1, 1000),
        lambda: store.claim(PRINCIPAL, "k2", "fp", 2, 1000),
        lambda: store.claim(PRINCIPAL, "k1", "fp", 3, 1001),
        lambda: store.complete((PRINCIPAL, "k1", 1, 99), (201, b"wrong token", "{}"), 1002),
        lambda: store.complete((PRINCIPAL, "k1", 1, 1), (201, b"one", "{}"), 1003),
        lambda: store.complete((PRINCIPAL, "k1", 1, 1), (201, b"twice", "{}"), 1004),
        lambda: store.takeover(PRINCIPAL, "k2", "fp", 4, 5000, 1001, -1),
        lambda: store.complete((PRINCIPAL, "k2", 1, 2), (201, b"late", "{}"), 5001),
        lambda: store.record_fenced(PRINCIPAL, "k2", 1, 201, 5002),
        lambda: store.claim(PRINCIPAL, "k3", None, 5, 5003),
        lambda: store.claim(PRINCIPAL, "k4", "fp", 2**70, 5003),  # too big for SQLite: OverflowError
        lambda: store.release(PRINCIPAL, "k2", 2, 4),
        lambda: store.claim(PRINCIPAL, "k2", "fp", 6, 5004),
        lambda: store.complete((PRINCIPAL, "k2", 1, 6), (200, "text", "{}"), 5005),
        lambda: store.purge(PRINCIPAL, "k1", 0),
    ]


def comparable(result: object, path: str) -> object:
    if isinstance(result, Exception):
        return (type(result).__name__, str(result).replace(path, "<db>"))
    return result


def dump(path: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT * FROM idempotency_keys ORDER BY principal, key").fetchall()
        rows += conn.execute("SELECT * FROM idemctl_fenced_out ORDER BY id").fetchall()
        return rows
    finally:
        conn.close()


def test_a_scripted_sequence_gives_in_one_batch_exactly_what_it_gives_statement_by_statement(tmp_path):
    paths = []
    outcomes = []
    for name, group_commit in (("plain.db", False), ("batched.db", True)):
        path = str(tmp_path / name)
        paths.append(path)
        with Ledger.open(path) as ledger:
            ledger.init()
        with Ledger.open(path, group_commit=group_commit) as ledger:
            steps = scripted(ledger.store)
            engine = engine_of(ledger)
            if not group_commit:
                results: list[object] = []
                for step in steps:
                    try:
                        results.append(step())
                    except Exception as exc:
                        results.append(exc)
            else:
                batch = ForcedBatch(path, engine)
                with writer_queue_held(path):
                    for step in steps:
                        batch.add(step)
                results = batch.wait()
                assert engine.batches_committed == 2  # the leader's step alone, then the other 14 together
        outcomes.append([comparable(r, path) for r in results])
    plain, batched = outcomes
    assert batched == plain
    failed = [r[0] for r in plain if isinstance(r, tuple) and isinstance(r[0], str)]
    assert failed == ["StorageError", "OverflowError"]  # the script does fail steps
    assert dump(paths[1]) == dump(paths[0])


def _watch(db: str, keys: Any, misses: Any) -> None:
    conn = sqlite3.connect(db)
    seen = 0
    while True:
        key = keys.get(timeout=60)
        if key is None:
            break
        row = conn.execute(
            "SELECT status FROM idempotency_keys WHERE principal = ? AND key = ?", (PRINCIPAL, key)
        ).fetchone()
        if row != ("completed",):
            misses.put(key)
        seen += 1
    conn.close()
    misses.put(seen)


def test_once_complete_returns_another_process_sees_the_answer(db, open_ledger):
    ledger = open_ledger(group_commit=True)
    keys, misses = fork.Queue(), fork.Queue()
    watcher = fork.Process(target=_watch, args=(db, keys, misses))
    watcher.start()
    try:

        def work(i: int) -> None:
            for j in range(20):
                key = f"d{i}-{j}"
                reservation = ledger.claim(PRINCIPAL, key, "fp")
                assert reservation is not None
                assert ledger.complete(reservation, 201, {}, b"x").stored
                keys.put(key)  # only now: the other process must see it already

        run_threads(16, work)
        keys.put(None)
        seen = misses.get(timeout=60)
        assert seen == 16 * 20, f"another process did not see {seen}"
    finally:
        watcher.join(30)
        if watcher.is_alive():
            watcher.kill()
    assert engine_of(ledger).statements_committed / engine_of(ledger).batches_committed > 1


def _claim_in_child(ledger: Ledger, result: Any) -> None:
    try:
        result.put(ledger.claim(PRINCIPAL, "child", "fp") is not None)
    except BaseException as exc:  # pragma: no cover - reported to the parent
        result.put(repr(exc))


def test_a_forked_child_does_not_join_its_parents_pending_batch(db, open_ledger):
    ledger = open_ledger(group_commit=True)
    engine = engine_of(ledger)
    batch = ForcedBatch(db, engine)
    result = fork.Queue()

    def lead() -> object:
        # Its connection opened first, so that the fork below never finds
        # this thread inside SQLite (a fork then could copy SQLite's locks held).
        engine.read("SELECT 1", {})
        return ledger.claim(PRINCIPAL, "parent-lead", "fp")

    fd = os.open(db + "-idemctl.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    batch.add(lead)
    batch.add(lambda: ledger.claim(PRINCIPAL, "parent-queued", "fp"))
    # The parent has a leader and a queued statement; the child must lead its
    # own. The fork waits for the leader's statement in flight, which goes
    # once the queue is free; the queued one waits until the fork is done.
    threading.Timer(0.3, fcntl.flock, (fd, fcntl.LOCK_UN)).start()
    child = fork.Process(target=_claim_in_child, args=(ledger, result))
    child.start()
    child.join(30)
    os.close(fd)
    child_result = result.get(timeout=5)
    assert all(r is not None and not isinstance(r, Exception) for r in batch.wait())
    # The child led its own claim, and it is in the ledger: never a claim
    # that succeeded in the child and is missing here.
    assert child_result is True
    assert ledger.lookup(PRINCIPAL, "child") is not None


def test_with_small_batches_leaders_work_through_a_long_queue_and_hand_on(open_ledger, monkeypatch):
    # A queue longer than one batch: a leader whose own statement is not in
    # its first batch leads again, and the others are handed leadership.
    monkeypatch.setattr(group_commit_module, "GROUP_COMMIT_MAX_BATCH", 3)
    ledger = open_ledger(group_commit=True)
    engine = engine_of(ledger)

    def work(i: int) -> None:
        for j in range(20):
            assert ledger.claim(PRINCIPAL, f"s{i}-{j}", "fp") is not None

    run_threads(32, work)
    assert engine.statements_committed == 32 * 20
    assert 32 * 20 / 3 <= engine.batches_committed < 32 * 20


class LeaderStopped(BaseException):
    pass


def test_a_leader_stopped_mid_batch_fails_its_batch_mates_and_the_ledger_goes_on(db, open_ledger, monkeypatch):
    ledger = open_ledger(group_commit=True)
    engine = engine_of(ledger)
    batch = ForcedBatch(db, engine)
    real_flock = fcntl.flock
    stopped = []

    def flock(fd: int, operation: int) -> None:
        # The second caller leads the batch after the first: stopped as it
        # takes the batch's turn of the writer queue.
        if threading.current_thread() is batch.threads[1] and operation & fcntl.LOCK_EX and not stopped:
            stopped.append(fd)
            raise LeaderStopped
        real_flock(fd, operation)

    with writer_queue_held(db):
        for key in ("lead", "second", "third", "fourth"):
            batch.add(lambda key=key: ledger.claim(PRINCIPAL, key, "fp"))
        monkeypatch.setattr(fcntl, "flock", flock)
    results = batch.wait()
    monkeypatch.undo()
    assert len(stopped) == 1
    assert results[0] is not None and not isinstance(results[0], BaseException)  # the first caller ran alone
    # The second caller led the stopped batch and saw why; the others were told.
    assert isinstance(results[1], LeaderStopped)
    assert all(isinstance(r, StorageError) and "interrupted" in str(r) for r in results[2:]), results
    assert (engine.batches_committed, engine.statements_committed) == (1, 1)
    assert ledger.claim(PRINCIPAL, "after", "fp") is not None
