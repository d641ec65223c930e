"""Replayable headers that could split a response (CR, LF, NUL) or that no
server would send are never stored and never sent: not in the first answer,
not in any replay, not from rows other programs wrote. Each one dropped is
logged at ERROR on the "idemctl" logger, escaped. Checked through the library
on both backends, through wsgiref's real server on loopback, and through a
real gunicorn."""

from __future__ import annotations

import json
import logging
import socket
import sqlite3
import threading
import wsgiref.handlers
from collections.abc import Callable, Iterator
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server, software_version

import pytest
import requests
from typer.testing import CliRunner

from idemctl import Ledger, Outcome, fingerprint, wall_clock_ms
from idemctl.cli import app as cli_app
from idemctl.responses import from_stored, header_problem
from idemctl.wsgi import IdempotencyMiddleware
from tests.e2e.gunicorn_server import GunicornServer

SPLIT_LOCATION = "/x\r\nSet-Cookie: admin=1"
SPLIT_LOG = r"response header 'location' not stored for principal='acct_A' key='k1': its value contains CR, LF or NUL: '/x\r\nSet-Cookie: admin=1'"
BODY = b'{"sku":"tea"}'
FP = fingerprint("POST", "/orders", [("Content-Type", "application/json")], BODY)
FIXED_DATE = "Tue, 14 Nov 2023 22:13:20 GMT"

# A foreign row's response_headers, as another program might have written it:
# only content-type and location may be replayed.
FOREIGN_HEADERS = json.dumps(
    {
        "content-type": "text/plain",
        "location": SPLIT_LOCATION,
        "x-nul": "a\x00b",
        "x-esc": "\x1b[31m",
        "retry-after": 5,
        "x-null": None,
        "x bad": "v",
        "x:colon": "v",
        "set-cookie\r\nx-injected": "1",
        "link": "</orders/7>; rel=self",
    }
)
FOREIGN_LOGS = [
    r"response header 'location' not replayed for principal='acct_A' key='k1': its value contains CR, LF or NUL: '/x\r\nSet-Cookie: admin=1'",
    r"response header 'x-nul' not replayed for principal='acct_A' key='k1': its value contains CR, LF or NUL: 'a\x00b'",
    r"response header 'x-esc' not replayed for principal='acct_A' key='k1': its value has characters HTTP does not allow in a field value: '\x1b[31m'",
    "response header 'retry-after' not replayed for principal='acct_A' key='k1': its value is a JSON number, not a string: 5",
    "response header 'x-null' not replayed for principal='acct_A' key='k1': its value is a JSON null, not a string: null",
    "response header 'x bad' not replayed for principal='acct_A' key='k1': its name is not a valid HTTP field name: 'v'",
    "response header 'x:colon' not replayed for principal='acct_A' key='k1': its name is not a valid HTTP field name: 'v'",
    r"response header 'set-cookie\r\nx-injected' not replayed for principal='acct_A' key='k1': its name is not a valid HTTP field name: '1'",
]
FOREIGN_KEPT = (("content-type", "text/plain"), ("link", "</orders/7>; rel=self"))


def idemctl_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "idemctl" and r.levelno == logging.ERROR]


def app_answer(headers: list[tuple[str, str]], status: int = 201, body: bytes = b"created"):
    calls: list[bytes] = []

    def run(raw: bytes):
        calls.append(raw)
        return status, headers, body

    return run, calls


def insert_foreign_row(db: Path, principal: str, key: str, headers_json: str, *, fp: str = FP) -> None:
    """A completed row written by another program, with the recipe's columns only."""
    conn = sqlite3.connect(db)
    try:
        conn.execute(
            "INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, response_status,"
            " response_body, response_headers, created_at, updated_at)"
            " VALUES (?, ?, ?, 'completed', 1, 201, 'from elsewhere', ?, ?, ?)",
            (principal, key, fp, headers_json, wall_clock_ms(), wall_clock_ms()),
        )
        conn.commit()
    finally:
        conn.close()


def cli_init(db: Path) -> None:
    result = CliRunner().invoke(cli_app, ["init", "--db", str(db)])
    assert result.exit_code == 0, result.output


# -- through the library, both backends -------------------------------------------------------
def test_a_location_with_crlf_is_never_stored_and_the_first_answer_equals_the_replay(ledger, caplog):
    run, calls = app_answer([("Content-Type", "text/plain"), ("Location", SPLIT_LOCATION)])
    with caplog.at_level(logging.ERROR, logger="idemctl"):
        first = ledger.handle("acct_A", "k1", "POST", "/orders", [("Content-Type", "application/json")], BODY, run)
        replay = ledger.handle("acct_A", "k1", "POST", "/orders", [("Content-Type", "application/json")], BODY, run)

    assert (first.outcome, replay.outcome) == (Outcome.EXECUTED, Outcome.REPLAYED)
    assert len(calls) == 1
    assert first.wire == replay.wire == (201, (("content-type", "text/plain"),), b"created")
    assert ledger.lookup("acct_A", "k1").response_headers == '{"content-type":"text/plain"}'
    # One line, when the answer was stored; the replay had nothing left to drop.
    assert idemctl_errors(caplog) == [SPLIT_LOG]


@pytest.mark.parametrize(
    ("value", "logged"),
    [
        ("/x\rSet-Cookie: a=1", r"its value contains CR, LF or NUL: '/x\rSet-Cookie: a=1'"),
        ("/x\nSet-Cookie: a=1", r"its value contains CR, LF or NUL: '/x\nSet-Cookie: a=1'"),
        ("/x\x00y", r"its value contains CR, LF or NUL: '/x\x00y'"),
        # Not splitting, but gunicorn answers 500 to these and wsgiref cannot
        # encode the last one, so every replay would fail.
        ("/x\x1b[2J", r"its value has characters HTTP does not allow in a field value: '/x\x1b[2J'"),
        ("/x\x7f", r"its value has characters HTTP does not allow in a field value: '/x\x7f'"),
        ("/заказ", r"its value has characters HTTP does not allow in a field value: '/\u0437\u0430\u043a\u0430\u0437'"),
    ],
    ids=["cr", "lf", "nul", "esc", "del", "beyond-latin-1"],
)
def test_each_unsendable_location_value_is_dropped_and_logged_escaped(ledger, caplog, value, logged):
    run, _ = app_answer([("Content-Type", "text/plain"), ("Location", value)])
    with caplog.at_level(logging.ERROR, logger="idemctl"):
        first = ledger.handle("acct_A", "k1", "POST", "/orders", [], BODY, run)
        replay = ledger.handle("acct_A", "k1", "POST", "/orders", [], BODY, run)

    assert first.wire == replay.wire == (201, (("content-type", "text/plain"),), b"created")
    messages = idemctl_errors(caplog)
    assert messages == [f"response header 'location' not stored for principal='acct_A' key='k1': {logged}"]
    assert not any(c in messages[0] for c in "\r\n\x00\x1b\x7f")


def test_a_long_dropped_value_is_quoted_in_the_log_up_to_200_characters(ledger, caplog):
    run, _ = app_answer([("Location", "/x\r\n" + "a" * 500)])
    with caplog.at_level(logging.ERROR, logger="idemctl"):
        ledger.handle("acct_A", "k1", "POST", "/orders", [], BODY, run)
    assert idemctl_errors(caplog) == [
        "response header 'location' not stored for principal='acct_A' key='k1': its value contains CR, LF or NUL: '/x\\r\\n"
        + "a" * 196
        + "'..."
    ]


def test_crlf_around_a_value_is_trimmed_like_fetch_does_so_the_header_is_kept(ledger, caplog):
    run, _ = app_answer([("Location", "\r\n /orders/7 \r\n")])
    with caplog.at_level(logging.ERROR, logger="idemctl"):
        first = ledger.handle("acct_A", "k1", "POST", "/orders", [], BODY, run)
    assert first.headers == (("location", "/orders/7"),)
    assert idemctl_errors(caplog) == []


def test_latin_1_and_tab_in_a_value_are_sendable_and_kept(ledger, caplog):
    run, _ = app_answer([("Content-Type", "text/plain;\tcharset=utf-8"), ("Location", "/caf\xe9")])
    with caplog.at_level(logging.ERROR, logger="idemctl"):
        first = ledger.handle("acct_A", "k1", "POST", "/orders", [], BODY, run)
        replay = ledger.handle("acct_A", "k1", "POST", "/orders", [], BODY, run)
    assert first.headers == replay.headers == (("content-type", "text/plain;\tcharset=utf-8"), ("location", "/caf\xe9"))
    assert idemctl_errors(caplog) == []


def test_a_bad_occurrence_of_a_repeated_header_is_dropped_and_the_others_are_kept(ledger, caplog):
    # Each field of a repeated header is stored (and checked) on its own.
    run, _ = app_answer([("Location", "/a"), ("Location", "/b\nX: y"), ("Location", "/c")])
    with caplog.at_level(logging.ERROR, logger="idemctl"):
        first = ledger.handle("acct_A", "k1", "POST", "/orders", [], BODY, run)
    assert first.headers == (("location", "/a"), ("location", "/c"))
    assert idemctl_errors(caplog) == [
        r"response header 'location' not stored for principal='acct_A' key='k1': its value contains CR, LF or NUL: '/b\nX: y'"
    ]
    assert ledger.handle("acct_A", "k1", "POST", "/orders", [], BODY, run).wire == first.wire


# -- foreign rows ---------------------------------------------------------------------------------
def test_a_foreign_row_with_unsendable_headers_replays_without_them_every_time(tmp_path, caplog):
    db = tmp_path / "ledger.db"
    cli_init(db)
    insert_foreign_row(db, "acct_A", "k1", FOREIGN_HEADERS)
    run, calls = app_answer([])
    with Ledger.open(db) as ledger, caplog.at_level(logging.ERROR, logger="idemctl"):
        answers = [
            ledger.handle("acct_A", "k1", "POST", "/orders", [("Content-Type", "application/json")], BODY, run)
            for _ in range(2)
        ]
    assert calls == []
    for answer in answers:
        assert answer.outcome is Outcome.REPLAYED
        assert answer.wire == (201, FOREIGN_KEPT, b"from elsewhere")
    # The row itself is left as it is, so every replay drops and logs again.
    assert idemctl_errors(caplog) == FOREIGN_LOGS * 2


def test_from_stored_names_the_row_in_its_log_when_told_which_row_it_is(caplog):
    with caplog.at_level(logging.ERROR, logger="idemctl"):
        status, headers, body = from_stored(201, "x", '{"location":"/a\\nb"}', row=("acct\x1b", "k1"))
    assert (status, headers, body) == (201, (), b"x")
    assert idemctl_errors(caplog) == [
        r"response header 'location' not replayed for principal='acct\x1b' key='k1': its value contains CR, LF or NUL: '/a\nb'"
    ]


@pytest.mark.parametrize(
    ("name", "value", "problem"),
    [
        ("location", "/orders/7", None),
        ("x-\u00e9", "v", "its name is not a valid HTTP field name"),
        ("", "v", "its name is not a valid HTTP field name"),
        ("location", "", None),
        ("location", ["/a"], "its value is a JSON array, not a string"),
        ("location", {"a": 1}, "its value is a JSON object, not a string"),
        ("location", True, "its value is a JSON boolean, not a string"),
    ],
)
def test_header_problem_says_what_is_wrong_or_none(name, value, problem):
    assert header_problem(name, value) == problem


# -- wsgiref's real server on loopback ----------------------------------------------------------
class QuietHandler(WSGIRequestHandler):
    def log_message(self, *args: object) -> None:  # keep the test output clean
        pass


@pytest.fixture
def serve(monkeypatch) -> Iterator[Callable[[object], tuple[str, int]]]:
    """Serve a WSGI app with wsgiref on 127.0.0.1; the Date header is pinned so
    that two answers can be compared byte for byte."""
    monkeypatch.setattr(wsgiref.handlers, "format_date_time", lambda _: FIXED_DATE)
    servers: list[WSGIServer] = []
    threads: list[threading.Thread] = []

    def start(app) -> tuple[str, int]:
        server = make_server("127.0.0.1", 0, app, handler_class=QuietHandler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        servers.append(server)
        threads.append(thread)
        return server.server_address[:2]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
    for thread in threads:
        thread.join(10)


def raw_post(address: tuple[str, int], key: str, body: bytes = BODY) -> bytes:
    """Send a POST and return every byte of the answer, as the client receives it."""
    request = (
        b"POST /orders HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Idempotency-Key: " + key.encode("ascii") + b"\r\n"
        b"Content-Length: " + str(len(body)).encode("ascii") + b"\r\nConnection: close\r\n\r\n" + body
    )
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(request)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def expected_wire(body: bytes) -> bytes:
    return (
        b"HTTP/1.0 201 Created\r\n"
        b"Date: " + FIXED_DATE.encode() + b"\r\n"
        b"Server: " + software_version.encode() + b"\r\n"
        b"content-type: text/plain\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n"
        b"\r\n" + body
    )


def test_wsgiref_sends_no_injected_set_cookie_and_the_replay_is_byte_identical(tmp_path, serve, caplog):
    runs: list[bytes] = []

    def orders(environ, start_response):
        runs.append(environ["wsgi.input"].read())
        start_response("201 Created", [("Content-Type", "text/plain"), ("Location", SPLIT_LOCATION)])
        return [b"created"]

    with Ledger.open(tmp_path / "ledger.db") as ledger, caplog.at_level(logging.ERROR, logger="idemctl"):
        ledger.init()
        address = serve(IdempotencyMiddleware(orders, ledger, principal=lambda env: "acct_A"))
        first = raw_post(address, "k1")
        replay = raw_post(address, "k1")

    assert runs == [BODY]
    assert first == replay == expected_wire(b"created")
    assert b"set-cookie" not in first.lower()
    assert idemctl_errors(caplog) == [SPLIT_LOG]


def test_wsgiref_replays_a_foreign_row_without_its_unsendable_headers(tmp_path, serve, caplog):
    db = tmp_path / "ledger.db"
    cli_init(db)
    insert_foreign_row(db, "acct_A", "k1", json.dumps({"content-type": "text/plain", "location": SPLIT_LOCATION}))

    def never(environ, start_response):  # pragma: no cover - a replay must not run the app
        raise AssertionError("the app ran for a replay")

    with Ledger.open(db) as ledger, caplog.at_level(logging.ERROR, logger="idemctl"):
        address = serve(IdempotencyMiddleware(never, ledger, principal=lambda env: "acct_A"))
        first = raw_post(address, "k1")
        again = raw_post(address, "k1")

    assert first == again == expected_wire(b"from elsewhere")
    assert b"set-cookie" not in first.lower()
    replayed = r"response header 'location' not replayed for principal='acct_A' key='k1': its value contains CR, LF or NUL: '/x\r\nSet-Cookie: admin=1'"
    assert idemctl_errors(caplog) == [replayed, replayed]


# -- gunicorn ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_gunicorn_replays_a_foreign_row_with_a_crlf_location_as_200_not_500(tmp_path):
    """gunicorn refuses such a header with a 500, so before the fix the client
    never got its stored answer."""
    body = json.dumps({"sku": "tea", "qty": 1}, separators=(",", ":")).encode()
    fp = fingerprint("POST", "/orders", [("Content-Type", "application/json")], body)
    with GunicornServer(tmp_path, workers=1) as srv:
        insert_foreign_row(
            srv.ledger_path,
            "acct_A",
            "foreign-1",
            json.dumps({"content-type": "text/plain", "location": SPLIT_LOCATION}),
            fp=fp,
        )
        answers = [
            requests.post(
                srv.url + "/orders",
                data=body,
                headers={"X-Api-Key": "demo-key-A", "Idempotency-Key": "foreign-1", "Content-Type": "application/json"},
                timeout=30,
            )
            for _ in range(2)
        ]
        log = srv.log()
    for answer in answers:
        assert answer.status_code == 201
        assert answer.content == b"from elsewhere"
        assert answer.headers["Content-Type"] == "text/plain"
        assert "Location" not in answer.headers and "Set-Cookie" not in answer.headers
    assert srv.count_orders("tea") == 0
    assert (
        log.count(
            "response header 'location' not replayed for principal='acct_A' key='foreign-1': its value contains CR, LF or NUL"
        )
        == 2
    )
