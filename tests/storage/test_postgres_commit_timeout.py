"""The commit timeout on PostgreSQL: every statement of the engine, its
commit included, ends within a bound. These tests hold a statement with
pg_sleep on the test server; a synchronous standby that does not
acknowledge, the case the bound exists for, is in
tests/e2e/test_postgres_synchronous_standby.py."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator

import pytest

psycopg = pytest.importorskip("psycopg")

from idemctl import Ledger, StorageError  # noqa: E402
from idemctl.errors import CommitTimeoutError, LedgerUnavailableError  # noqa: E402
from idemctl.storage.postgres import PostgresEngine  # noqa: E402
from idemctl.storage.postgres import watch as watching  # noqa: E402

pytestmark = pytest.mark.engines("postgres")

BOUND_S = 0.3
# A busy shared machine may add this much to the bound (a cancel's round trip, the scheduler).
SLACK_S = 3.0


@pytest.fixture
def engine(ledger_target: str) -> Iterator[PostgresEngine]:
    opened = PostgresEngine(ledger_target + f"&commit_timeout={BOUND_S}&pool_max_size=1")
    yield opened
    opened.close()


def backend_pid(engine: PostgresEngine) -> int:
    return int(engine.read("SELECT pg_backend_pid()", {})[0][0])


def ends_within_the_bound(call: object, *, grace: float = 0.0) -> CommitTimeoutError:
    started = time.monotonic()
    with pytest.raises(CommitTimeoutError) as raised:
        call()  # type: ignore[operator]
    elapsed = time.monotonic() - started
    assert BOUND_S - 0.02 <= elapsed < BOUND_S + grace + SLACK_S, elapsed
    return raised.value


def test_commit_timeout_comes_from_the_url_defaults_to_twice_the_busy_timeout_and_never_reaches_libpq(
    ledger_target: str,
) -> None:
    given = PostgresEngine(ledger_target + "&commit_timeout=2.5")
    try:
        assert given.commit_timeout_s == 2.5
        # libpq refuses a parameter it does not know: a statement at all shows it never got it.
        assert given.read("SELECT 1", {}) == [(1,)]
    finally:
        given.close()
    assert PostgresEngine(ledger_target).commit_timeout_s == 10.0
    assert PostgresEngine(ledger_target, busy_timeout_ms=1500).commit_timeout_s == 3.0
    assert PostgresEngine(ledger_target, busy_timeout_ms=0).commit_timeout_s == 1.0
    assert PostgresEngine(ledger_target, commit_timeout_s=0.75).commit_timeout_s == 0.75


@pytest.mark.parametrize("value", ["soon", "0", "-1", "nan", "inf", ""])
def test_a_commit_timeout_that_is_not_a_positive_number_of_seconds_is_refused_when_the_ledger_is_opened(
    ledger_target: str, value: str
) -> None:
    with pytest.raises(StorageError, match=r"^bad PostgreSQL URL: commit_timeout"):
        Ledger.open(ledger_target + f"&commit_timeout={value}")


def test_a_statement_past_the_commit_timeout_fails_and_its_connection_never_serves_again(
    engine: PostgresEngine, ledger_target: str
) -> None:
    first = backend_pid(engine)
    error = ends_within_the_bound(lambda: engine.read("SELECT pg_sleep(30)", {}))
    assert isinstance(error, LedgerUnavailableError)  # what the adapters answer with 503
    assert str(error).startswith(
        "a statement on postgresql://postgres@127.0.0.1:5432/test did not commit within the commit timeout (0.3 s) "
        "and was cancelled"
    )
    # The pool's one connection was replaced: the cancelled one may carry a
    # late cancel, so nothing runs on it again; its server process is gone.
    assert backend_pid(engine) != first
    with psycopg.connect(ledger_target, autocommit=True) as pg:
        deadline = time.monotonic() + 10
        while pg.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [first]).fetchone()[0]:
            assert time.monotonic() < deadline, "the cancelled statement's server process lives on"
            time.sleep(0.05)
    assert engine.read("SELECT 2", {}) == [(2,)]


def test_a_statement_that_ends_after_the_deadline_fails_even_when_it_succeeded(
    engine: PostgresEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As a commit whose wait for a standby a cancel ended: the server
    # reports success, which comes too late to count.
    monkeypatch.setattr(psycopg.Connection, "cancel_safe", lambda self, timeout=0: None)
    monkeypatch.setattr(engine._watch, "grace_s", 30.0)  # nor is the connection cut before it ends
    started = time.monotonic()
    with pytest.raises(CommitTimeoutError) as raised:
        engine.write("SELECT pg_sleep(0.8)", {})
    assert time.monotonic() - started >= 0.8
    assert raised.value.__cause__ is None  # no error from the server: its success was thrown away


def test_a_cancel_that_never_reaches_the_server_cuts_the_connection_after_the_grace(
    engine: PostgresEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(psycopg.Connection, "cancel_safe", lambda self, timeout=0: None)
    error = ends_within_the_bound(lambda: engine.read("SELECT pg_sleep(30)", {}), grace=BOUND_S)
    assert isinstance(error.__cause__, psycopg.OperationalError)  # the socket shut down under it
    monkeypatch.undo()
    assert engine.read("SELECT 3", {}) == [(3,)]


def test_every_statement_of_a_turn_is_bounded(engine: PostgresEngine) -> None:
    ends_within_the_bound(lambda: engine.write_turn([("SELECT 1", {}), ("SELECT pg_sleep(30)", {})]))
    assert engine.write_turn([("SELECT 4", {})]) == [[(4,)]]


@pytest.mark.parametrize("driver", ["auto", "psycopg"], ids=["asyncpg-when-installed", "psycopg"])
def test_the_asynchronous_path_is_bounded_the_same_way(ledger_target: str, driver: str) -> None:
    engine = PostgresEngine(ledger_target + f"&commit_timeout={BOUND_S}&pool_max_size=1&async_driver={driver}")

    async def scenario() -> None:
        aio = engine.open_async()
        try:
            first = (await aio.execute("SELECT pg_backend_pid()", {}))[0][0]
            started = time.monotonic()
            with pytest.raises(CommitTimeoutError):
                await aio.execute("SELECT pg_sleep(30)", {})
            assert BOUND_S - 0.02 <= time.monotonic() - started < BOUND_S + SLACK_S
            assert (await aio.execute("SELECT pg_backend_pid()", {}))[0][0] != first
            with pytest.raises(CommitTimeoutError):
                await aio.write_turn([("SELECT 1", {}), ("SELECT pg_sleep(30)", {})])
            assert await aio.write_turn([("SELECT 5", {})]) == [[(5,)]]
        finally:
            await aio.aclose()

    try:
        asyncio.run(scenario())
    finally:
        engine.close()


def watchers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "idemctl-commit-watch"]


def test_the_watcher_thread_comes_with_the_first_statement_and_goes_when_the_engine_closes(ledger_target: str) -> None:
    before = set(watchers())
    engine = PostgresEngine(ledger_target)
    assert set(watchers()) == before  # nothing runs until a statement does
    for _ in range(20):
        assert engine.read("SELECT 1", {}) == [(1,)]
    (mine,) = set(watchers()) - before  # one for the engine, not one per statement
    engine.close()
    mine.join(timeout=5)
    assert not mine.is_alive()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_bounds_its_own_statements(engine: PostgresEngine) -> None:
    assert engine.read("SELECT 1", {}) == [(1,)]  # the parent's watcher thread runs
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            started = time.monotonic()
            try:
                engine.read("SELECT pg_sleep(30)", {})
            except CommitTimeoutError:
                code = 0 if time.monotonic() - started < BOUND_S + SLACK_S else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_an_idle_watcher_thread_ends_and_the_next_statement_is_bounded_by_a_new_one(
    ledger_target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watching, "IDLE_EXIT_S", 0.2)
    before = set(watchers())
    engine = PostgresEngine(ledger_target + f"&commit_timeout={BOUND_S}")
    try:
        assert engine.read("SELECT 1", {}) == [(1,)]
        (first,) = set(watchers()) - before
        first.join(timeout=5)
        assert not first.is_alive()  # nothing to watch for a while: gone, the engine still open
        ends_within_the_bound(lambda: engine.read("SELECT pg_sleep(30)", {}))
        assert set(watchers()) - before - {first}
    finally:
        engine.close()


def test_cancelling_overdue_statements_never_touches_the_statements_of_other_threads(ledger_target: str) -> None:
    # A connection goes back to the pool as soon as its statement ends: the
    # watcher must never cancel what the next borrower runs on it.
    engine = PostgresEngine(ledger_target + f"&commit_timeout={BOUND_S}&pool_max_size=4")
    wrong: list[object] = []
    timeouts: list[int] = []

    def quick(n: int) -> None:
        for i in range(150):
            try:
                rows = engine.read("SELECT %(v)s::int, pg_sleep(0.001)", {"v": n * 1000 + i})
            except Exception as exc:  # any error here is the defect
                wrong.append(exc)
                return
            if rows[0][0] != n * 1000 + i:
                wrong.append(rows)

    def slow() -> None:
        for _ in range(3):
            try:
                engine.read("SELECT pg_sleep(30)", {})
            except CommitTimeoutError:
                timeouts.append(1)

    threads = [threading.Thread(target=quick, args=(n,)) for n in range(3)] + [threading.Thread(target=slow)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert (wrong, len(timeouts)) == ([], 3)
    finally:
        engine.close()


class FreezableProxy:
    """A TCP relay to the test server that can freeze, as a primary that
    stops answering does: from `freeze()` on, nothing is relayed either way
    and new connections are accepted but never answered."""

    def __init__(self, host: str, port: int) -> None:
        import socket

        self.upstream = (host, port)
        self.frozen = threading.Event()
        self.closed = threading.Event()
        self.sockets: list[socket.socket] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.sockets.append(client)
            if self.frozen.is_set():
                continue  # held open, never answered
            server = socket.create_connection(self.upstream)
            self.sockets.append(server)
            threading.Thread(target=self._relay, args=(client, server), daemon=True).start()
            threading.Thread(target=self._relay, args=(server, client), daemon=True).start()

    def _relay(self, source: object, sink: object) -> None:
        while True:
            try:
                data = source.recv(65536)  # type: ignore[attr-defined]
            except OSError:
                return
            if not data:
                return
            if not self.frozen.is_set():
                try:
                    sink.sendall(data)  # type: ignore[attr-defined]
                except OSError:
                    return

    @classmethod
    def before(cls, url: str) -> tuple[FreezableProxy, str]:
        """A proxy in front of the server `url` names, and the URL through it."""
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        proxy = cls(parts.hostname or "127.0.0.1", parts.port or 5432)
        return proxy, url.replace(parts.netloc, f"{parts.username}@127.0.0.1:{proxy.port}", 1)

    def freeze(self) -> None:
        self.frozen.set()

    def close(self) -> None:
        self.closed.set()
        self.listener.close()
        for s in self.sockets:
            s.close()


@pytest.mark.slow
def test_a_write_in_its_requests_task_on_a_frozen_primary_fails_with_the_commit_timeout_not_a_cancellation(
    ledger_target: str,
) -> None:
    # The write times out on the wire; asyncpg's cancel request never gets an
    # answer either, so retiring the connection ends on asyncpg's own timer
    # after the grace. That timer's cancellation belongs to the write, not to
    # the request: the request must get the commit timeout, not be cancelled.
    from idemctl.landing import Landing

    pytest.importorskip("asyncpg")
    proxy, through = FreezableProxy.before(ledger_target)
    engine = PostgresEngine(through + f"&commit_timeout={BOUND_S}&pool_max_size=1")

    async def scenario() -> tuple[BaseException, object, float]:
        aio = engine.open_async()
        try:
            assert await aio.execute("SELECT 1", {}) == [(1,)]
            proxy.freeze()
            landing = Landing(aio.execute("SELECT 2", {}))
            started = time.monotonic()
            try:
                await landing
            except BaseException as exc:  # what it raised is the point
                return exc, landing.rest, time.monotonic() - started
            raise AssertionError("a statement on a frozen primary returned")
        finally:
            aio.abandon()

    try:
        raised, rest, took = asyncio.run(scenario())
    finally:
        proxy.close()
        engine.close()
    assert isinstance(raised, CommitTimeoutError), repr(raised)
    assert rest is None  # nothing was handed to a task of its own
    # The bound, then at most the grace (as long as the bound here) for the cancel request.
    assert BOUND_S - 0.02 <= took < 2 * BOUND_S + SLACK_S, took


def test_an_asgi_request_on_a_frozen_primary_is_answered_within_the_commit_timeout_and_a_second(
    ledger_target: str,
) -> None:
    from starlette.testclient import TestClient

    from idemctl.asgi import IdempotencyMiddleware

    proxy, through = FreezableProxy.before(ledger_target)

    async def orders(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"made"})

    ledger = Ledger.open(through + "&commit_timeout=2")
    try:
        ledger.init()
        took = []
        # One event loop for every request, as a server runs them: the first
        # opens the pool; once the primary is frozen, the second's statement
        # hangs on the pooled connection, the third waits for a new one (the
        # server accepts it and never answers).
        with TestClient(IdempotencyMiddleware(orders, ledger, principal=lambda scope: "acct_A")) as client:
            answered = client.post("/orders", headers={"Idempotency-Key": "k0"}, content=b"{}")
            assert (answered.status_code, answered.content) == (201, b"made")
            proxy.freeze()
            for n in range(1, 4):
                started = time.monotonic()
                refused = client.post("/orders", headers={"Idempotency-Key": f"k{n}"}, content=b"{}")
                took.append(time.monotonic() - started)
                assert refused.status_code == 503
        # Within commit_timeout (2 s) plus at most a second, with room for a busy machine.
        assert all(t < 3.0 + 0.8 for t in took), took
    finally:
        proxy.close()
        ledger.close()
