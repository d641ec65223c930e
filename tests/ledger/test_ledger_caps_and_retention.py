"""Options that meet, on every backend: keep_answer beside the body and
header caps, the database clock failing after the mutation ran, a key past
retention, repeated response headers, and the one size limit on principals."""

from __future__ import annotations

import json
import secrets
import threading
from email.utils import parsedate_to_datetime

import pytest

from idemctl import AnswerNotStoredError, Ledger, Outcome, Policy, PolicyError, State, Status
from idemctl.errors import ConnectionFailedError, InvalidPrincipalError, InvalidRequestError
from idemctl.ledger import MAX_PATH_BYTES, MAX_PRINCIPAL_BYTES
from idemctl.responses import not_stored

BODY = b'{"sku":"tea"}'
HEADERS = {"content-type": "application/json"}


def post(ledger: Ledger, run, *, key: str = "k1", body: bytes = BODY, principal: str = "acct_A"):
    return ledger.handle(principal, key, "POST", "/orders", HEADERS, body, run)


class App:
    """A mutation that counts its runs and answers what it is told."""

    def __init__(self, status: int = 201, headers=None, body: bytes = b'{"id":1}') -> None:
        self.status, self.headers, self.body = status, headers or [], body
        self.runs = 0
        self.lock = threading.Lock()

    def __call__(self, request_body: bytes):
        with self.lock:
            self.runs += 1
            return self.status, self.headers, self.body


# -- keep_answer and the caps ------------------------------------------------------------------
def test_keep_answer_beside_the_body_cap_stores_the_oversize_sentinel_and_never_runs_again(make_ledger):
    # The docs' own filter: do not keep 5xx. The app answered 200; the 500 is
    # the ledger's sentinel for an answer it cannot store whole, so it is kept.
    ledger = make_ledger(policy=Policy(keep_answer=lambda status, headers: status < 500, body_cap_bytes=100))
    app = App(200, [("content-type", "text/plain")], b"x" * 200)
    answers = [post(ledger, app) for _ in range(3)]
    assert app.runs == 1
    assert [a.outcome for a in answers] == [Outcome.EXECUTED, Outcome.REPLAYED, Outcome.REPLAYED]
    # The ledger's JSON error, not the app's text/plain describing a body that is not there.
    assert {a.wire for a in answers} == {not_stored()}
    row = ledger.lookup("acct_A", "k1")
    assert (row.status, row.response_status, row.response_body) == (Status.COMPLETED, 500, None)


def test_keep_answer_still_refuses_an_oversize_5xx_the_app_returned(make_ledger):
    ledger = make_ledger(policy=Policy(keep_answer=lambda status, headers: status < 500, body_cap_bytes=100))
    app = App(503, [], b"y" * 200)
    first, second = post(ledger, app), post(ledger, app)
    assert app.runs == 2
    assert (first.outcome, second.outcome) == (Outcome.NOT_KEPT, Outcome.NOT_KEPT)
    assert ledger.lookup("acct_A", "k1") is None


def test_keep_answer_is_asked_about_the_apps_status_not_the_sentinels(make_ledger):
    seen: list[int] = []
    ledger = make_ledger(
        policy=Policy(keep_answer=lambda status, headers: seen.append(status) or True, body_cap_bytes=10)
    )
    post(ledger, App(201, [], b"z" * 11))
    assert seen == [201]


def test_headers_over_the_header_cap_are_stored_as_the_loud_500_like_an_oversize_body(make_ledger):
    # An 8 MiB Location: nothing of it is stored, the row completes as the
    # bodiless 500, and every retry gets that 500 without running again.
    ledger = make_ledger()
    app = App(201, [("content-type", "application/json"), ("location", "/" + "a" * (8 * 1024 * 1024))])
    first, again = post(ledger, app), post(ledger, app)
    assert app.runs == 1
    assert first.wire == again.wire == not_stored()
    assert (first.outcome, again.outcome) == (Outcome.EXECUTED, Outcome.REPLAYED)
    row = ledger.lookup("acct_A", "k1")
    assert (row.response_status, row.response_body, row.response_headers) == (500, None, "{}")


def test_headers_exactly_at_the_header_cap_are_stored_and_one_byte_more_is_not(make_ledger):
    location = "/orders/1"
    stored = json.dumps({"location": location}, separators=(",", ":"))
    ledger = make_ledger(policy=Policy(header_cap_bytes=len(stored)))
    at_cap = post(ledger, App(201, [("location", location)]), key="at-cap")
    over = post(ledger, App(201, [("location", location + "0")]), key="over")
    assert at_cap.wire == (201, (("location", location),), b'{"id":1}')
    assert ledger.lookup("acct_A", "at-cap").response_headers == stored
    assert over.wire == not_stored()


def test_the_header_cap_counts_utf8_bytes_of_what_is_stored(make_ledger):
    # Latin-1 characters are two bytes each once stored as JSON text (UTF-8).
    value = "\u00e9" * 10
    stored = json.dumps({"location": value}, separators=(",", ":"), ensure_ascii=False)
    ledger = make_ledger(policy=Policy(header_cap_bytes=len(stored.encode("utf-8")) - 1))
    assert post(ledger, App(201, [("location", value)])).status == 500


def test_a_header_cap_too_small_for_an_empty_header_set_is_refused():
    with pytest.raises(PolicyError, match="header_cap_bytes must be >= 2, got 1"):
        Policy(header_cap_bytes=1)
    assert Policy().header_cap_bytes == 8192


# -- the database clock ----------------------------------------------------------------------
def test_a_database_clock_that_fails_after_the_mutation_ran_gives_answer_not_stored(ledger_target):
    Ledger.open(ledger_target).init()
    ledger = Ledger.open(ledger_target, clock="database")
    real = ledger.clock
    ticket = ledger.begin("acct_A", "k1", "POST", "/orders", HEADERS, BODY)

    def unreachable() -> int:
        raise ConnectionFailedError("cannot reach the database")

    ledger.clock = unreachable
    with pytest.raises(AnswerNotStoredError) as caught:
        ledger.finish(ticket, 201, [("location", "/orders/1"), ("x-internal", "no")], b'{"id":1}')
    # What the app computed, shaped as a stored answer would be.
    assert caught.value.answer.wire == (201, (("location", "/orders/1"),), b'{"id":1}')
    assert isinstance(caught.value.cause, ConnectionFailedError)
    ledger.clock = real
    assert ledger.lookup("acct_A", "k1").status is Status.PENDING
    ledger.close()


def test_a_postgres_connection_killed_before_finish_reads_the_database_clock_is_asked_again_and_stored(
    ledger_target, backend_name
):
    if backend_name != "postgres":
        pytest.skip("a server connection to kill: PostgreSQL only")
    import psycopg

    Ledger.open(ledger_target).init()
    ledger = Ledger.open(ledger_target + "&pool_max_size=1&pool_min_size=1", clock="database")
    ticket = ledger.begin("acct_A", "k1", "POST", "/orders", HEADERS, BODY)
    (server_pid,) = ledger.store.engine.read("SELECT pg_backend_pid()", {})[0]
    with psycopg.connect(ledger_target.split("?")[0], autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (server_pid,))
    # The clock and the completion are asked again on a fresh connection.
    answer = ledger.finish(ticket, 201, [], b'{"id":1}')
    assert (answer.outcome, answer.wire) == (Outcome.EXECUTED, (201, (), b'{"id":1}'))
    assert ledger.lookup("acct_A", "k1").status is Status.COMPLETED
    ledger.close()


# -- past retention -------------------------------------------------------------------------
def test_a_completed_key_past_retention_runs_again_as_a_new_operation(make_ledger, clock):
    ledger = make_ledger()
    first_app, second_app = App(201, [], b"first"), App(201, [], b"second")
    first = post(ledger, first_app)
    clock.advance(ledger.policy.retention_ms + 1)
    assert ledger.operator.get("acct_A", "k1").state is State.EXPIRED
    again = post(ledger, second_app)
    assert (first_app.runs, second_app.runs) == (1, 1)
    assert (again.outcome, again.generation, again.body) == (Outcome.EXECUTED, 2, b"second")
    assert first.generation == 1
    row = ledger.lookup("acct_A", "k1")
    assert (row.generation, row.created_at, row.updated_at, row.body_bytes) == (2, clock.now, clock.now, b"second")
    # Within the new retention, the new answer is what retries get.
    assert post(ledger, App(500, [], b"never")).wire == again.wire


def test_a_different_request_with_a_key_past_retention_is_a_new_operation_not_a_reuse(make_ledger, clock):
    ledger = make_ledger()
    post(ledger, App(201, [], b"first"))
    clock.advance(ledger.policy.retention_ms + 1)
    other = App(201, [], b"other")
    answer = post(ledger, other, body=b'{"sku":"coffee"}')
    assert (answer.outcome, answer.status, other.runs) == (Outcome.EXECUTED, 201, 1)
    assert post(ledger, App(), body=b'{"sku":"coffee"}').outcome is Outcome.REPLAYED
    assert post(ledger, App()).outcome is Outcome.REUSED


def test_a_pending_row_past_retention_is_taken_over_and_its_owner_is_fenced_out(make_ledger, clock):
    ledger = make_ledger()
    late = ledger.begin("acct_A", "k1", "POST", "/orders", HEADERS, BODY)
    clock.advance(ledger.policy.retention_ms + 1)
    fresh = post(ledger, App(201, [], b"new"), body=b'{"sku":"coffee"}')
    assert (fresh.outcome, fresh.generation) == (Outcome.EXECUTED, 2)
    fenced = ledger.finish(late, 201, [], b"old")
    assert fenced.outcome is Outcome.FENCED_OUT
    assert ledger.lookup("acct_A", "k1").body_bytes == b"new"
    assert [(e.superseded_generation, e.current_generation) for e in ledger.operator.fenced(principal="acct_A")] == [
        (1, 2)
    ]


def test_a_row_exactly_at_retention_is_replayed_with_an_expiry_that_is_now_not_past(make_ledger, clock):
    ledger = make_ledger(policy=Policy(expires_header="idempotency-expires"))
    app = App(201, [], b"once")
    post(ledger, app)
    clock.advance(ledger.policy.retention_ms)  # updated_at == now - retention: not yet past it
    replay = post(ledger, app)
    assert (replay.outcome, app.runs) == (Outcome.REPLAYED, 1)
    expires_ms = parsedate_to_datetime(replay.header("idempotency-expires")).timestamp() * 1000
    assert expires_ms // 1000 == clock.now // 1000
    clock.advance(1)
    new = post(ledger, app)
    assert (new.outcome, app.runs) == (Outcome.EXECUTED, 2)
    new_expiry = parsedate_to_datetime(new.header("idempotency-expires")).timestamp() * 1000
    assert new_expiry // 1000 == (clock.now + ledger.policy.retention_ms) // 1000


def test_predict_says_new_for_a_key_past_retention(make_ledger, clock):
    ledger = make_ledger()
    post(ledger, App())
    clock.advance(ledger.policy.retention_ms + 1)
    prediction = ledger.operator.predict("acct_A", "k1", "another fingerprint")
    assert prediction.verdict.value == "new" and prediction.view is not None


def test_requests_racing_for_a_key_past_retention_run_the_mutation_once(make_ledger, clock):
    ledger = make_ledger()
    post(ledger, App(201, [], b"old"))
    clock.advance(ledger.policy.retention_ms + 1)
    app = App(201, [], b"new")
    start = threading.Barrier(8)
    outcomes: list[Outcome] = []

    def request() -> None:
        start.wait()
        outcomes.append(post(ledger, app).outcome)

    threads = [threading.Thread(target=request) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert app.runs == 1
    assert outcomes.count(Outcome.EXECUTED) == 1
    assert set(outcomes) <= {Outcome.EXECUTED, Outcome.IN_PROGRESS, Outcome.REPLAYED, Outcome.RETRY}
    assert ledger.lookup("acct_A", "k1").generation == 2


def test_a_sweep_and_a_takeover_past_retention_never_both_win(make_ledger, clock):
    # Whichever goes first, the key ends as one live reservation or none,
    # and a request after both runs at most once more.
    ledger = make_ledger()
    post(ledger, App())
    clock.advance(ledger.policy.retention_ms + 1)
    app = App(201, [], b"after")
    sweeper = threading.Thread(target=lambda: ledger.operator.sweep(batch=100))
    sweeper.start()
    answer = post(ledger, app)
    sweeper.join()
    assert answer.outcome in (Outcome.EXECUTED, Outcome.RETRY)
    row = ledger.lookup("acct_A", "k1")
    if answer.outcome is Outcome.EXECUTED:
        assert row is not None and row.body_bytes == b"after"
    assert app.runs == (1 if answer.outcome is Outcome.EXECUTED else 0)


# -- repeated headers ---------------------------------------------------------------------------
def test_two_set_cookie_fields_are_stored_and_replayed_as_two_fields_in_order(make_ledger):
    ledger = make_ledger(policy=Policy(replayable_headers=("content-type", "set-cookie")))
    cookies = [
        ("Set-Cookie", "session=a; Path=/; HttpOnly"),
        ("content-type", "text/plain"),
        ("set-cookie", "csrf=b; Path=/"),
    ]
    app = App(201, cookies, b"ok")
    first, replay = post(ledger, app), post(ledger, app)
    expected = (
        ("content-type", "text/plain"),
        ("set-cookie", "session=a; Path=/; HttpOnly"),
        ("set-cookie", "csrf=b; Path=/"),
    )
    assert first.headers == replay.headers == expected
    assert (first.outcome, replay.outcome, app.runs) == (Outcome.EXECUTED, Outcome.REPLAYED, 1)
    assert json.loads(ledger.lookup("acct_A", "k1").response_headers) == {
        "content-type": "text/plain",
        "set-cookie": ["session=a; Path=/; HttpOnly", "csrf=b; Path=/"],
    }


def test_any_repeated_header_keeps_each_field_through_begin_and_finish(make_ledger):
    ledger = make_ledger(policy=Policy(replayable_headers=("link", "vary")))
    ticket = ledger.begin("acct_A", "k1", "POST", "/orders", HEADERS, BODY)
    sent = [("Link", "</a>; rel=next"), ("Vary", "Accept"), ("Link", "</b>; rel=prev"), ("Vary", "Cookie")]
    answer = ledger.finish(ticket, 200, sent, b"")
    replay = ledger.begin("acct_A", "k1", "POST", "/orders", HEADERS, BODY)
    expected = (("link", "</a>; rel=next"), ("link", "</b>; rel=prev"), ("vary", "Accept"), ("vary", "Cookie"))
    assert answer.headers == replay.headers == expected


def test_a_row_with_the_recipes_one_string_per_header_still_replays(make_ledger):
    ledger = make_ledger()
    reservation = ledger.claim("acct_A", "k1", "fp")
    ledger.store.complete(("acct_A", "k1", 1, reservation.token), (201, "ok", '{"location":"/o/1, /o/2"}'), 0)
    row = ledger.lookup("acct_A", "k1")
    from idemctl.responses import from_stored

    assert from_stored(row.response_status, row.response_body, row.response_headers) == (
        201,
        (("location", "/o/1, /o/2"),),
        b"ok",
    )


# -- one size limit for principals and paths -----------------------------------------------------
def test_a_long_incompressible_principal_is_refused_before_any_statement_on_every_engine(ledger):
    principal = secrets.token_hex(1500)  # 3 000 characters no compression shrinks
    app = App()
    with pytest.raises(InvalidPrincipalError, match=f"is 3000 bytes in UTF-8; the most is {MAX_PRINCIPAL_BYTES}"):
        post(ledger, app, principal=principal)
    with pytest.raises(InvalidPrincipalError):
        ledger.claim(principal, "k1", "fp")
    assert app.runs == 0
    assert ledger.operator.stats().total == 0


def test_a_principal_of_exactly_512_utf8_bytes_is_stored_and_one_more_byte_is_refused(ledger):
    at_limit = secrets.token_hex(128) + "\u00e9" * 128  # 256 + 256 bytes, incompressible half
    assert len(at_limit.encode("utf-8")) == MAX_PRINCIPAL_BYTES == 512
    app = App()
    assert post(ledger, app, principal=at_limit).outcome is Outcome.EXECUTED
    assert post(ledger, app, principal=at_limit).outcome is Outcome.REPLAYED
    with pytest.raises(InvalidPrincipalError):
        post(ledger, app, principal=at_limit + "a")
    assert app.runs == 1


def test_a_path_over_the_limit_is_refused_with_invalid_request_error(ledger):
    with pytest.raises(InvalidRequestError, match=f"longer than {MAX_PATH_BYTES} bytes"):
        ledger.handle("acct_A", "k1", "POST", "/" + "p" * MAX_PATH_BYTES, HEADERS, BODY, App())
    assert ledger.handle("acct_A", "k1", "POST", "/" + "p" * (MAX_PATH_BYTES - 1), HEADERS, BODY, App()).status == 201
