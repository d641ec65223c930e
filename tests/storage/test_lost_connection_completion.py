"""A connection that dies while the mutation runs, or while its answer is
being stored, loses no answer while the server is up: the fenced completion
is stored again on a fresh connection, the client's retry replays it byte for
byte, and the mutation ran once.

Connections are ended from outside, as an operator or a proxy would:
`pg_terminate_backend` on the ledger's backends (found by the test schema's
application_name) on PostgreSQL, synchronous and asynchronous; `KILL` on
MariaDB. Last, a storm: many threads making requests while another thread
keeps ending the ledger's connections; no key whose first answer was
acknowledged runs its mutation again."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import io
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from idemctl import AnswerNotStoredError, Ledger, Outcome, Status, StorageError, Ticket, decision
from tests.helpers import FakeClock, mysql_connect_args, read_innodb_trx, step_of

BODY = b'{"sku":"x"}'
HEADERS = {"content-type": "application/json", "location": "/orders/1"}
ANSWER = b'{"id":1}'
# A lock wait of the completion outlasts the test's choreography.
PATIENT_MS = 30_000


# -- ending connections from outside ---------------------------------------------------------


class Admin:
    """An operator's connection to the test's database, ending the ledger's own."""

    def __init__(self, backend: str, target: str) -> None:
        self.backend = backend
        self.target = target
        if backend == "postgres":
            import psycopg

            self.conn: Any = psycopg.connect(target, autocommit=True)
            self.app = target.rsplit("application_name=", 1)[1].split("&")[0]
        else:
            import pymysql

            self.conn = pymysql.connect(**{**mysql_connect_args(target), "autocommit": True})

    def _rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        if self.backend == "postgres":
            return list(self.conn.execute(sql, params).fetchall())
        with self.conn.cursor() as cur:
            cur.execute(sql, params)
            return list(cur.fetchall())

    def ledger_connections(self, *, waiting_for_a_lock: bool = False) -> list[int]:
        """The ledger's connections (by server pid or connection id), never this one."""
        if self.backend == "postgres":
            lock = " AND wait_event_type = 'Lock'" if waiting_for_a_lock else ""
            sql = "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND pid <> pg_backend_pid()" + lock
            return [int(r[0]) for r in self._rows(sql, (self.app,))]
        if waiting_for_a_lock:
            sql = (
                "SELECT p.id FROM information_schema.innodb_trx t"
                " JOIN information_schema.processlist p ON p.id = t.trx_mysql_thread_id"
                " WHERE t.trx_state = 'LOCK WAIT' AND p.db = DATABASE() AND p.id <> CONNECTION_ID()"
            )
        else:
            sql = "SELECT id FROM information_schema.processlist WHERE db = DATABASE() AND id <> CONNECTION_ID()"
        if waiting_for_a_lock:
            return [int(r[0]) for r in read_innodb_trx(lambda: self._rows(sql))]
        return [int(r[0]) for r in self._rows(sql)]

    def end(self, ids: list[int], *, wait: bool = True) -> None:
        """End these connections; with `wait`, until the server has let them go."""
        for one in ids:
            if self.backend == "postgres":
                self._rows("SELECT pg_terminate_backend(%s)", (one,))
            else:
                with contextlib.suppress(Exception):
                    self._rows(f"KILL {int(one)}")
        deadline = time.monotonic() + 10
        while wait and set(ids) & set(self.ledger_connections()):
            assert time.monotonic() < deadline, "the server kept the ended connections"
            time.sleep(0.02)

    def end_all(self) -> int:
        ids = self.ledger_connections()
        self.end(ids)
        return len(ids)

    def wait_for_a_lock_waiter(self) -> int:
        deadline = time.monotonic() + 20
        while not (waiting := self.ledger_connections(waiting_for_a_lock=True)):
            assert time.monotonic() < deadline, "the completion never waited for the row"
            time.sleep(0.02)
        (one,) = waiting
        return one

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def admin(backend_name: str, ledger_target: str) -> Iterator[Admin]:
    one = Admin(backend_name, ledger_target)
    yield one
    one.close()


@contextlib.contextmanager
def row_locked(backend: str, target: str) -> Iterator[None]:
    """Another session holds the ledger row (acct, k1) locked until the block ends."""
    if backend == "postgres":
        import psycopg

        with psycopg.connect(target, autocommit=True) as holder:
            holder.execute("BEGIN")
            holder.execute("SELECT 1 FROM idempotency_keys WHERE principal = 'acct' AND key = 'k1' FOR UPDATE")
            yield
            holder.execute("ROLLBACK")
    else:
        import pymysql

        holder = pymysql.connect(**{**mysql_connect_args(target), "autocommit": True})
        try:
            with holder.cursor() as cur:
                cur.execute("BEGIN")
                cur.execute("SELECT 1 FROM idempotency_keys WHERE principal = 'acct' AND `key` = 'k1' FOR UPDATE")
                yield
                cur.execute("ROLLBACK")
        finally:
            holder.close()


# -- the request, synchronous and on the event loop ------------------------------------------


def first_request(ledger: Ledger, runs: collections.Counter[str], key: str = "k1") -> Ticket:
    ticket = ledger.begin("acct", key, "POST", "/orders", {}, BODY)
    assert isinstance(ticket, Ticket)
    runs[key] += 1
    return ticket


def assert_stored_and_replayed(
    ledger: Ledger, clock: FakeClock, answer_wire: tuple[Any, ...], runs: collections.Counter[str]
) -> None:
    """The row holds the answer; a retry after the pending TTL replays it
    byte for byte instead of running the mutation again."""
    row = ledger.lookup("acct", "k1")
    assert row is not None and (row.status, row.response_status) == (Status.COMPLETED, 201)
    clock.advance(ledger.policy.pending_ttl_ms + 1)
    again = ledger.begin("acct", "k1", "POST", "/orders", {}, BODY)
    assert not isinstance(again, Ticket), "the retry was handed the mutation again"
    assert (again.outcome, again.wire) == (Outcome.REPLAYED, answer_wire)
    assert runs == {"k1": 1}


async def no_thread(fn: Callable[..., Any], *args: Any) -> Any:
    raise AssertionError(f"a ledger step was handed to a thread: {fn!r}")


async def request_on_the_loop(
    ledger: Ledger,
    runs: collections.Counter[str],
    while_the_app_runs: Callable[[], object] | None = None,
    while_storing: Callable[[], object] | None = None,
) -> Any:
    """One request with every ledger statement awaited on the loop
    (psycopg's AsyncConnection); the operator's steps run in a thread
    meanwhile, so that the loop goes on."""
    store = ledger.async_store()
    assert store is not None
    ticket = await decision.run_async(
        ledger.begin_steps("acct", "k1", "POST", "/orders", {}, BODY), no_thread, store=store
    )
    assert isinstance(ticket, Ticket)
    runs["k1"] += 1
    if while_the_app_runs is not None:
        await asyncio.to_thread(while_the_app_runs)
    finishing = asyncio.ensure_future(
        decision.run_async(ledger.finish_steps(ticket, 201, HEADERS, ANSWER), no_thread, store=store)
    )
    if while_storing is not None:
        await asyncio.to_thread(while_storing)
    try:
        return await finishing
    finally:
        await ledger.aclose()
        # The synchronous pool's connection (which made the schema) was
        # ended too: the checks after this start it afresh.
        ledger.store.engine.close()


# -- PostgreSQL and MariaDB: one connection ended ---------------------------------------------


@pytest.mark.engines("postgres", "mysql")
def test_an_idle_pooled_connection_ended_while_the_app_runs_costs_no_answer(
    make_ledger, admin: Admin, clock: FakeClock
) -> None:
    # The claim's connection goes back to the pool and dies there while the
    # app runs: the completion's first try meets it dead, the next one runs
    # on a fresh connection.
    ledger = make_ledger()
    runs: collections.Counter[str] = collections.Counter()
    ticket = first_request(ledger, runs)
    assert admin.end_all() >= 1
    answer = ledger.finish(ticket, 201, HEADERS, ANSWER)
    assert (answer.outcome, answer.status, answer.body) == (Outcome.EXECUTED, 201, ANSWER)
    assert_stored_and_replayed(ledger, clock, answer.wire, runs)


@pytest.mark.engines("postgres", "mysql")
def test_a_connection_ended_in_the_middle_of_the_completion_costs_no_answer(
    make_ledger, admin: Admin, clock: FakeClock, backend_name: str, ledger_target: str
) -> None:
    # The completion waits for a row lock another session holds; the
    # operator ends the completion's connection mid-statement (rolled back,
    # nothing stored). The try on a fresh connection waits for the lock in
    # turn and stores the answer once the other session lets go.
    ledger = make_ledger(busy_timeout_ms=PATIENT_MS)
    runs: collections.Counter[str] = collections.Counter()
    ticket = first_request(ledger, runs)
    outcome: list[object] = []

    def finish() -> None:
        try:
            outcome.append(ledger.finish(ticket, 201, HEADERS, ANSWER))
        except Exception as exc:  # the test reports it below
            outcome.append(exc)

    with row_locked(backend_name, ledger_target):
        storing = threading.Thread(target=finish)
        storing.start()
        admin.end([admin.wait_for_a_lock_waiter()])
    storing.join(30)
    (answer,) = outcome
    assert not isinstance(answer, Exception), answer
    assert answer.outcome is Outcome.EXECUTED  # type: ignore[union-attr]
    assert_stored_and_replayed(ledger, clock, answer.wire, runs)  # type: ignore[union-attr]


@pytest.mark.engines("postgres")
def test_on_the_event_loop_an_idle_pooled_connection_ended_while_the_app_runs_costs_no_answer(
    make_ledger, admin: Admin, clock: FakeClock
) -> None:
    ledger = make_ledger()
    runs: collections.Counter[str] = collections.Counter()
    answer = asyncio.run(request_on_the_loop(ledger, runs, while_the_app_runs=admin.end_all))
    assert (answer.outcome, answer.body) == (Outcome.EXECUTED, ANSWER)
    assert_stored_and_replayed(ledger, clock, answer.wire, runs)


@pytest.mark.engines("postgres")
def test_on_the_event_loop_a_connection_ended_in_the_middle_of_the_completion_costs_no_answer(
    make_ledger, admin: Admin, clock: FakeClock, ledger_target: str
) -> None:
    ledger = make_ledger(busy_timeout_ms=PATIENT_MS)
    runs: collections.Counter[str] = collections.Counter()
    locked = contextlib.ExitStack()

    def lock_the_row() -> None:
        locked.enter_context(row_locked("postgres", ledger_target))

    def end_the_waiting_completion_then_let_go() -> None:
        admin.end([admin.wait_for_a_lock_waiter()])
        locked.close()

    answer = asyncio.run(
        request_on_the_loop(
            ledger, runs, while_the_app_runs=lock_the_row, while_storing=end_the_waiting_completion_then_let_go
        )
    )
    assert (answer.outcome, answer.body) == (Outcome.EXECUTED, ANSWER)
    assert_stored_and_replayed(ledger, clock, answer.wire, runs)


@pytest.mark.engines("postgres")
def test_on_the_event_loop_the_pauses_between_tries_hold_no_thread(
    make_ledger, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two lost tries in a row: the third one, after a pause on the loop
    # (asyncio.sleep, no hand-off to a thread), stores the answer.
    from idemctl.errors import ConnectionFailedError
    from idemctl.storage.aio import AsyncStore

    ledger = make_ledger()
    runs: collections.Counter[str] = collections.Counter()
    real = AsyncStore.run
    tries: list[int] = []

    async def flaky(self: AsyncStore, op: Any) -> Any:
        if step_of(op) != "complete":
            return await real(self, op)
        tries.append(1)
        if len(tries) <= 2:
            raise ConnectionFailedError("cannot reach PostgreSQL: server closed the connection unexpectedly")
        return await real(self, op)

    monkeypatch.setattr(AsyncStore, "run", flaky)
    answer = asyncio.run(request_on_the_loop(ledger, runs))
    assert len(tries) == 3 and (answer.outcome, answer.body) == (Outcome.EXECUTED, ANSWER)
    assert_stored_and_replayed(ledger, clock, answer.wire, runs)


@pytest.mark.engines("postgres", "mysql")
def test_a_claim_whose_connection_was_ended_is_a_503_and_nothing_ran(make_ledger, admin: Admin) -> None:
    # Before the app runs, a lost connection is an error the adapters answer
    # with 503 and Retry-After: no mutation ran, so the client may retry at once.
    from idemctl.wsgi import IdempotencyMiddleware

    ledger = make_ledger()
    runs: list[bytes] = []

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        runs.append(environ["wsgi.input"].read())
        start_response("201 Created", [("content-type", "application/json")])
        return [ANSWER]

    middleware = IdempotencyMiddleware(app, ledger, principal=lambda environ: "acct")
    assert admin.end_all() >= 1
    seen: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: object = None) -> None:
        seen["status"], seen["headers"] = status, dict((k.lower(), v) for k, v in headers)

    def post() -> bytes:
        environ = {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": "/orders",
            "QUERY_STRING": "",
            "CONTENT_LENGTH": str(len(BODY)),
            "wsgi.input": io.BytesIO(BODY),
            "HTTP_IDEMPOTENCY_KEY": "k1",
        }
        return b"".join(middleware(environ, start_response))

    post()
    assert seen["status"].startswith("503") and "retry-after" in seen["headers"]
    assert runs == []
    assert ledger.lookup("acct", "k1") is None
    assert post() == ANSWER and seen["status"].startswith("201") and runs == [BODY]


# -- a storm ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.engines("postgres", "mysql")
def test_under_a_storm_of_ended_connections_no_acknowledged_answer_runs_again(
    make_ledger, admin: Admin, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    storm_s, workers, pause_s = 12.0, 8, 0.25
    ledger = make_ledger()
    runs: collections.Counter[str] = collections.Counter()
    acknowledged: dict[str, bytes] = {}
    errors: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    stop = threading.Event()

    def requests(worker: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            key = f"w{worker}-{n}"
            try:
                ticket = ledger.begin("acct", key, "POST", "/orders", {}, BODY)
            except StorageError as exc:  # a 503: nothing ran
                with lock:
                    errors[f"begin: {type(exc).__name__}"] += 1
                continue
            assert isinstance(ticket, Ticket)
            with lock:
                runs[key] += 1
                run = runs[key]
            time.sleep(0.002)  # the mutation: the claim's connection idles in the pool meanwhile
            body = f'{{"key":"{key}","run":{run}}}'.encode()
            try:
                answer = ledger.finish(ticket, 201, HEADERS, body)
            except AnswerNotStoredError as exc:  # the adapters send it anyway
                with lock:
                    errors["finish: AnswerNotStoredError"] += 1
                answer = exc.answer
            with lock:
                acknowledged[key] = answer.body

    def operator() -> None:
        while not stop.wait(pause_s):
            with contextlib.suppress(Exception):
                admin.end(admin.ledger_connections(), wait=False)
                with lock:
                    errors["ended connections"] += 1

    threads = [threading.Thread(target=requests, args=(i,)) for i in range(workers)]
    threads.append(threading.Thread(target=operator))
    with caplog.at_level("WARNING", logger="idemctl"):
        for thread in threads:
            thread.start()
        time.sleep(storm_s)
        stop.set()
        for thread in threads:
            thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    stored_again = sum("done on a fresh connection" in r.getMessage() for r in caplog.records)

    clock.advance(ledger.policy.pending_ttl_ms + 1)
    ran_again, replayed_otherwise = [], []
    for key, body in acknowledged.items():
        retry = ledger.begin("acct", key, "POST", "/orders", {}, BODY)
        if isinstance(retry, Ticket):
            ran_again.append(key)
            ledger.abandon(retry)
        elif retry.body != body:
            replayed_otherwise.append(key)
    summary = f"{len(acknowledged)} acknowledged, {stored_again} stored again, {dict(errors)}"
    assert len(acknowledged) > 100 and errors["ended connections"] > 10, summary
    # The storm did reach completions: some were stored on a fresh connection.
    assert stored_again > 0, summary
    assert ran_again == [] and replayed_otherwise == [], summary
    assert errors["finish: AnswerNotStoredError"] == 0, summary
    assert max(runs.values()) == 1
