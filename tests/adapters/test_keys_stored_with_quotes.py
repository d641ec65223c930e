"""Rows whose key holds the header's quotes: the recipe's Worker, and idemctl
before it read the Idempotency-Key as an RFC 8941 sf-string, stored the
header as it came, so the row of the header "legacy-1" holds the key
"legacy-1", quotes included. idemctl reads that header as the key legacy-1;
the ledger's key_id makes them one key, so such a row is replayed, never run
again, and a writer of the old kind still running beside idemctl cannot
run the same operation a second time."""

from __future__ import annotations

import hashlib
import json
import threading

import pytest

from idemctl import Ledger
from tests.adapters.test_adapter_contract import ORDER, AsgiClient, Orders, WsgiClient
from tests.helpers import RecipeWriter

# Rows the recipe's Worker wrote with its SQL: only a SQL ledger has that writer.
pytestmark = pytest.mark.engines("sqlite", "postgres", "mysql")

STORED_HEADERS = json.dumps({"content-type": "application/json", "location": "/orders/7"})
CLIENTS = {"wsgi": WsgiClient, "asgi": AsgiClient}


def recipe_fingerprint(method: str, path_and_query: str, content_type: str, body: bytes) -> str:
    """computeFingerprint as the recipe's Worker writes it (FINGERPRINT_HEADERS:
    content-type and x-api-version, absent ones empty)."""
    prefix = f"{method.upper()}\n{path_and_query}\ncontent-type:{content_type}\nx-api-version:\n"
    return hashlib.sha256(prefix.encode() + body).hexdigest()


@pytest.fixture
def recipe(ledger_target):
    writer = RecipeWriter(ledger_target)
    yield writer
    writer.close()


@pytest.mark.parametrize("adapter", sorted(CLIENTS))
@pytest.mark.parametrize("header", ['"legacy-1"', "legacy-1"])
def test_a_row_the_recipe_stored_with_the_quotes_is_replayed_and_nothing_runs(
    adapter, header, make_ledger, recipe, clock
):
    ledger: Ledger = make_ledger()
    fingerprint = recipe_fingerprint("POST", "/orders", "application/json", ORDER)
    recipe.insert_completed("alice", '"legacy-1"', fingerprint, 201, STORED_HEADERS, '{"id":7}', clock.now)
    orders = Orders()
    client = CLIENTS[adapter](ledger, orders)

    reply = client.request(
        "POST", "/orders", ORDER, {"Content-Type": "application/json", "Idempotency-Key": header}, "alice"
    )

    assert (reply.status, reply.body) == (201, b'{"id":7}')
    assert reply.header("location") == "/orders/7"
    assert orders.runs == []
    # Still the one row, under the key the recipe stored.
    view = ledger.operator.get("alice", header)
    assert view is not None and (view.row.key, view.row.generation) == ('"legacy-1"', 1)


def test_a_different_request_under_the_quoted_key_is_refused_not_run(make_ledger, recipe, clock):
    ledger: Ledger = make_ledger()
    fingerprint = recipe_fingerprint("POST", "/orders", "application/json", ORDER)
    recipe.insert_completed("alice", '"legacy-1"', fingerprint, 201, STORED_HEADERS, '{"id":7}', clock.now)
    orders = Orders()
    reply = WsgiClient(ledger, orders).request(
        "POST",
        "/orders",
        b'{"sku":"other"}',
        {"Content-Type": "application/json", "Idempotency-Key": '"legacy-1"'},
        "alice",
    )
    assert reply.status == 409
    assert json.loads(reply.body)["error"] == "idempotency_key_reused"
    assert orders.runs == []


def test_the_quoted_row_is_one_principals_only(make_ledger, recipe, clock):
    ledger: Ledger = make_ledger()
    fingerprint = recipe_fingerprint("POST", "/orders", "application/json", ORDER)
    recipe.insert_completed("alice", '"legacy-1"', fingerprint, 201, STORED_HEADERS, '{"id":7}', clock.now)
    orders = Orders()
    reply = WsgiClient(ledger, orders).request(
        "POST", "/orders", ORDER, {"Content-Type": "application/json", "Idempotency-Key": '"legacy-1"'}, "bob"
    )
    assert (reply.status, len(orders.runs)) == (201, 1)


ROUNDS = 12


@pytest.mark.parametrize("adapter", sorted(CLIENTS))
def test_an_old_writer_and_idemctl_handling_the_same_quoted_key_at_once_run_it_once(
    adapter, make_ledger, ledger_target, clock
):
    """A rolling deployment: the recipe's Worker still stores "k" as it came
    while idemctl reads the same header as k. Both start together, round
    after round, each with a new key: exactly one of them runs each one."""
    ledger: Ledger = make_ledger()
    orders = Orders()
    client = CLIENTS[adapter](ledger, orders)
    fingerprint = recipe_fingerprint("POST", "/orders", "application/json", ORDER)
    writers = [RecipeWriter(ledger_target) for _ in range(2)]
    old_runs: list[str] = []
    refused: list[str] = []

    def old_writer(key: str, start: threading.Barrier) -> None:
        writer = writers[0]
        start.wait(10)
        try:
            claimed = writer.claim("alice", key, fingerprint, clock.now)
        except Exception as exc:  # the key_id index refused its INSERT: the Worker answers 500, runs nothing
            refused.append(type(exc).__name__)
            return
        if claimed:
            old_runs.append(key)
            writer.complete("alice", key, 201, STORED_HEADERS, '{"id":1}', clock.now)

    replies = []
    try:
        for n in range(ROUNDS):
            key = f'"k-{n}"'
            start = threading.Barrier(2)
            thread = threading.Thread(target=old_writer, args=(key, start))
            thread.start()
            start.wait(10)
            replies.append(
                client.request(
                    "POST", "/orders", ORDER, {"Content-Type": "application/json", "Idempotency-Key": key}, "alice"
                )
            )
            thread.join(30)
            assert not thread.is_alive()
            assert len(old_runs) + len(orders.runs) == n + 1, (
                f"round {n}: {len(old_runs)} old runs, {len(orders.runs)} idemctl runs"
            )
    finally:
        for writer in writers:
            writer.close()
    # Every idemctl answer is its own run, a replay, or a 409 (in progress / retry): never a second run.
    assert {r.status for r in replies} <= {201, 409}
    assert len(old_runs) + len(orders.runs) == ROUNDS


def test_a_stale_reservation_an_old_writer_left_under_the_quoted_key_is_taken_over_once(
    make_ledger, ledger_target, clock
):
    """The recipe's Worker claimed "legacy-1" and died: the retry takes its
    row over (by key_id), runs once, stores its answer; the dead owner's late
    completion is fenced out by the generation, as in the recipe."""
    ledger: Ledger = make_ledger()
    fingerprint = recipe_fingerprint("POST", "/orders", "application/json", ORDER)
    writer = RecipeWriter(ledger_target)
    try:
        assert writer.claim("alice", '"legacy-1"', fingerprint, clock.now)
        clock.advance(ledger.policy.pending_ttl_ms + 1)
        orders = Orders()
        client = WsgiClient(ledger, orders)
        headers = {"Content-Type": "application/json", "Idempotency-Key": '"legacy-1"'}
        first = client.request("POST", "/orders", ORDER, headers, "alice")
        writer.complete(
            "alice", '"legacy-1"', 201, STORED_HEADERS, '{"id":"late"}', clock.now
        )  # fenced: generation moved on
        again = client.request("POST", "/orders", ORDER, headers, "alice")
    finally:
        writer.close()
    assert (first.status, first.body, len(orders.runs)) == (201, b'{"id":1}', 1)
    assert (again.status, again.body, len(orders.runs)) == (201, b'{"id":1}', 1)
    view = ledger.operator.get("alice", "legacy-1")
    assert view is not None and (view.row.key, view.row.generation, view.row.response_body) == (
        '"legacy-1"',
        2,
        '{"id":1}',
    )
