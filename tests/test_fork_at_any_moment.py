"""A ledger opened before fork() works in the children, whatever the
parent's threads were doing at that moment (pre-fork servers: gunicorn
--preload, multiprocessing), on every backend and SQLite setting; the one
case it cannot cover (a listing being read during the fork) fails loudly in
the child with what to do."""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings

import pytest

from idemctl import Ledger, Outcome, StorageError

CHILDREN = 12
CHILD_DEADLINE_S = 30


def ok(body: bytes):
    return 201, [], b"done"


def _child(ledger: Ledger, n: int) -> int:
    """What each child does: requests and a sweep, as a worker would."""
    for i in range(3):
        answer = ledger.handle("acct", f"child-{n}-{i}", "POST", "/o", {}, b"x", ok)
        if answer.outcome is not Outcome.EXECUTED:
            return 3
    if ledger.handle("acct", f"child-{n}-0", "POST", "/o", {}, b"x", ok).outcome is not Outcome.REPLAYED:
        return 4
    ledger.sweep()
    return 0


def _fork_children_while_threads_write(ledger: Ledger) -> tuple[list[int], list[BaseException], int]:
    """Fork CHILDREN children at moments when the parent's writer threads
    are busy; return the children's exit codes, the threads' errors and how
    many requests the threads made."""
    stop = threading.Event()
    errors: list[BaseException] = []
    made = [0]

    def writer(t: int) -> None:
        i = 0
        while not stop.is_set():
            try:
                ledger.handle("acct", f"parent-{t}-{i}", "POST", "/o", {}, b"x", ok)
                made[0] += 1
            except BaseException as exc:  # reported to the test
                errors.append(exc)
                return
            i += 1

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    pids = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork() with threads running
        for n in range(CHILDREN):
            time.sleep(0.003 * (n % 4))
            pid = os.fork()
            if pid == 0:  # pragma: no cover - runs in the child
                code = 1
                try:
                    signal.alarm(CHILD_DEADLINE_S)  # a hung child dies rather than hang the suite
                    code = _child(ledger, n)
                finally:
                    os._exit(code)
            pids.append(pid)
    codes = []
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        codes.append(os.waitstatus_to_exitcode(status))
    stop.set()
    for t in threads:
        t.join()
    return codes, errors, made[0]


@pytest.mark.parametrize(
    "options",
    [{}, {"group_commit": True}, {"write_queue": False}],
    ids=["sqlite-default", "sqlite-group-commit", "sqlite-no-write-queue"],
)
def test_children_forked_while_parent_threads_write_all_work_on_sqlite(tmp_path, options):
    path = tmp_path / "ledger.db"
    ledger = Ledger.open(path, **options)
    ledger.init()
    codes, errors, made = _fork_children_while_threads_write(ledger)
    assert codes == [0] * CHILDREN, codes  # -14 would be a child that hung (SIGALRM)
    assert errors == []
    # Every child's requests and every parent request are in the ledger.
    stats = ledger.stats()
    assert stats.completed == CHILDREN * 3 + made
    ledger.close()


def test_children_forked_while_parent_threads_write_all_work(ledger_target):
    ledger = Ledger.open(ledger_target)
    ledger.init()
    codes, errors, made = _fork_children_while_threads_write(ledger)
    assert codes == [0] * CHILDREN, codes
    assert errors == []
    assert ledger.stats().completed == CHILDREN * 3 + made
    ledger.close()


def test_the_parent_goes_on_after_a_fork_on_new_connections(tmp_path):
    ledger = Ledger.open(tmp_path / "ledger.db")
    ledger.init()
    ledger.handle("acct", "before", "POST", "/o", {}, b"x", ok)
    engine = ledger.store.engine
    assert engine.open_connections() == 1
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            code = 0 if engine.open_connections() == 0 else 5
            if code == 0:
                code = _child(ledger, 0)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's connection was closed for the fork; its next statement opens another.
    assert engine.open_connections() == 0
    assert ledger.handle("acct", "after", "POST", "/o", {}, b"x", ok).outcome is Outcome.EXECUTED
    assert ledger.stats().completed == 2 + 3
    ledger.close()


def test_a_child_forked_while_a_listing_is_read_refuses_the_ledger_with_what_to_do(tmp_path):
    path = tmp_path / "ledger.db"
    ledger = Ledger.open(path)
    ledger.init()
    for i in range(3):
        ledger.claim("acct", f"k{i}", "fp")
    listing = ledger.pending()
    next(listing)  # a listing is open, on its own connection
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            try:
                ledger.handle("acct", "child", "POST", "/o", {}, b"x", ok)
            except StorageError as exc:
                os.write(write_end, str(exc).encode())
                code = 0
            # A ledger opened in the child works.
            fresh = Ledger.open(path)
            if fresh.handle("acct", "child", "POST", "/o", {}, b"x", ok).outcome is not Outcome.EXECUTED:
                code = 6
        finally:
            os._exit(code)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    message = os.read(read_end, 4000).decode()
    os.close(read_end)
    assert os.waitstatus_to_exitcode(status) == 0
    assert message == (
        f"the ledger {path} was being listed (pending rows, a stream) in the parent process when this process "
        "was forked, so SQLite's state for it was copied mid-read: open the ledger again in this process "
        "(Ledger.open), or fork only when no listing is open"
    )
    # The parent's listing and ledger are untouched.
    assert len(list(listing)) == 2
    assert ledger.handle("acct", "parent", "POST", "/o", {}, b"x", ok).outcome is Outcome.EXECUTED
    ledger.close()
