"""Rows other programs wrote, and inputs the library must refuse before it
writes anything."""

from __future__ import annotations

import json
import sqlite3

import pytest
from typer.testing import CliRunner

from idemctl import Ledger, Policy, State, fingerprint
from idemctl.cli import app
from idemctl.errors import InvalidPrincipalError, InvalidRequestError, MalformedRowError
from idemctl.storage.dialect import SQLITE
from idemctl.storage.rows import decode_row

NOW = 1_700_000_000_000


def ok(body: bytes):
    return 201, {}, b"ok"


def foreign_sqlite(path, rows: list[tuple]) -> None:
    conn = sqlite3.connect(path)
    conn.executemany(
        "INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, response_status,"
        " response_body, response_headers, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
        rows,
    )
    conn.commit()
    conn.close()


@pytest.fixture
def foreign_rows_db(tmp_path):
    path = tmp_path / "ledger.db"
    with Ledger.open(path, clock=lambda: NOW) as ledger:
        ledger.init()
        ledger.claim("acct", "good-1", "fp")
    foreign_sqlite(
        path,
        [
            ("acct", "done-status", "fp", "done", 1, None, None, None, NOW, NOW),
            ("acct", "text-gen", "fp", "pending", "abc", None, None, None, NOW, NOW),
            ("acct", "text-time", "fp", "pending", 1, None, None, None, NOW, "yesterday"),
        ],
    )
    with Ledger.open(path, clock=lambda: NOW + 1) as ledger:
        ledger.claim("acct", "good-2", "fp")
    return path


@pytest.mark.parametrize(
    ("key", "problem"),
    [
        ("done-status", "status 'done' is neither pending nor completed"),
        ("text-gen", "generation 'abc' is not an integer"),
        ("text-time", "updated_at 'yesterday' is not an integer"),
    ],
)
def test_handle_on_a_malformed_row_raises_a_typed_error_that_names_it(foreign_rows_db, key, problem):
    ledger = Ledger.open(foreign_rows_db, clock=lambda: NOW)
    with pytest.raises(MalformedRowError) as info:
        ledger.handle("acct", key, "POST", "/", {}, b"", lambda body: pytest.fail("ran on a malformed row"))
    assert (info.value.principal, info.value.key, info.value.problem) == ("acct", key, problem)
    assert str(info.value) == f"malformed ledger row principal='acct' key='{key}': {problem}"
    ledger.close()


def test_a_malformed_row_fails_the_wsgi_request_closed_with_503(foreign_rows_db):
    from idemctl.wsgi import IdempotencyMiddleware

    def app_(environ, start_response):  # pragma: no cover - must not run
        raise AssertionError("the app ran")

    ledger = Ledger.open(foreign_rows_db, clock=lambda: NOW)
    mw = IdempotencyMiddleware(app_, ledger, principal=lambda env: "acct")
    seen: list[str] = []
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/",
        "QUERY_STRING": "",
        "CONTENT_LENGTH": "0",
        "HTTP_IDEMPOTENCY_KEY": "done-status",
        "wsgi.input": __import__("io").BytesIO(b""),
    }
    body = b"".join(mw(environ, lambda status, headers, exc_info=None: seen.append(status)))
    assert seen == ["503 Service Unavailable"]
    assert json.loads(body)["error"] == "idempotency_ledger_unavailable"
    ledger.close()


def test_pending_lists_around_malformed_rows_and_reports_each_in_one_line(foreign_rows_db):
    result = CliRunner().invoke(app, ["--db", str(foreign_rows_db), "pending", "--json"])
    assert result.exit_code == 2
    assert [r["key"] for r in json.loads(result.stdout)["rows"]] == ["good-1", "good-2"]
    assert result.stderr.splitlines() == [
        "error: malformed ledger row principal='acct' key='text-gen': generation 'abc' is not an integer; skipped",
        "error: malformed ledger row principal='acct' key='text-time': updated_at 'yesterday' is not an integer; skipped",
    ]
    human = CliRunner().invoke(app, ["--db", str(foreign_rows_db), "pending"])
    assert human.exit_code == 2 and "Traceback" not in human.stdout + human.stderr
    assert "good-1" in human.stdout and "good-2" in human.stdout
    assert len(human.stderr.splitlines()) == 2


def test_inspect_says_what_is_wrong_with_a_malformed_row(foreign_rows_db):
    result = CliRunner().invoke(app, ["--db", str(foreign_rows_db), "inspect", "done-status", "--principal", "acct"])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == (
        "error: malformed ledger row principal='acct' key='done-status': status 'done' is neither pending nor completed\n"
    )


def test_stats_counts_around_malformed_rows_without_failing(foreign_rows_db):
    result = CliRunner().invoke(app, ["--db", str(foreign_rows_db), "stats", "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["total"] == 5


def test_a_malformed_row_on_postgres_is_named_too(make_ledger, ledger_target):
    import psycopg

    ledger = make_ledger()
    if not ledger_target.startswith("postgres"):
        pytest.skip("the SQLite half is above")
    with psycopg.connect(ledger_target, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, created_at, updated_at)"
            " VALUES ('acct', 'k', 'fp', 'done', 1, 1, 1)"
        )
    with pytest.raises(MalformedRowError, match=r"key='k': status 'done' is neither pending nor completed$"):
        ledger.operator.get("acct", "k")


# -- inputs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("principal", [5, b"acct", ["acct"]])
def test_a_principal_that_is_not_a_str_is_a_type_error_and_writes_nothing(ledger, principal):
    with pytest.raises(TypeError, match=r"^principal must be a str, got "):
        ledger.handle(principal, "k", "POST", "/", {}, b"", lambda body: pytest.fail("ran"))
    with pytest.raises(TypeError):
        ledger.claim(principal, "k", "fp")
    assert ledger.operator.stats().total == 0


@pytest.mark.parametrize(
    ("principal", "message"),
    [
        ("acct\ud800", r"is not valid UTF-8 \(it holds a lone surrogate\)$"),
        ("acct\x00x", r"holds a NUL character$"),
    ],
)
def test_a_principal_that_cannot_be_stored_exactly_is_refused_before_any_write(ledger, principal, message):
    with pytest.raises(InvalidPrincipalError, match=message):
        ledger.handle(principal, "k", "POST", "/", {}, b"", lambda body: pytest.fail("ran"))
    with pytest.raises(InvalidPrincipalError):
        ledger.takeover(principal, "k", "fp")
    assert ledger.operator.stats().total == 0


def test_five_and_the_string_five_are_different_principals_never_one_row(ledger):
    ledger.handle("5", "k", "POST", "/", {}, b"", ok)
    with pytest.raises(TypeError):
        ledger.handle(5, "k", "POST", "/", {}, b"", ok)
    assert ledger.operator.stats().total == 1


def test_a_path_with_a_newline_cannot_forge_another_requests_fingerprint(ledger):
    forged = ("POST", "/a\ncontent-type:x\nx-api-version:", [], b"")
    real = ("POST", "/a", [("content-type", "x")], b"content-type:\nx-api-version:\n")
    # The algorithm stays the recipe's: the two really do collide...
    assert fingerprint(*forged) == fingerprint(*real)
    ledger.handle("acct", "k", real[0], real[1], real[2], real[3], lambda body: (201, {}, b"real"))
    # ...so the ledger refuses the path HTTP could never have carried.
    with pytest.raises(
        InvalidRequestError, match=r"^path '/a\\ncontent-type:x\\nx-api-version:' holds a control character$"
    ):
        ledger.handle("acct", "k", forged[0], forged[1], forged[2], forged[3], lambda body: pytest.fail("ran"))


@pytest.mark.parametrize("method", ["PO\nST", "P\x00", "PO ST"])
def test_a_protected_method_that_is_not_an_http_token_is_refused(ledger, method):
    strict = Ledger(ledger.store, policy=Policy(protected_methods=frozenset({method})), clock=ledger.clock)
    with pytest.raises(InvalidRequestError, match=r"is not an HTTP method token$"):
        strict.handle("acct", "k", method, "/", {}, b"", lambda body: pytest.fail("ran"))
    assert ledger.operator.stats().total == 0


# -- one definition of a row's state ------------------------------------------------------------


def test_a_stale_reservation_past_the_retention_is_listed_and_counted_as_stale(make_ledger, clock):
    # A worker that died days ago left its reservation pending: the next
    # retry takes it over, so it is stale whatever its age (and expired too:
    # the sweep may delete it).
    ledger = make_ledger(policy=Policy(pending_ttl_ms=30_000, retention_ms=60_000))
    ledger.claim("acct", "ancient", "fp")  # will be past the retention
    done = ledger.claim("acct", "done-long-ago", "fp")
    ledger.complete(done, 201, {}, b"")
    clock.advance(40_000)
    ledger.claim("acct", "stale-1", "fp")
    ledger.claim("acct", "stale-2", "fp")
    clock.advance(31_000)
    ledger.claim("acct", "fresh", "fp")
    stats = ledger.operator.stats()
    stale = [(v.row.key, v.state, v.takes_over_now) for v in ledger.operator.pending(stale_only=True)]
    assert stale == [
        ("ancient", State.EXPIRED, True),
        ("stale-1", State.PENDING_STALE, True),
        ("stale-2", State.PENDING_STALE, True),
    ]
    assert (stats.total, stats.pending_fresh, stats.pending_stale, stats.completed) == (5, 1, 3, 0)
    assert (stats.expired, stats.expired_pending) == (2, 1)  # "ancient" is in both counts
    assert ledger.operator.get("acct", "ancient").state is State.EXPIRED
    assert [(v.row.key, v.state, v.takes_over_now) for v in ledger.operator.pending()] == [
        *stale,
        ("fresh", State.PENDING_FRESH, False),
    ]
    # And it is what the request path does: the next retry takes it over.
    assert ledger.operator.predict("acct", "ancient", "fp").view.takes_over_now
    assert ledger.takeover("acct", "ancient", "fp").generation == 2


def test_cli_pending_stale_and_max_stale_see_a_reservation_days_past_the_retention(make_ledger, ledger_target):
    from idemctl import wall_clock_ms

    wall = wall_clock_ms()
    ledger = make_ledger()
    for key, age_ms in (("dead-for-days", 3 * 86_400_000), ("stale-1", 40_000), ("stale-2", 39_000), ("fresh", 0)):
        ledger.claim("acct", key, "fp", now=wall - age_ms)
    run = CliRunner().invoke
    where = ["--db", ledger_target, "--ttl", "30s", "--retention", "1d"]
    stale = json.loads(run(app, [*where, "pending", "--stale", "--json"]).stdout)
    assert [(r["key"], r["state"], r["takes_over_now"]) for r in stale["rows"]] == [
        ("dead-for-days", "expired", True),
        ("stale-1", "pending_stale", True),
        ("stale-2", "pending_stale", True),
    ]
    stats = run(app, [*where, "stats", "--json", "--max-stale", "2"])
    assert stats.exit_code == 1, stats.output
    doc = json.loads(stats.stdout)
    assert (doc["total"], doc["pending_stale"], doc["pending_fresh"], doc["expired"], doc["expired_pending"]) == (
        4,
        3,
        1,
        1,
        1,
    )
    assert doc["check_failed"] == ["3 stale pending rows (max 2)"]
    assert run(app, [*where, "stats", "--json", "--max-stale", "3"]).exit_code == 0
    # Only the dead worker's row: before, --max-stale 0 never fired for it.
    ledger.operator.purge("acct", "stale-1")
    ledger.operator.purge("acct", "stale-2")
    ledger.operator.purge("acct", "fresh", force=True)
    lone = run(app, [*where, "stats", "--max-stale", "0"])
    assert lone.exit_code == 1, lone.output
    assert "1 of them pending, also counted as stale" in lone.stdout
    listing = run(app, [*where, "pending", "--stale"])
    assert (
        listing.exit_code == 0 and "dead-for-days" in listing.stdout and "takes over as generation 2" in listing.stdout
    )


def test_stats_and_get_agree_on_every_row_of_a_random_ledger(make_ledger, clock):
    import random

    rnd = random.Random(7)
    ledger = make_ledger(policy=Policy(pending_ttl_ms=1_000, retention_ms=5_000))
    for i in range(200):
        r = ledger.claim("acct", f"k{i}", "fp")
        if rnd.random() < 0.5:
            ledger.complete(r, 200, {}, b"")
        clock.advance(rnd.randrange(0, 60))
    counts = {state: 0 for state in State}
    for i in range(200):
        counts[ledger.operator.get("acct", f"k{i}").state] += 1
    stats = ledger.operator.stats()
    expired_pending = sum(
        1 for i in range(200) if (v := ledger.operator.get("acct", f"k{i}")).state is State.EXPIRED and v.takes_over_now
    )
    assert counts == {
        State.PENDING_FRESH: stats.pending_fresh,
        State.PENDING_STALE: stats.pending_stale - stats.expired_pending,
        State.COMPLETED: stats.completed,
        State.EXPIRED: stats.expired,
    }
    assert stats.expired_pending == expired_pending > 0
    assert stats.pending_stale == len(list(ledger.operator.pending(stale_only=True)))
    assert stats.pending_fresh + stats.pending_stale + stats.completed + stats.expired == 200 + stats.expired_pending
    assert all(counts.values())  # the walk visited every state


def test_a_foreign_row_with_real_numbers_and_a_blob_body_replays_like_one_the_ledger_wrote(tmp_path):
    # SQLite stores integral REALs in INTEGER columns as integers; the body
    # stays a BLOB, and replays byte for byte like the TEXT one.
    path = tmp_path / "ledger.db"
    with Ledger.open(path, clock=lambda: NOW) as ledger:
        ledger.init()
    fp = fingerprint("POST", "/orders", {}, b"{}")
    headers = json.dumps({"content-type": "text/plain"})
    foreign_sqlite(
        path,
        [
            ("acct", "ints", fp, "completed", 3, 201, "caf\u00e9", headers, NOW, NOW),
            ("acct", "reals", fp, "completed", 3.0, 201.0, "caf\u00e9".encode(), headers, float(NOW), float(NOW)),
        ],
    )
    with Ledger.open(path, clock=lambda: NOW + 1) as ledger:
        ints, reals = ledger.lookup("acct", "ints"), ledger.lookup("acct", "reals")
        assert ints is not None and reals is not None
        assert (reals.generation, reals.response_status, reals.created_at, reals.updated_at) == (3, 201, NOW, NOW)
        assert type(reals.generation) is int and type(reals.updated_at) is int
        assert reals.body_bytes == ints.body_bytes == "caf\u00e9".encode()
        answers = [ledger.handle("acct", key, "POST", "/orders", {}, b"{}", ok) for key in ("ints", "reals")]
    assert [(a.outcome.value, a.status, a.headers, a.body) for a in answers] == [
        ("replayed", 201, (("content-type", "text/plain"),), "caf\u00e9".encode())
    ] * 2


def test_a_row_that_fails_the_quick_type_check_decodes_the_same_through_the_detailed_checks():
    # decode_row checks every column's type in one expression and falls back
    # to the detailed checks when that fails: integral floats (a driver's
    # REAL), str subclasses and bytes bodies must come out as the plain row.
    class Text(str):
        pass

    plain = ("acct", "k", "fp", "completed", 3, 201, "body", "{}", NOW, NOW)
    odd = (Text("acct"), Text("k"), Text("fp"), Text("completed"), 3.0, 201.0, "body", Text("{}"), float(NOW), NOW)
    expected = decode_row(SQLITE, plain)
    got = decode_row(SQLITE, odd)
    assert got == expected
    assert (type(got.generation), type(got.response_status), type(got.created_at)) == (int, int, int)
    assert decode_row(SQLITE, (*plain[:6], b"body", *plain[7:])).body_bytes == b"body"
    with pytest.raises(MalformedRowError, match=r"generation 3\.5 is not an integer"):
        decode_row(SQLITE, (*plain[:4], 3.5, *plain[5:]))
