"""The request sequence on its own, driven with a fake door (no framework):
every branch of the contract answered exactly; and no door decides the
ledger's steps itself (begin, finish, abandon are the sequence's)."""

from __future__ import annotations

import ast
import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import idemctl
from idemctl import Ledger, Outcome
from idemctl.errors import AnswerNotStoredError, LedgerUnavailableError
from idemctl.exchange.body import BodyRefused, ClientGone, incomplete
from idemctl.exchange.drive import LATER, Later, drive, drive_async
from idemctl.exchange.gate import Delivery, Gate, LazyGate
from idemctl.exchange.sequence import Request, Run, sequence
from idemctl.outcomes import Answer

JSON = (("content-type", "application/json"),)
KEY_REPEATED = (
    400,
    JSON,
    b'{"error":"idempotency_key_invalid","message":"Send exactly one Idempotency-Key: several fields, '
    b'or a comma outside a quoted key, are a list."}',
)
UNAUTHENTICATED = (401, JSON, b'{"error":"unauthenticated","message":"No authenticated principal for this request."}')
LENGTH_INVALID = (
    400,
    JSON,
    b'{"error":"content_length_invalid","message":"Content-Length must be a non-negative decimal integer."}',
)
TOO_LARGE = (
    413,
    JSON,
    b'{"error":"request_body_too_large","message":"The request body exceeds 8 bytes.","limit_bytes":8}',
)
LENGTH_REQUIRED = (
    411,
    JSON,
    b'{"error":"content_length_required","message":"A request body needs a Content-Length header."}',
)
INCOMPLETE = (
    400,
    JSON,
    b'{"error":"request_body_incomplete","message":"The request body ended before Content-Length bytes arrived."}',
)
UNAVAILABLE = (
    503,
    (("content-type", "application/json"), ("retry-after", "1")),
    b'{"error":"idempotency_ledger_unavailable","message":"The idempotency ledger is unavailable; retry later."}',
)
MADE = (201, (("content-type", "text/plain"),), b"made")


class FakeDoor:
    """A door with no framework: it records what the sequence asked of it."""

    def __init__(
        self,
        *,
        principal: object = "acct_1",
        body: bytes | BaseException = b"{}",
        app: Callable[[Run], object] | None = None,
        exempt: bool = False,
        key_optional: bool = False,
        release: bool = False,
    ) -> None:
        self.who = principal
        self.body = body
        self.app = app
        self.is_exempt = exempt
        self.is_key_optional = key_optional
        self.releases = release
        self.asked: list[str] = []
        self.runs = 0
        self.after: object = None

    def exempt(self) -> bool:
        return self.is_exempt

    def key_optional(self) -> bool:
        return self.is_key_optional

    def release(self) -> bool:
        return self.releases

    def principal(self) -> object:
        self.asked.append("principal")
        return self.who

    def read_body(self, limit: int, declared: int | None) -> bytes:
        self.asked.append(f"body {limit} {declared}")
        if isinstance(self.body, BaseException):
            raise self.body
        return self.body

    def run(self, need: Run) -> object:
        self.asked.append("run")
        self.runs += 1
        if self.app is not None:
            return self.app(need)
        need.capture.start(201, [("content-type", "text/plain")])
        need.capture.add(b"made")
        return None

    def send(self, delivery: Delivery, after: object) -> tuple[int, tuple[tuple[str, str], ...], bytes, Outcome]:
        self.asked.append("send")
        self.after = after
        answer = delivery.answer
        return answer.status, answer.headers, answer.body, answer.outcome

    def pass_through(self) -> str:
        self.asked.append("pass")
        return "passed through"


@pytest.fixture
def gate() -> Gate:
    ledger = Ledger.open(":memory:")
    ledger.init()
    return Gate(ledger, max_body_bytes=8)


def post(key: str | None = "k1", **fields: Any) -> Request:
    values: dict[str, Any] = {
        "method": "POST",
        "target": "/orders",
        "key_fields": () if key is None else (key,),
        "headers": (),
        "content_length": "2",
        "unbounded": False,
    }
    values.update(fields)
    return Request(**values)


def exchange(gate: Gate, request: Request, door: FakeDoor) -> Any:
    return drive(gate, sequence(gate, request, door), door)


def test_an_unprotected_method_passes_through_and_nothing_else_is_asked(gate):
    door = FakeDoor()
    assert exchange(gate, post(method="GET"), door) == "passed through"
    assert door.asked == ["pass"]


def test_an_exempt_request_passes_through(gate):
    door = FakeDoor(exempt=True)
    assert exchange(gate, post(), door) == "passed through"
    assert door.asked == ["pass"]


def test_key_optional_lets_only_a_keyless_request_through(gate):
    keyless, keyed = FakeDoor(key_optional=True), FakeDoor(key_optional=True)
    assert exchange(gate, post(key=None), keyless) == "passed through"
    assert exchange(gate, post(), keyed) == (*MADE, Outcome.EXECUTED)
    assert (keyless.asked, keyed.asked) == (["pass"], ["principal", "body 8 2", "run", "send"])


def test_two_key_fields_are_400_before_the_principal_is_asked(gate):
    door = FakeDoor()
    assert exchange(gate, post(key_fields=("k1", "k2")), door) == (*KEY_REPEATED, Outcome.KEY_INVALID)
    assert door.asked == ["send"]


def test_no_principal_is_401_and_the_body_is_never_read(gate):
    door = FakeDoor(principal=None)
    assert exchange(gate, post(), door) == (*UNAUTHENTICATED, Outcome.UNAUTHENTICATED)
    assert door.asked == ["principal", "send"]


def test_a_principal_that_is_not_a_string_is_the_auth_layers_bug(gate):
    with pytest.raises(TypeError, match="principal\\(\\) must return str or None, got int"):
        exchange(gate, post(), FakeDoor(principal=7))


@pytest.mark.parametrize(
    ("fields", "body", "refusal", "asked"),
    [
        ({"content_length": "two"}, b"{}", LENGTH_INVALID, ["principal", "send"]),
        ({"content_length": "9"}, b"{}", TOO_LARGE, ["principal", "send"]),
        ({"content_length": None, "unbounded": True}, b"{}", LENGTH_REQUIRED, ["principal", "send"]),
        ({"content_length": None}, b"123456789", TOO_LARGE, ["principal", "body 8 None", "send"]),
        ({"content_length": "4"}, b"{}", INCOMPLETE, ["principal", "body 8 4", "send"]),
        ({}, incomplete(), INCOMPLETE, ["principal", "body 8 2", "send"]),
    ],
    ids=["content-length-not-a-number", "declared-over-limit", "unbounded", "read-over-limit", "cut-short", "door"],
)
def test_a_body_that_cannot_be_read_safely_is_refused_and_nothing_is_claimed(gate, fields, body, refusal, asked):
    door = FakeDoor(body=body)
    assert exchange(gate, post(**fields), door) == (*refusal, Outcome.BODY_REFUSED)
    assert door.asked == asked
    assert gate.ledger.lookup("acct_1", "k1") is None


def test_a_client_gone_mid_body_gets_nothing_and_claims_nothing(gate, caplog):
    door = FakeDoor(body=ClientGone())
    with caplog.at_level(logging.INFO, logger="idemctl.gate"):
        assert exchange(gate, post(), door) is None
    assert door.asked == ["principal", "body 8 2"]
    assert [r.getMessage() for r in caplog.records] == [
        "client disconnected before its request body was complete; nothing was claimed"
    ]
    assert gate.ledger.lookup("acct_1", "k1") is None


def test_the_first_request_runs_once_its_retry_replays_and_another_body_is_409(gate):
    first, again, other = FakeDoor(), FakeDoor(), FakeDoor(body=b"[]")
    assert exchange(gate, post(), first) == (*MADE, Outcome.EXECUTED)
    assert exchange(gate, post(), again) == (*MADE, Outcome.REPLAYED)
    status, _, body, outcome = exchange(gate, post(), other)
    assert (status, outcome) == (409, Outcome.REUSED)
    assert body.startswith(b'{"error":"idempotency_key_reused"')
    assert (first.runs, again.runs, other.runs) == (1, 0, 0)
    assert again.asked == ["principal", "body 8 2", "send"]


def test_an_unavailable_ledger_fails_closed_with_503(gate, monkeypatch):
    def down(*args: object) -> None:
        raise LedgerUnavailableError("down for the test")

    monkeypatch.setattr(gate.ledger, "begin_steps", down)
    door = FakeDoor()
    assert exchange(gate, post(), door) == (*UNAVAILABLE, Outcome.UNAVAILABLE)
    assert door.runs == 0


@pytest.mark.parametrize(("release", "left"), [(False, "pending"), (True, None)])
def test_an_app_that_raises_abandons_or_releases_and_the_error_propagates(gate, release, left):
    def fails(need: Run) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        exchange(gate, post(), FakeDoor(app=fails, release=release))
    row = gate.ledger.lookup("acct_1", "k1")
    assert (row.status.value if row else None) == left


def test_an_answer_that_cannot_be_stored_is_sent_anyway_with_an_error_line(gate, monkeypatch, caplog):
    def not_stored(ticket: object, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        answer = Answer(status, tuple(headers), body, Outcome.NOT_STORED)
        raise AnswerNotStoredError(answer, LedgerUnavailableError("gone"))

    monkeypatch.setattr(gate.ledger, "finish_steps", not_stored)
    door = FakeDoor()
    with caplog.at_level(logging.ERROR, logger="idemctl.gate"):
        assert exchange(gate, post(), door) == (*MADE, Outcome.NOT_STORED)
    assert door.after is None  # no sweep after a ledger that just failed
    assert [r.getMessage() for r in caplog.records] == [
        "principal=acct_1 key=k1: the mutation ran but its answer (status 201) could not be stored: gone — "
        "the reservation stays pending and a retry after the TTL will run it again"
    ]


def test_a_door_whose_framework_runs_the_app_later_resumes_the_sequence(gate):
    door = FakeDoor(app=lambda need: LATER)
    later = exchange(gate, post(), door)
    assert isinstance(later, Later) and door.asked == ["principal", "body 8 2", "run"]
    later.run.capture.start(202, [])
    later.run.capture.add(b"later")
    assert drive(gate, later.steps, door) == (202, (), b"later", Outcome.EXECUTED)
    assert gate.ledger.lookup("acct_1", "k1").status.value == "completed"


def test_a_door_resumed_with_the_apps_failure_abandons(gate):
    later = exchange(gate, post(), FakeDoor(app=lambda need: LATER))
    with pytest.raises(KeyError):
        drive(gate, later.steps, FakeDoor(), KeyError("view"))
    assert gate.ledger.lookup("acct_1", "k1").status.value == "pending"


class AsyncFakeDoor:
    """The fake door on an event loop; `keep` set: the app runs shielded."""

    def __init__(self, app: Callable[[Run], Awaitable[None]], shielded: bool) -> None:
        self.app = app
        self.kept: list[asyncio.Future[Any]] = []
        self.shielded = shielded
        self.sent: list[int] = []

    @property
    def in_thread(self) -> Callable[..., Awaitable[Any]]:
        return asyncio.to_thread

    @property
    def keep(self) -> Callable[[asyncio.Future[Any]], None] | None:
        return self.kept.append if self.shielded else None

    def exempt(self) -> bool:
        return False

    def key_optional(self) -> bool:
        return False

    def release(self) -> bool:
        return False

    async def principal(self) -> object:
        return "acct_1"

    async def read_body(self, limit: int, declared: int | None) -> bytes:
        return b"{}"

    async def run(self, need: Run) -> None:
        await self.app(need)

    async def send(self, delivery: Delivery, after: object) -> int:
        self.sent.append(delivery.answer.status)
        return delivery.answer.status

    async def pass_through(self) -> None:
        raise AssertionError("not a pass-through")


def test_a_request_cancelled_mid_app_still_stores_its_answer_when_shielded(gate):
    started, proceed = asyncio.Event(), asyncio.Event()

    async def slow(need: Run) -> None:
        started.set()
        await proceed.wait()
        need.capture.start(201, [])
        need.capture.add(b"late")

    async def scenario() -> None:
        door = AsyncFakeDoor(slow, shielded=True)
        request = asyncio.ensure_future(drive_async(gate, sequence(gate, post(), door), door))
        await started.wait()
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        proceed.set()
        await asyncio.gather(*door.kept)
        assert door.sent == []

    asyncio.run(scenario())
    row = gate.ledger.lookup("acct_1", "k1")
    assert (row.status.value, row.response_status, row.body_bytes) == ("completed", 201, b"late")


def test_a_lazily_opened_ledger_is_asked_of_its_source_on_every_request(gate):
    # Django's gate: the ledger opened once per process, asked for each
    # request (a forked worker opens its own), never held by the gate.
    other = Ledger.open(":memory:")
    other.init()
    ledgers = [gate.ledger, gate.ledger, other, other]
    lazy = LazyGate(lambda: ledgers.pop(0), max_body_bytes=8)
    first, again = FakeDoor(), FakeDoor()
    assert exchange(lazy, post(), first) == (*MADE, Outcome.EXECUTED)
    assert exchange(lazy, post(), again) == (*MADE, Outcome.EXECUTED)  # on the other ledger: run there
    assert (first.runs, again.runs, ledgers) == (1, 1, [])
    assert gate.ledger.lookup("acct_1", "k1").status.value == "completed"
    assert other.lookup("acct_1", "k1").status.value == "completed"
    assert type(Gate(gate.ledger)) is Gate and isinstance(lazy, Gate)


def test_a_sequence_closed_while_its_app_was_due_abandons_nothing(gate):
    # A driver that releases a cancelled request's claim itself closes the
    # sequence: it must not abandon the reservation a second time.
    seen: list[Outcome] = []
    gate.ledger.subscribe(lambda event: seen.append(event.outcome))
    door = FakeDoor(app=lambda need: LATER)
    later = exchange(gate, post(), door)
    assert isinstance(later, Later)
    later.steps.close()
    assert seen == []  # no FAILED event: nothing was abandoned
    assert gate.ledger.lookup("acct_1", "k1").status.value == "pending"
    assert door.asked == ["principal", "body 8 2", "run"]


# -- no door decides the ledger's steps itself ------------------------------------------
DOORS = ["wsgi.py", "asgi.py", "fastapi.py", "flask.py", "django/exchange.py", "django/middleware.py", "django/drf.py"]
LEDGER_STEPS = frozenset(
    {"begin", "begin_async", "begin_steps", "finish", "finish_async", "finish_steps", "abandon", "abandon_async"}
    | {"abandon_steps"}
)


def ledger_steps_called(source: str) -> list[str]:
    """The begin/finish/abandon calls (gate's or ledger's, any form) in a module's source."""
    return sorted(
        node.func.attr
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LEDGER_STEPS
    )


def test_no_door_calls_begin_finish_or_abandon_itself():
    package = Path(idemctl.__file__).parent
    assert {door: ledger_steps_called((package / door).read_text(encoding="utf-8")) for door in DOORS} == {
        door: [] for door in DOORS
    }


def test_the_door_check_finds_a_door_that_calls_the_gate():
    source = "def view(gate, ticket, capture):\n    gate.finish(ticket, capture)\n    self.gate.abandon_async(t)\n"
    assert ledger_steps_called(source) == ["abandon_async", "finish"]


def test_body_refused_is_an_exception_carrying_its_answer():
    assert BodyRefused(LENGTH_REQUIRED).refusal == LENGTH_REQUIRED
