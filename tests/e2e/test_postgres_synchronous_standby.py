"""A synchronous standby that goes away, on a real primary and streaming
standby started from the installed binaries (bench/replica.py).

PostgreSQL then holds every commit until a standby acknowledges it, inside
the commit and past any statement_timeout. The ledger bounds that wait with
its commit timeout: a request fails closed with 503 and Retry-After, a
completion whose commit was never acknowledged is not reported stored, and
what each step leaves on the primary is what the contract says once the
standby is back (a claim a pending reservation: 409, then a takeover; a
released claim gone; an unacknowledged completion replayed).

Without the bound every one of these tests hangs in its first request that
writes and fails on the timeout below."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from bench.common import REQUEST_PRINCIPAL, wsgi_environ
from bench.replica import ReplicaPair
from idemctl import Answer, AnswerNotStoredError, Ledger, Outcome, Policy, Ticket
from idemctl.asgi import IdempotencyMiddleware as AsgiMiddleware
from idemctl.errors import CommitTimeoutError
from idemctl.wsgi import IdempotencyMiddleware as WsgiMiddleware
from tests.helpers import FakeClock, asgi_exchange, post_scope, skip_or_fail

pytest.importorskip("idemctl.storage.postgres", reason="these tests need the postgres extra")

# The bound, and what a shared, busy machine may add to it (the cancel's
# round trip, the scheduler): generous, since without the bound the wait
# has no end at all.
COMMIT_TIMEOUT_S = 1.0
SLACK_S = 4.0
TTL_MS = 2000

# The module's servers are started once: its tests stay on one worker.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(60), pytest.mark.xdist_group("test_postgres_synchronous_standby")]

JSON = {"content-type": "application/json"}


def _require_pair() -> None:
    skip_or_fail(ReplicaPair.unavailable(), "CI runs the synchronous standby tests")


@pytest.fixture(scope="module")
def sync_pair() -> Iterator[ReplicaPair]:
    _require_pair()
    with ReplicaPair.start(synchronous=True) as started:
        with Ledger.open(started.url()) as ledger:
            ledger.init()
        yield started


@pytest.fixture
def pair(sync_pair: ReplicaPair) -> Iterator[ReplicaPair]:
    """The module's pair with its synchronous standby streaming, at the
    start and again at the end of the test."""
    if not sync_pair.standby_running():
        sync_pair.start_standby()
    sync_pair.wait_streaming()
    yield sync_pair
    if not sync_pair.standby_running():
        sync_pair.start_standby()


@pytest.fixture
def clock() -> FakeClock:
    """The ledger's clock: a reservation turns stale when a test says so,
    however long the standby took to stop and start."""
    return FakeClock()


@pytest.fixture
def ledger(pair: ReplicaPair, clock: FakeClock) -> Iterator[Ledger]:
    url = pair.url(query=f"commit_timeout={COMMIT_TIMEOUT_S:g}")
    with Ledger.open(url, policy=Policy(pending_ttl_ms=TTL_MS), clock=clock) as opened:
        yield opened


def rows(pair: ReplicaPair, port: int, prefix: str) -> list[tuple[Any, ...]]:
    return pair.sql(
        port,
        "SELECT key, status, generation, response_status FROM idempotency_keys "
        f"WHERE key LIKE '{prefix}%' ORDER BY key",
    )


def within_the_bound(elapsed: float) -> bool:
    """Ended by the commit timeout: not before it, and not long after."""
    return COMMIT_TIMEOUT_S - 0.05 <= elapsed < COMMIT_TIMEOUT_S + SLACK_S


def timed(call: Callable[[], Any]) -> tuple[Any, float]:
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started


def wsgi_post(app: WsgiMiddleware, key: str) -> tuple[str, dict[str, str], bytes, float]:
    seen: dict[str, Any] = {}

    def start_response(status, headers, exc_info=None):  # type: ignore[no-untyped-def]
        seen["status"], seen["headers"] = status, dict(headers)

    started = time.monotonic()
    answer = app(wsgi_environ(key), start_response)
    try:
        body = b"".join(answer)
    finally:
        answer.close()  # as a server does: the post-response sweep runs here
    return seen["status"], seen["headers"], body, time.monotonic() - started


def wait_out_the_ttl(clock: FakeClock) -> None:
    clock.advance(TTL_MS + 1)


# -- WSGI ----------------------------------------------------------------------------------


def test_with_the_standby_gone_a_wsgi_post_gets_503_within_the_bound_and_its_retry_409_then_a_takeover(
    pair: ReplicaPair, ledger: Ledger, clock: FakeClock
) -> None:
    ran: list[str] = []

    def orders(environ, start_response):  # type: ignore[no-untyped-def]
        ran.append(environ["HTTP_IDEMPOTENCY_KEY"])
        start_response("201 Created", [("content-type", "application/json")])
        return [b'{"id": 1}']

    app = WsgiMiddleware(orders, ledger, principal=lambda env: env.get("REMOTE_USER"))
    assert wsgi_post(app, "w-before")[0] == "201 Created"
    pair.stop_standby()

    status, headers, body, elapsed = wsgi_post(app, "w-during")
    assert (status, headers["retry-after"]) == ("503 Service Unavailable", "1")
    assert b"idempotency_ledger_unavailable" in body
    assert within_the_bound(elapsed), elapsed
    assert ran == ["w-before"]
    # The claim committed on the primary, unacknowledged: a reservation
    # nobody runs, which the standby will receive once it is back.
    assert rows(pair, pair.primary_port, "w-") == [("w-before", "completed", 1, 201), ("w-during", "pending", 1, None)]
    # Reads need no standby: the retry is told the key is in progress, and
    # an acknowledged answer replays.
    status, headers, body, _ = wsgi_post(app, "w-during")
    assert (status, headers["retry-after"]) == ("409 Conflict", "2")
    assert b"idempotency_key_in_progress" in body
    assert wsgi_post(app, "w-before")[:3:2] == ("201 Created", b'{"id": 1}')

    pair.start_standby()
    pair.wait_caught_up()
    assert rows(pair, pair.standby_port, "w-") == [("w-before", "completed", 1, 201), ("w-during", "pending", 1, None)]
    wait_out_the_ttl(clock)
    status, _, body, _ = wsgi_post(app, "w-during")
    assert (status, body) == ("201 Created", b'{"id": 1}')
    assert ran == ["w-before", "w-during"]
    assert wsgi_post(app, "w-during")[0] == "201 Created"
    assert ran == ["w-before", "w-during"]
    assert rows(pair, pair.primary_port, "w-during") == [("w-during", "completed", 2, 201)]


def test_a_completion_no_standby_acknowledged_is_not_reported_stored_and_replays_once_the_standby_is_back(
    pair: ReplicaPair, ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    ran: list[str] = []
    events: list[Outcome] = []
    ledger.subscribe(lambda event: events.append(event.outcome))

    def orders(environ, start_response):  # type: ignore[no-untyped-def]
        ran.append(environ["HTTP_IDEMPOTENCY_KEY"])
        pair.stop_standby()  # after the claim was acknowledged, before the completion
        start_response("201 Created", [("content-type", "application/json")])
        return [b'{"id": 2}']

    app = WsgiMiddleware(orders, ledger, principal=lambda env: env.get("REMOTE_USER"))
    with caplog.at_level(logging.ERROR, logger="idemctl"):
        status, _, body, elapsed = wsgi_post(app, "c-key")
    # The app's own answer (the contract's answer when storing failed after
    # the mutation ran), never a 503 that invites running it again.
    assert (status, body) == ("201 Created", b'{"id": 2}')
    assert elapsed < COMMIT_TIMEOUT_S + SLACK_S
    assert events == [Outcome.NOT_STORED]
    (line,) = [r.getMessage() for r in caplog.records if "could not be stored" in r.getMessage()]
    assert "did not commit within the commit timeout (1 s)" in line
    assert "may be committed on the primary without a standby's copy" in line
    # The cancelled wait left the completion committed on the primary alone.
    assert rows(pair, pair.primary_port, "c-") == [("c-key", "completed", 1, 201)]
    assert wsgi_post(app, "c-key")[:3:2] == ("201 Created", b'{"id": 2}')

    pair.start_standby()
    pair.wait_caught_up()
    assert rows(pair, pair.standby_port, "c-") == [("c-key", "completed", 1, 201)]
    assert wsgi_post(app, "c-key")[:3:2] == ("201 Created", b'{"id": 2}')
    assert ran == ["c-key"]
    assert events == [Outcome.NOT_STORED, Outcome.REPLAYED, Outcome.REPLAYED]


# -- ASGI: the asynchronous engine -----------------------------------------------------------


async def asgi_post(app: AsgiMiddleware, key: str) -> tuple[int, dict[bytes, bytes], bytes, float]:
    started = time.monotonic()
    sent = await asgi_exchange(app, post_scope(key))
    elapsed = time.monotonic() - started
    return sent[0]["status"], dict(sent[0]["headers"]), b"".join(m.get("body", b"") for m in sent[1:]), elapsed


def test_with_the_standby_gone_the_asgi_path_answers_503_within_the_bound_and_never_reports_a_completion_stored(
    pair: ReplicaPair, ledger: Ledger
) -> None:
    ran: list[str] = []
    stop_during: set[str] = {"a-completion"}

    async def orders(scope, receive, send):  # type: ignore[no-untyped-def]
        key = dict(scope["headers"])[b"idempotency-key"].decode()
        ran.append(key)
        if key in stop_during:
            await asyncio.to_thread(pair.stop_standby)
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"id": 3}'})

    app = AsgiMiddleware(orders, ledger, principal=lambda scope: REQUEST_PRINCIPAL)

    async def while_the_standby_is_gone() -> None:
        await asyncio.to_thread(pair.stop_standby)
        status, headers, body, elapsed = await asgi_post(app, "a-claim")
        assert (status, headers[b"retry-after"]) == (503, b"1")
        assert b"idempotency_ledger_unavailable" in body
        assert within_the_bound(elapsed), elapsed
        await asyncio.to_thread(pair.start_standby)
        status, _, body, elapsed = await asgi_post(app, "a-completion")
        assert (status, body) == (201, b'{"id": 3}')  # the app's answer: not stored, never a 503
        assert elapsed < COMMIT_TIMEOUT_S + SLACK_S
        await ledger.aclose()  # as the app's lifespan shutdown does

    asyncio.run(while_the_standby_is_gone())
    assert ran == ["a-completion"]
    assert rows(pair, pair.primary_port, "a-") == [
        ("a-claim", "pending", 1, None),
        ("a-completion", "completed", 1, 201),
    ]

    pair.start_standby()
    pair.wait_caught_up()

    async def once_it_is_back() -> list[tuple[int, bytes]]:
        answers = [await asgi_post(app, key) for key in ("a-claim", "a-completion", "a-new")]
        await ledger.aclose()
        return [(status, body) for status, _, body, _ in answers]

    assert asyncio.run(once_it_is_back()) == [
        (409, b'{"error":"idempotency_key_in_progress","retry_after_ms":2000}'),
        (201, b'{"id": 3}'),
        (201, b'{"id": 3}'),
    ]
    assert ran == ["a-completion", "a-new"]


# -- the library: begin, finish, abandon, handle, takeover -----------------------------------


def test_with_the_standby_gone_every_ledger_step_that_writes_fails_within_the_bound_and_leaves_what_the_contract_says(
    pair: ReplicaPair, ledger: Ledger, clock: FakeClock
) -> None:
    ran: list[str] = []

    def order(body: bytes) -> tuple[int, dict[str, str], bytes]:
        ran.append("ran")
        return 201, JSON, b'{"id": 4}'

    def handle(key: str) -> Answer:
        return ledger.handle("acct", key, "POST", "/orders", {}, b"{}", order)

    def begin(key: str) -> Answer | Ticket:
        return ledger.begin("acct", key, "POST", "/orders", {}, b"{}")

    def fails_within_the_bound(error: type[Exception], call: Callable[[], object]) -> Any:
        started = time.monotonic()
        with pytest.raises(error) as raised:
            call()
        elapsed = time.monotonic() - started
        assert within_the_bound(elapsed), elapsed
        return raised.value

    to_finish, to_release, dies = begin("l-finish"), begin("l-release"), begin("l-takeover")
    assert isinstance(to_finish, Ticket) and isinstance(to_release, Ticket) and isinstance(dies, Ticket)
    assert handle("l-stale").status == 201
    wait_out_the_ttl(clock)  # the owner of l-takeover never came back: its reservation is stale
    pair.stop_standby()

    error = fails_within_the_bound(CommitTimeoutError, lambda: handle("l-handle"))
    assert "did not commit within the commit timeout (1 s)" in str(error)
    assert error.timeout_s == COMMIT_TIMEOUT_S
    fails_within_the_bound(CommitTimeoutError, lambda: begin("l-begin"))
    fails_within_the_bound(CommitTimeoutError, lambda: handle("l-takeover"))
    not_stored = fails_within_the_bound(AnswerNotStoredError, lambda: ledger.finish(to_finish, 201, JSON, b'{"id": 5}'))
    assert isinstance(not_stored.cause, CommitTimeoutError)
    assert (not_stored.answer.status, not_stored.answer.body) == (201, b'{"id": 5}')
    started = time.monotonic()
    ledger.abandon(to_release, release=True)  # never raises: a failed release is logged
    assert within_the_bound(time.monotonic() - started)
    assert ran == ["ran"]  # l-stale's, before the standby went

    # Each step committed on the primary alone: the claims and the takeover
    # are reservations nobody runs, the release removed its row, the
    # completion is there.
    left = [
        ("l-begin", "pending", 1, None),
        ("l-finish", "completed", 1, 201),
        ("l-handle", "pending", 1, None),
        ("l-stale", "completed", 1, 201),
        ("l-takeover", "pending", 2, None),
    ]
    assert rows(pair, pair.primary_port, "l-") == left
    pair.start_standby()
    pair.wait_caught_up()
    assert rows(pair, pair.standby_port, "l-") == left

    # Once the standby is back: reservations are in progress until the TTL,
    # the released key and a new one run, acknowledged answers replay.
    answers = [handle(key) for key in ("l-handle", "l-takeover", "l-release", "l-new", "l-stale", "l-finish")]
    assert [(a.status, a.outcome) for a in answers] == [
        (409, Outcome.IN_PROGRESS),
        (409, Outcome.IN_PROGRESS),
        (201, Outcome.EXECUTED),
        (201, Outcome.EXECUTED),
        (201, Outcome.REPLAYED),
        (201, Outcome.REPLAYED),
    ]
    assert answers[-1].body == b'{"id": 5}'
    wait_out_the_ttl(clock)
    assert [(a.outcome, a.generation) for a in map(handle, ("l-handle", "l-takeover", "l-begin"))] == [
        (Outcome.TAKEN_OVER, 2),
        (Outcome.TAKEN_OVER, 3),
        (Outcome.TAKEN_OVER, 2),
    ]
    assert len(ran) == 1 + 2 + 3
