"""Idempotent functions (`Ledger.idempotent`, `Ledger.idempotent_call`), one
rule at a time, on every storage backend, with a fake clock."""

from __future__ import annotations

import asyncio
import dataclasses
import decimal
import functools
import inspect
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from typer.testing import CliRunner

from idemctl import CallInProgressError, IdemctlError, KeyReusedError, Outcome, Policy, State, Status
from idemctl.call_values import call_fingerprint, canonical_json
from idemctl.cli import app
from idemctl.errors import (
    InvalidKeyError,
    InvalidPrincipalError,
    MalformedRowError,
    ResultNotSerializableError,
    ResultNotStoredError,
    ResultTooLargeError,
    UnserializableArgumentsError,
)
from tests.helpers import clean_env, wrap_store_run

TTL = Policy().pending_ttl_ms


def payment(pid: str = "pay_1", amount: int = 500, **extra: object) -> dict[str, object]:
    return {"id": pid, "amount": amount, "currency": "EUR", **extra}


@pytest.fixture
def charges(ledger):
    """A decorated `charge` that records each run, and the list of runs."""
    runs: list[dict[str, object]] = []

    @ledger.idempotent(key=lambda p: p["id"], principal="billing")
    def charge(p):
        runs.append(p)
        return {"charge": len(runs), "amount": p["amount"]}

    return charge, runs


# -- replay, reuse, in progress -------------------------------------------------------------
def test_first_call_runs_and_a_repeat_with_the_same_arguments_replays_without_running(ledger, charges):
    charge, runs = charges
    assert charge(payment()) == {"charge": 1, "amount": 500}
    assert charge(payment()) == {"charge": 1, "amount": 500}
    assert len(runs) == 1
    row = ledger.lookup("billing", "pay_1")
    assert (row.status, row.generation, row.response_status, row.response_body) == (
        Status.COMPLETED,
        1,
        200,
        '{"charge":1,"amount":500}',
    )


def test_the_first_caller_gets_the_value_as_stored_so_it_equals_every_replay(ledger):
    @ledger.idempotent(key="one-tuple", principal="billing")
    def pair():
        return (1, "two")

    assert pair() == [1, "two"]  # JSON has arrays, not tuples: the first caller sees what replays see
    assert pair() == [1, "two"]


def test_same_arguments_built_in_another_dict_order_replay(ledger, charges):
    charge, runs = charges
    first = charge({"id": "pay_1", "amount": 500, "meta": {"a": 1, "b": 2}})
    again = charge({"meta": {"b": 2, "a": 1}, "amount": 500, "id": "pay_1"})
    assert first == again == {"charge": 1, "amount": 500}
    assert len(runs) == 1


def test_same_key_with_other_arguments_raises_key_reused_and_neither_runs_nor_replays(ledger, charges):
    charge, runs = charges
    charge(payment(amount=500))
    with pytest.raises(KeyReusedError) as caught:
        charge(payment(amount=900))
    assert isinstance(caught.value, IdemctlError)
    assert (caught.value.principal, caught.value.key) == ("billing", "pay_1")
    assert len(runs) == 1
    assert ledger.lookup("billing", "pay_1").response_body == '{"charge":1,"amount":500}'


def test_a_duplicate_while_the_first_runs_raises_in_progress_with_the_time_until_a_takeover(ledger, clock):
    seen: list[CallInProgressError] = []

    @ledger.idempotent(key="pay_1", principal="billing")
    def charge(amount):
        for elapsed in (0, 10_000):
            clock.advance(elapsed)
            with pytest.raises(CallInProgressError) as caught:
                charge(amount)
            seen.append(caught.value)
        return {"amount": amount}

    assert charge(500) == {"amount": 500}
    assert [(e.generation, e.retry_after_ms, e.retry_after) for e in seen] == [
        (1, TTL + 1, (TTL + 1) / 1000),
        (1, TTL + 1 - 10_000, (TTL + 1 - 10_000) / 1000),
    ]
    assert isinstance(seen[0], IdemctlError)
    assert charge(500) == {"amount": 500}  # replayed once the first one stored its value


def test_with_the_wait_option_a_duplicate_waits_for_the_first_call_and_gets_its_value(make_ledger):
    ledger = make_ledger(policy=Policy(in_progress_wait_ms=20_000))
    started, release = threading.Event(), threading.Event()
    runs: list[str] = []

    @ledger.idempotent(key="pay_1", principal="billing")
    def charge():
        runs.append("ran")
        started.set()
        release.wait(30)
        return "charged"

    lookups = []

    def counting_lookup(step, run):
        if step == "lookup":
            lookups.append(step)
        return run()

    wrap_store_run(ledger.store, counting_lookup)  # the duplicate's polls read through here
    results: list[tuple[str, str]] = []
    first = threading.Thread(target=lambda: results.append(("first", charge())))
    first.start()
    assert started.wait(30)
    duplicate = threading.Thread(target=lambda: results.append(("duplicate", charge())))
    duplicate.start()
    deadline = time.monotonic() + 30
    while len(lookups) < 2:  # two lookups after its claim (a first look or a poll, then a poll): it is waiting
        assert time.monotonic() < deadline, f"the duplicate never polled: {lookups}"
        time.sleep(0.01)
    release.set()
    first.join(30)
    duplicate.join(30)
    assert sorted(results) == [("duplicate", "charged"), ("first", "charged")]
    assert runs == ["ran"]


def test_with_the_wait_option_a_duplicate_still_raises_in_progress_once_the_wait_is_over(make_ledger):
    ledger = make_ledger(policy=Policy(in_progress_wait_ms=50))
    seen: list[CallInProgressError] = []

    @ledger.idempotent(key="pay_1", principal="billing")
    def charge():
        if not seen:
            with pytest.raises(CallInProgressError) as caught:
                charge()  # a duplicate while this one runs: it waits, then gives up
            seen.append(caught.value)
        return "charged"

    assert charge() == "charged"
    assert [e.retry_after_ms for e in seen] == [TTL + 1]


def test_a_call_that_runs_sweeps_rows_past_retention_as_a_request_does(ledger, clock, charges):
    charge, _ = charges
    charge(payment("pay_old"))
    clock.advance(ledger.policy.retention_ms + 1)
    charge(payment("pay_new"))
    assert ledger.lookup("billing", "pay_old") is None
    assert ledger.lookup("billing", "pay_new").status is Status.COMPLETED


# -- failures ---------------------------------------------------------------------------------
class Declined(Exception):
    pass


def failing_once(runs: list[int], error: Exception) -> Callable[[int], dict[str, int]]:
    """A charge that raises `error` on its first run, then charges; each run's amount goes to `runs`."""

    def charge(amount: int) -> dict[str, int]:
        runs.append(amount)
        if len(runs) == 1:
            raise error
        return {"amount": amount}

    return charge


def test_an_exception_leaves_the_reservation_pending_and_a_repeat_after_the_ttl_takes_it_over(ledger, clock):
    runs: list[int] = []
    charge = ledger.idempotent(key="pay_1", principal="billing")(
        failing_once(runs, ConnectionError("provider timed out"))
    )

    with pytest.raises(ConnectionError):
        charge(500)
    view = ledger.operator.get("billing", "pay_1")
    assert (view.row.status, view.row.generation, view.state) == (Status.PENDING, 1, State.PENDING_FRESH)
    with pytest.raises(CallInProgressError):
        charge(500)
    assert runs == [500]
    clock.advance(TTL + 1)
    assert charge(500) == {"amount": 500}
    assert runs == [500, 500]
    row = ledger.lookup("billing", "pay_1")
    assert (row.status, row.generation, row.response_body) == (Status.COMPLETED, 2, '{"amount":500}')
    assert ledger.operator.stats().taken_over == 1


def test_release_on_error_deletes_the_reservation_so_a_repeat_runs_at_once(ledger):
    runs: list[int] = []
    charge = ledger.idempotent(key="pay_1", principal="billing", release_on_error=True)(
        failing_once(runs, Declined("card declined"))
    )

    with pytest.raises(Declined):
        charge(500)
    assert ledger.lookup("billing", "pay_1") is None
    assert charge(500) == {"amount": 500}
    assert runs == [500, 500]
    assert ledger.lookup("billing", "pay_1").generation == 1


def test_release_on_error_predicate_releases_only_the_exceptions_it_accepts(ledger):
    @ledger.idempotent(
        key=lambda k, exc: k, principal="billing", args=["k"], release_on_error=lambda e: isinstance(e, Declined)
    )
    def charge(k, exc):
        raise exc

    with pytest.raises(Declined):
        charge("declined", Declined("no"))
    with pytest.raises(ConnectionError):
        charge("timed-out", ConnectionError("maybe charged"))
    assert ledger.lookup("billing", "declined") is None
    assert ledger.lookup("billing", "timed-out").status is Status.PENDING


def _fenced_json(target: str, monkeypatch, tmp_path) -> dict:
    clean_env(monkeypatch, tmp_path)
    result = CliRunner().invoke(app, ["fenced", "--json", "--db", target])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_a_late_completion_after_a_takeover_is_fenced_out_recorded_and_shown_by_idemctl_fenced(
    ledger, ledger_target, clock, caplog, monkeypatch, tmp_path
):
    runs: list[str] = []

    @ledger.idempotent(key=lambda who: "pay_1", principal="billing", args=[])
    def charge(who):
        runs.append(who)
        if who == "slow worker":
            # Stalls past the TTL; meanwhile a retry takes the call over and finishes.
            clock.advance(TTL + 1)
            assert charge("fast worker") == {"by": "fast worker"}
        return {"by": who}

    with caplog.at_level(logging.ERROR, logger="idemctl"):
        late = charge("slow worker")
    assert late == {"by": "slow worker"}  # the late caller keeps what it computed
    assert runs == ["slow worker", "fast worker"]
    assert charge("anyone") == {"by": "fast worker"}  # repeats get the stored value, the taker's
    assert any("fenced out" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)

    (event,) = ledger.operator.fenced(principal="billing", key="pay_1")
    assert (event.superseded_generation, event.current_generation, event.computed_status) == (1, 2, 200)
    doc = _fenced_json(ledger_target, monkeypatch, tmp_path)
    assert [
        (e["principal"], e["key"], e["superseded_generation"], e["current_generation"], e["computed_status"])
        for e in doc["events"]
    ] == [("billing", "pay_1", 1, 2, 200)]


def test_the_context_manager_tells_a_late_caller_it_was_fenced_out(ledger, clock):
    first = ledger.idempotent_call(principal="billing", key="pay_1", args={"amount": 500})
    with first:
        clock.advance(TTL + 1)
        with ledger.idempotent_call(principal="billing", key="pay_1", args={"amount": 500}) as taker:
            taker.store({"by": "taker"})
        first.store({"by": "first"})
    assert (first.outcome, first.fenced_out, first.value) == (Outcome.FENCED_OUT, True, {"by": "first"})
    assert (first.event.superseded_generation, first.event.current_generation) == (1, 2)
    assert (taker.outcome, taker.generation, taker.fenced_out) == (Outcome.TAKEN_OVER, 2, False)


# -- values that cannot be stored -----------------------------------------------------------
def test_a_value_over_the_body_cap_raises_too_large_and_repeats_raise_it_without_running(make_ledger):
    ledger = make_ledger(policy=Policy(body_cap_bytes=64))
    runs: list[int] = []

    @ledger.idempotent(key="report-1", principal="reports")
    def report(size):
        runs.append(size)
        return "x" * size

    with pytest.raises(ResultTooLargeError) as first:
        report(100)
    assert (first.value.size, first.value.cap) == (102, 64)  # 100 characters and two quotes
    with pytest.raises(ResultTooLargeError) as again:
        report(100)
    assert (again.value.size, again.value.cap) == (None, 64)
    assert isinstance(again.value, ResultNotStoredError)
    assert runs == [100]
    row = ledger.lookup("reports", "report-1")
    assert (row.status, row.response_status, row.response_body) == (Status.COMPLETED, 500, None)


def test_a_value_at_the_body_cap_is_stored_whole(make_ledger):
    ledger = make_ledger(policy=Policy(body_cap_bytes=64))

    @ledger.idempotent(key="report-1", principal="reports")
    def report():
        return "x" * 62

    assert report() == "x" * 62
    assert report() == "x" * 62


def test_a_value_the_serializer_cannot_write_completes_the_call_and_every_repeat_raises(ledger):
    runs: list[int] = []

    class Receipt:
        pass

    @ledger.idempotent(key="pay_1", principal="billing")
    def charge():
        runs.append(1)
        return Receipt()

    with pytest.raises(ResultNotSerializableError) as first:
        charge()
    with pytest.raises(ResultNotSerializableError) as again:
        charge()
    assert (first.value.type_name, again.value.type_name) == (Receipt.__qualname__, Receipt.__qualname__)
    assert isinstance(first.value, TypeError) and isinstance(first.value, IdemctlError)
    assert runs == [1]  # it ran once; a pending row would have run it again after the TTL
    assert ledger.lookup("billing", "pay_1").response_status == 500


class RawBytes:
    """A serializer for functions that return bytes."""

    def dumps(self, value: bytes) -> bytes:
        return value

    def loads(self, data: bytes) -> bytes:
        return data


def test_a_decimal_the_default_cannot_write_raises_naming_the_fix_and_stores_only_the_failure(ledger):
    runs: list[int] = []

    @ledger.idempotent(key="pay_d", principal="billing")
    def charge():
        runs.append(1)
        return decimal.Decimal("12.50")

    with pytest.raises(ResultNotSerializableError, match=r"Decimal.*pass serializer=\(dump, load\)") as first:
        charge()
    with pytest.raises(ResultNotSerializableError) as again:
        charge()
    assert (first.value.type_name, again.value.type_name, runs) == ("Decimal", "Decimal", [1])
    # Completed, never pending (a takeover would run it again) nor released
    # (the next caller would): the row says it ran and what was not stored.
    row = ledger.lookup("billing", "pay_d")
    assert (row.status.value, row.response_status, row.body_bytes) == (
        "completed",
        500,
        b'{"error":"result_not_serializable","type":"Decimal"}',
    )


def test_a_decimal_round_trips_through_a_users_dump_and_load_pair(ledger):
    runs: list[int] = []

    @ledger.idempotent(key="pay_e", principal="billing", serializer=(str, decimal.Decimal))
    def charge():
        runs.append(1)
        return decimal.Decimal("12.50")

    first, again = charge(), charge()
    assert (first, again, runs) == (decimal.Decimal("12.50"), decimal.Decimal("12.50"), [1])
    assert type(first) is type(again) is decimal.Decimal
    assert ledger.lookup("billing", "pay_e").body_bytes == b'"12.50"'  # readable JSON in idemctl inspect


@dataclasses.dataclass(frozen=True)
class Settled:
    payment_id: str
    amount: str
    lines: list[int]


def test_a_dataclass_comes_back_as_the_dataclass_through_its_pair_first_and_on_every_repeat(ledger):
    runs: list[int] = []
    pair = (dataclasses.asdict, lambda d: Settled(**d))

    @ledger.idempotent(key=lambda payment_id: payment_id, principal="billing", serializer=pair)
    def settle(payment_id):
        runs.append(1)
        return Settled(payment_id, "9.99", [1, 2])

    first, again = settle("pay_f"), settle("pay_f")
    assert first == again == Settled("pay_f", "9.99", [1, 2]) and type(again) is Settled
    assert runs == [1]
    assert ledger.lookup("billing", "pay_f").body_bytes == b'{"payment_id":"pay_f","amount":"9.99","lines":[1,2]}'


def test_a_pydantic_model_comes_back_as_the_model_through_its_dump_and_validate(ledger):
    import pydantic  # FastAPI's, so the test dependencies hold it

    class Charge(pydantic.BaseModel):
        amount: decimal.Decimal
        currency: str

    @ledger.idempotent(
        key="pay_g", principal="billing", serializer=(lambda m: m.model_dump(mode="json"), Charge.model_validate)
    )
    def charge():
        return Charge(amount=decimal.Decimal("5.10"), currency="EUR")

    assert charge() == charge() == Charge(amount=decimal.Decimal("5.10"), currency="EUR")


def test_a_powertools_output_serializer_is_taken_as_it_is(ledger):
    # A peer (the bench extra), not a test dependency: checked where it is installed, as CI installs it.
    serialization = pytest.importorskip("aws_lambda_powertools.utilities.idempotency.serialization.dataclass")

    @ledger.idempotent(key="pay_h", principal="billing", serializer=serialization.DataclassSerializer(model=Settled))
    def settle():
        return Settled("pay_h", "1.00", [])

    assert settle() == settle() == Settled("pay_h", "1.00", [])


def test_an_async_function_gets_its_dataclass_back_through_the_pair(ledger_target):
    from idemctl import Ledger

    ledger = Ledger.open(ledger_target)
    ledger.init()
    runs: list[int] = []

    @ledger.idempotent(key="pay_j", principal="billing", serializer=(dataclasses.asdict, lambda d: Settled(**d)))
    async def settle():
        runs.append(1)
        return Settled("pay_j", "4.00", [7])

    async def twice():
        return await settle(), await settle()

    try:
        assert asyncio.run(twice()) == (Settled("pay_j", "4.00", [7]),) * 2
    finally:
        ledger.close()
    assert runs == [1]


@pytest.mark.parametrize("serializer", [str, (str,), (str, "not callable"), object()])
def test_a_serializer_that_is_none_of_the_accepted_shapes_is_refused_before_any_call(ledger, serializer):
    with pytest.raises(TypeError, match=r"serializer must be a \(dump, load\) pair"):
        ledger.idempotent(key="k", principal="p", serializer=serializer)
    with pytest.raises(TypeError, match=r"serializer must be a \(dump, load\) pair"):
        ledger.idempotent_call(principal="p", key="k", args={}, serializer=serializer)
    assert ledger.operator.stats().total == 0


def test_a_value_stored_through_a_load_that_fails_is_read_back_once_the_load_is_fixed(ledger):
    runs: list[int] = []

    def broken_load(d):
        raise ValueError("a bug in the load")

    def pay(load):
        @ledger.idempotent(key="pay_i", principal="billing", name="pay", serializer=(dataclasses.asdict, load))
        def settle():
            runs.append(1)
            return Settled("pay_i", "3.00", [])

        return settle()

    with pytest.raises(MalformedRowError, match="a bug in the load"):
        pay(broken_load)
    # The value was stored before it was read back: nothing is lost, and
    # the function never runs again.
    assert pay(lambda d: Settled(**d)) == Settled("pay_i", "3.00", [])
    assert runs == [1]


def test_a_pluggable_serializer_stores_and_replays_binary_values_byte_for_byte(ledger):
    @ledger.idempotent(key="pdf-1", principal="invoices", serializer=RawBytes())
    def render():
        return b"%PDF\x00\xff\xfe"

    assert render() == b"%PDF\x00\xff\xfe"
    assert render() == b"%PDF\x00\xff\xfe"
    assert ledger.lookup("invoices", "pdf-1").body_bytes == b"%PDF\x00\xff\xfe"


# -- arguments and the fingerprint ----------------------------------------------------------
@pytest.mark.parametrize(
    ("arguments", "path", "problem"),
    [
        ({"amount": decimal.Decimal("5.00")}, "args['p']['amount']", "a Decimal"),
        ({1: "one"}, "args['p']", "a dict with the int key 1"),
        ({"rate": float("nan")}, "args['p']['rate']", "nan"),
        ({"tags": {"a", "b"}}, "args['p']['tags']", "a set"),
        ({"lines": [1, 2, b"raw"]}, "args['p']['lines'][2]", "a bytes"),
        ({"name": "\ud800"}, "args['p']['name']", "a str holding a lone surrogate"),
    ],
)
def test_arguments_that_are_not_json_are_refused_before_anything_is_claimed(ledger, arguments, path, problem):
    runs: list[object] = []

    @ledger.idempotent(key="k1", principal="billing")
    def charge(p):
        runs.append(p)

    with pytest.raises(UnserializableArgumentsError) as caught:
        charge(arguments)
    assert (caught.value.path, caught.value.problem) == (path, problem)
    assert isinstance(caught.value, IdemctlError) and isinstance(caught.value, TypeError)
    assert runs == []
    assert ledger.operator.stats().total == 0


def test_a_container_that_holds_itself_is_refused():
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(UnserializableArgumentsError) as caught:
        canonical_json({"x": loop})
    assert (caught.value.path, caught.value.problem) == ("args['x'][0]", "a container that holds itself")


def test_args_names_or_a_mapping_choose_what_the_fingerprint_covers(ledger):
    class Client:  # not JSON, and not part of what the call means
        pass

    runs: list[str] = []

    @ledger.idempotent(key=lambda order_id, client: order_id, principal="billing", args=["order_id"])
    def by_name(order_id, client):
        runs.append(order_id)
        return order_id

    @ledger.idempotent(
        key=lambda amount, client: "refund-1",
        principal="billing",
        args=lambda amount, client: {"amount": str(amount)},
    )
    def by_mapping(amount, client):
        runs.append(str(amount))
        return str(amount)

    assert by_name("o1", Client()) == by_name("o1", Client()) == "o1"
    assert by_mapping(decimal.Decimal("9.99"), Client()) == by_mapping(decimal.Decimal("9.99"), Client()) == "9.99"
    with pytest.raises(KeyReusedError):
        by_mapping(decimal.Decimal("10.00"), Client())
    assert runs == ["o1", "9.99"]


def test_args_naming_an_argument_the_function_does_not_take_is_refused_when_decorating(ledger):
    with pytest.raises(TypeError, match="'amount', which the function does not take"):

        @ledger.idempotent(key="k", principal="billing", args=["amount"])
        def charge(total):
            return total


def test_an_argument_passed_as_its_default_is_the_same_call(ledger):
    runs: list[str] = []

    @ledger.idempotent(key="k1", principal="billing")
    def charge(amount, currency="EUR"):
        runs.append(currency)
        return amount

    assert charge(500) == charge(500, currency="EUR") == charge(amount=500) == 500
    assert runs == ["EUR"]
    with pytest.raises(KeyReusedError):
        charge(500, "USD")


def test_two_functions_sharing_a_principal_and_a_key_refuse_each_others_repeats(ledger):
    @ledger.idempotent(key="order-1", principal="billing")
    def charge(amount):
        return "charged"

    @ledger.idempotent(key="order-1", principal="billing")
    def refund(amount):
        return "refunded"

    assert charge(500) == "charged"
    with pytest.raises(KeyReusedError):
        refund(500)


def test_name_keeps_a_functions_fingerprint_across_a_rename(ledger):
    @ledger.idempotent(key="order-1", principal="billing", name="charge")
    def charge(amount):
        return "charged by the old code"

    @ledger.idempotent(key="order-1", principal="billing", name="charge")
    def charge_card(amount):
        return "charged by the new code"

    assert charge(500) == "charged by the old code"
    assert charge_card(500) == "charged by the old code"


def test_the_fingerprint_is_the_sha256_of_the_canonical_json_of_the_arguments_and_the_name():
    # Written out by hand: the fingerprint must not change across Python versions or idemctl releases.
    value = {"amount": 12.5, "lines": [1, True, None], "note": "thé ☕", "big": 2**70}
    assert (
        canonical_json(value)
        == '{"amount":12.5,"big":1180591620717411303424,"lines":[1,true,null],"note":"thé ☕"}'.encode()
    )
    assert call_fingerprint(value, name="charge") == "bb049fa5432e1362e8fc09c49349f8bcaa37a6af08da70a641a59eb05e413ad6"


def test_the_stored_fingerprint_is_the_call_fingerprint_of_the_bound_arguments(ledger):
    @ledger.idempotent(key="k1", principal="billing")
    def charge(amount, currency="EUR"):
        return amount

    charge(500)
    expected = call_fingerprint({"amount": 500, "currency": "EUR"}, name=charge.__qualname__)
    assert ledger.lookup("billing", "k1").fingerprint == expected


def test_a_callable_without_a_qualname_needs_a_name(ledger):
    def add(a, b):
        return a + b

    with pytest.raises(TypeError, match="name="):
        ledger.idempotent(key="sum-1", principal="calc")(functools.partial(add, 1))
    add_one = ledger.idempotent(key="sum-1", principal="calc", name="add_one")(functools.partial(add, 1))
    assert add_one(2) == add_one(b=2) == 3


# -- principals and keys ----------------------------------------------------------------------
def test_a_principal_from_the_arguments_scopes_keys_so_two_principals_never_meet(ledger):
    runs: list[str] = []

    @ledger.idempotent(key=lambda account, ref: ref, principal=lambda account, ref: account)
    def transfer(account, ref):
        runs.append(account)
        return account

    assert transfer("acct_A", "t-1") == "acct_A"
    assert transfer("acct_B", "t-1") == "acct_B"
    assert transfer("acct_A", "t-1") == "acct_A"
    assert runs == ["acct_A", "acct_B"]


@pytest.mark.parametrize(("principal", "error"), [(None, TypeError), ("", InvalidPrincipalError)])
def test_a_call_without_a_principal_is_refused_and_nothing_runs(ledger, principal, error):
    runs: list[int] = []

    @ledger.idempotent(key="k1", principal=lambda amount: principal)
    def charge(amount):
        runs.append(amount)

    with pytest.raises(error):
        charge(500)
    assert runs == []
    assert ledger.operator.stats().total == 0


def test_a_key_that_is_not_a_valid_idempotency_key_is_refused_and_nothing_runs(ledger):
    runs: list[str] = []

    @ledger.idempotent(key=lambda ref: ref, principal="billing")
    def charge(ref):
        runs.append(ref)

    for bad in ("pay\n1", "", "é", 42):
        with pytest.raises(InvalidKeyError):
            charge(bad)
    assert runs == []


def test_methods_are_decorated_with_self_left_out_of_the_fingerprint(ledger):
    class Biller:
        def __init__(self) -> None:
            self.runs = 0

        @ledger.idempotent(key=lambda self, ref, amount: ref, principal="billing", args=["ref", "amount"])
        def charge(self, ref, amount):
            self.runs += 1
            return amount

    one, other = Biller(), Biller()
    assert one.charge("pay_1", 500) == other.charge("pay_1", 500) == 500
    assert (one.runs, other.runs) == (1, 0)


# -- the context manager ----------------------------------------------------------------------
def test_a_block_that_raises_after_store_still_completes_the_call(ledger):
    call = ledger.idempotent_call(principal="billing", key="pay_1", args=None, release_on_error=True)
    with pytest.raises(RuntimeError, match="after the charge"), call:
        call.store({"charged": 500})
        raise RuntimeError("logging failed after the charge")
    row = ledger.lookup("billing", "pay_1")
    assert (row.status, row.response_body) == (Status.COMPLETED, '{"charged":500}')


def test_a_block_that_ends_without_store_completes_with_none(ledger):
    with ledger.idempotent_call(principal="billing", key="pay_1", args=None) as call:
        pass
    assert (call.outcome, call.value) == (Outcome.EXECUTED, None)
    with ledger.idempotent_call(principal="billing", key="pay_1", args=None) as again:
        assert again.replayed
    assert again.value is None


def test_store_on_a_replayed_call_is_refused(ledger):
    for _ in range(2):
        with ledger.idempotent_call(principal="billing", key="pay_1", args=None) as call:
            if call.replayed:
                with pytest.raises(RuntimeError, match="a replayed call must not run again"):
                    call.store("again")
            else:
                call.store("once")
    assert call.value == "once"


# -- async ------------------------------------------------------------------------------------
def test_an_async_function_runs_once_and_repeats_replay(ledger):
    runs: list[str] = []

    @ledger.idempotent(key=lambda ref: ref, principal="billing")
    async def send_receipt(ref):
        await asyncio.sleep(0)
        runs.append(ref)
        return {"sent": ref}

    async def twice():
        return await send_receipt("r-1"), await send_receipt("r-1")

    assert inspect.iscoroutinefunction(send_receipt)
    assert asyncio.run(twice()) == ({"sent": "r-1"}, {"sent": "r-1"})
    assert runs == ["r-1"]


def test_an_async_duplicate_while_the_first_runs_raises_in_progress_and_then_replays(ledger):
    async def main():
        release = asyncio.Event()
        runs: list[str] = []

        @ledger.idempotent(key="r-1", principal="billing")
        async def send():
            runs.append("sent")
            await release.wait()
            return "sent"

        first = asyncio.create_task(send())
        while not runs:  # until the first call holds the reservation and runs
            await asyncio.sleep(0.01)
        with pytest.raises(CallInProgressError):
            await send()
        release.set()
        return await first, await send(), runs

    assert asyncio.run(main()) == ("sent", "sent", ["sent"])


def test_an_async_function_that_raises_leaves_the_reservation_pending(ledger):
    @ledger.idempotent(key="r-1", principal="billing")
    async def send():
        raise ConnectionError("smtp down")

    with pytest.raises(ConnectionError):
        asyncio.run(send())
    assert ledger.lookup("billing", "r-1").status is Status.PENDING


def test_function_calls_emit_events_like_requests(ledger):
    from idemctl import CallInProgressError, KeyReusedError, Outcome

    seen = []
    ledger.subscribe(seen.append)

    @ledger.idempotent(key=lambda order: order["id"], principal="billing", name="capture")
    def capture(order):
        return {"captured": order["amount"]}

    capture({"id": "o-1", "amount": 5})
    capture({"id": "o-1", "amount": 5})
    with pytest.raises(KeyReusedError):
        capture({"id": "o-1", "amount": 6})
    held = ledger.idempotent_call(principal="billing", key="o-2", args={"n": 1}, name="capture")
    held.__enter__()
    with (
        pytest.raises(CallInProgressError),
        ledger.idempotent_call(principal="billing", key="o-2", args={"n": 1}, name="capture"),
    ):
        pass
    with pytest.raises(RuntimeError), ledger.idempotent_call(principal="billing", key="o-3", args={}, name="capture"):
        raise RuntimeError("failed")
    assert [(e.outcome, e.method, e.path, e.key) for e in seen] == [
        (Outcome.EXECUTED, "CALL", "capture", "o-1"),
        (Outcome.REPLAYED, "CALL", "capture", "o-1"),
        (Outcome.REUSED, "CALL", "capture", "o-1"),
        (Outcome.IN_PROGRESS, "CALL", "capture", "o-2"),
        (Outcome.FAILED, "CALL", "capture", "o-3"),
    ]
    assert seen[0].app_ms is not None and seen[1].app_ms is None


def test_a_function_whose_ledger_cannot_be_reached_publishes_one_unavailable_event_and_raises(tmp_path):
    from idemctl import Ledger
    from idemctl.errors import StorageError

    with Ledger.open(tmp_path / "never-initialised.db") as missing:
        seen = []
        missing.subscribe(seen.append)

        @missing.idempotent(key="pay_1", principal="billing", name="charge")
        def charge() -> int:
            raise AssertionError("a call whose decision could not be asked must not run")

        before = time.time_ns() // 1_000_000
        with pytest.raises(StorageError):
            charge()
        after = time.time_ns() // 1_000_000
    assert len(seen) == 1
    event = seen[0]
    assert (event.outcome, event.principal, event.key, event.generation) == (
        Outcome.UNAVAILABLE,
        "billing",
        "pay_1",
        None,
    )
    assert (event.method, event.path, event.status, event.app_ms, event.waited) == ("CALL", "charge", None, None, False)
    assert before <= event.at <= after
    assert 0.0 <= event.ledger_ms < 10_000


def test_an_async_function_whose_ledger_cannot_be_reached_publishes_one_unavailable_event(tmp_path):
    from idemctl import Ledger
    from idemctl.errors import StorageError

    with Ledger.open(tmp_path / "never-initialised.db") as missing:
        seen = []
        missing.subscribe(seen.append)

        @missing.idempotent(key="pay_1", principal="billing", name="charge")
        async def charge() -> int:
            raise AssertionError("a call whose decision could not be asked must not run")

        with pytest.raises(StorageError):
            asyncio.run(charge())
    assert [(e.outcome, e.principal, e.key, e.method, e.path, e.status) for e in seen] == [
        (Outcome.UNAVAILABLE, "billing", "pay_1", "CALL", "charge", None)
    ]


def test_function_calls_build_no_event_when_nobody_listens(ledger, monkeypatch):
    import idemctl.functions as functions

    built = []
    real = functions.Event
    monkeypatch.setattr(functions, "Event", lambda *a, **kw: built.append(a) or real(*a, **kw))
    logging.getLogger("idemctl.events").setLevel(logging.WARNING)
    try:

        @ledger.idempotent(key="o-1", principal="billing", name="capture")
        def capture() -> int:
            return 5

        assert (capture(), capture()) == (5, 5)
    finally:
        logging.getLogger("idemctl.events").setLevel(logging.NOTSET)
    assert built == []


def test_the_async_twin_of_discard_releases_the_claim_without_blocking_the_event_loop(make_ledger):
    ledger = make_ledger()
    blocking_calls: list[str] = []
    # Whatever runs synchronously on the loop's own thread goes through the
    # synchronous store: on SQLite the release must reach it from a worker
    # thread (asyncio.to_thread), on PostgreSQL not at all (the async store).
    real_run = ledger.store.run

    def watched(op: Any) -> Any:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return real_run(op)
        blocking_calls.append(type(op).__name__)
        return real_run(op)

    ledger.store.run = watched  # type: ignore[method-assign]

    async def main() -> None:
        async with ledger.idempotent_call(principal="acct", key="k1", args=()) as call:
            assert call.outcome is Outcome.EXECUTED
            await call.adiscard()
        assert await asyncio.to_thread(ledger.lookup, "acct", "k1") is None  # released: a repeat runs at once
        async with ledger.idempotent_call(principal="acct", key="k1", args=()) as call:
            assert call.outcome is Outcome.EXECUTED and call.generation == 1
            call.store("done")

    asyncio.run(main())
    assert blocking_calls == []  # the blocking discard() ran a Statement here
    row = ledger.lookup("acct", "k1")
    assert row is not None and row.status is Status.COMPLETED


def test_adiscard_refuses_a_call_it_does_not_run_as_discard_does(make_ledger):
    ledger = make_ledger()

    async def main() -> None:
        async with ledger.idempotent_call(principal="acct", key="k1", args=()) as call:
            call.store("done")
            with pytest.raises(RuntimeError, match="discard\\(\\) needs a call"):
                await call.adiscard()

    asyncio.run(main())
    row = ledger.lookup("acct", "k1")
    assert row is not None and row.status is Status.COMPLETED
