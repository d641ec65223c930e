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
import traceback
import warnings

import pytest

from idemctl import Ledger, Outcome, StorageError
from tests.helpers import sqlite_connections_open

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
    ledger.operator.sweep()
    return 0


def _die_after(seconds: int) -> None:
    """In a forked child: a hung child is killed rather than hang the suite
    (or outlive it holding its output open). SIGALRM's default action, not
    the handler pytest-timeout installed in the parent, which a child stuck
    in a lock inherited from the fork might never get to run."""
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(seconds)


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
                    _die_after(CHILD_DEADLINE_S)
                    code = _child(ledger, n)
                except BaseException:  # code 1; the test's output says why
                    traceback.print_exc()
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
    stats = ledger.operator.stats()
    assert stats.completed == CHILDREN * 3 + made
    ledger.close()


ENDING_THREAD_FORKS = 300
ENDING_THREAD_CHILD_DEADLINE_S = 10


def test_children_forked_while_parent_threads_end_never_inherit_a_connection_being_closed(tmp_path):
    # A thread's connection is closed when the thread ends. That close is a
    # call into SQLite: a fork at that moment used to copy SQLite's mutexes
    # held (the child hung on its first statement), or the connection still
    # open (the child's claim, reported made, was lost: the row count below).
    # Each round: threads that read once and end, and a fork.
    path = tmp_path / "ledger.db"
    ledger = Ledger.open(path)
    ledger.init()
    codes = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork() with threads running
        for n in range(ENDING_THREAD_FORKS):
            readers = [threading.Thread(target=ledger.lookup, args=("acct", "absent")) for _ in range(4)]
            for t in readers:
                t.start()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - runs in the child
                code = 1
                try:
                    _die_after(ENDING_THREAD_CHILD_DEADLINE_S)
                    code = 0 if ledger.claim("acct", f"child-{n}", "fp") is not None else 3
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            codes.append(os.waitstatus_to_exitcode(status))
            for t in readers:
                t.join()
            if codes[-1] != 0:
                break
    assert codes == [0] * ENDING_THREAD_FORKS, f"fork {len(codes)} ended {codes[-1]} (-14: the child hung)"
    assert ledger.operator.stats().total == ENDING_THREAD_FORKS
    ledger.close()


def test_children_forked_while_parent_threads_write_all_work(ledger_target, backend_name):
    if backend_name == "mysql":
        pytest.skip("the MariaDB/MySQL engine has no fork hooks yet: open its ledger after fork, in each child")
    ledger = Ledger.open(ledger_target)
    ledger.init()
    codes, errors, made = _fork_children_while_threads_write(ledger)
    assert codes == [0] * CHILDREN, codes
    assert errors == []
    assert ledger.operator.stats().completed == CHILDREN * 3 + made
    ledger.close()


def test_the_parent_goes_on_after_a_fork_on_new_connections(tmp_path):
    path = tmp_path / "ledger.db"
    ledger = Ledger.open(path)
    ledger.init()
    ledger.handle("acct", "before", "POST", "/o", {}, b"x", ok)
    assert sqlite_connections_open(path) == 1
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            _die_after(CHILD_DEADLINE_S)
            code = 0 if sqlite_connections_open(path) == 0 else 5
            if code == 0:
                code = _child(ledger, 0)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's connection was closed for the fork; its next statement opens another.
    assert sqlite_connections_open(path) == 0
    assert ledger.handle("acct", "after", "POST", "/o", {}, b"x", ok).outcome is Outcome.EXECUTED
    assert ledger.operator.stats().completed == 2 + 3
    ledger.close()


def _child_reports(body) -> tuple[int, str]:
    """Fork; the child runs `body()` (its exit code), writing what it wants
    to say to the pipe; returns the exit code and what it said."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            _die_after(CHILD_DEADLINE_S)
            code = body(lambda text: os.write(write_end, text.encode()))
        finally:
            os._exit(code)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    said = os.read(read_end, 8000).decode()
    os.close(read_end)
    return os.waitstatus_to_exitcode(status), said


def _refused_everywhere(ledger: Ledger, path, say) -> int:
    """In the child: this ledger and a new one on the same file both refuse."""
    messages = []
    try:
        ledger.handle("acct", "child", "POST", "/o", {}, b"x", ok)
    except StorageError as exc:
        messages.append(str(exc))
    try:
        Ledger.open(path)
    except StorageError as exc:
        messages.append(str(exc))
    say("\n".join(messages))
    return 0 if len(messages) == 2 and messages[0] == messages[1] else 7


def refusal(path, why: str) -> str:
    return (
        f"this process was forked while {why} in the parent process, so SQLite's state for {path} was copied "
        "into this one and no connection to it is safe here: fork when no listing is open and no write is "
        "stuck, or open the ledger only after fork (in each child)"
    )


def test_a_child_forked_while_a_listing_is_read_refuses_the_ledger_with_what_to_do(tmp_path):
    path = tmp_path / "ledger.db"
    ledger = Ledger.open(path)
    ledger.init()
    for i in range(3):
        ledger.claim("acct", f"k{i}", "fp")
    listing = ledger.operator.pending()
    next(listing)  # a listing is open, on its own connection, mid-read
    code, said = _child_reports(lambda say: _refused_everywhere(ledger, path, say))
    assert code == 0, said
    assert said == "\n".join([refusal(path, "it was being listed (pending rows, a stream)")] * 2)
    # The parent's listing and ledger are untouched.
    assert len(list(listing)) == 2
    assert ledger.handle("acct", "parent", "POST", "/o", {}, b"x", ok).outcome is Outcome.EXECUTED
    ledger.close()


def test_a_fork_waits_no_longer_than_the_busy_timeout_and_that_child_refuses_the_ledger(tmp_path):
    import fcntl

    path = tmp_path / "ledger.db"
    ledger = Ledger.open(path, busy_timeout_ms=300)
    ledger.init()
    # Another writer holds the writer queue: the parent's claim waits behind it.
    fd = os.open(str(path) + "-idemctl.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    stuck: list[object] = []
    writer = threading.Thread(target=lambda: stuck.append(ledger.claim("acct", "stuck", "fp")))
    writer.start()
    time.sleep(0.2)
    code, said = _child_reports(lambda say: _refused_everywhere(ledger, path, say))
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    writer.join()
    assert code == 0, said
    assert said == "\n".join([refusal(path, "a statement on it had been running for over the busy timeout")] * 2)
    # The parent's stuck statement went through once the queue was free.
    assert len(stuck) == 1 and stuck[0] is not None
    assert ledger.handle("acct", "parent", "POST", "/o", {}, b"x", ok).outcome is Outcome.EXECUTED
    ledger.close()
