"""The first caller's answer is built from the columns as they are stored,
without reading them back: it must be byte for byte what every replay of
those columns (`from_stored`) sends, for every shape of answer."""

from __future__ import annotations

import json

import pytest

from idemctl import Ledger, Policy
from idemctl.responses import OversizeBody, from_stored, header_problem, headers_to_json, to_store

POLICY = Policy(
    replayable_headers=("content-type", "location", "set-cookie", "x-note"),
    body_cap_bytes=64,
    header_cap_bytes=256,
)

SHAPES = {
    "json body and two headers": (201, {"Content-Type": "application/json", "Location": "/o/1"}, b'{"id":1}'),
    "headers not on the allowlist": (200, [("content-type", "text/plain"), ("x-secret", "s")], b"ok"),
    "a repeated header kept in order": (200, [("set-cookie", "a=1"), ("location", "/x"), ("Set-Cookie", "b=2")], b""),
    "a value trimmed of HTTP whitespace": (200, [("location", " \t/x\r\n")], b"x"),
    "latin-1 and tab in a value": (200, [("x-note", "caf\xe9\tcr\xe8me")], b"x"),
    "an unsendable value dropped": (200, [("location", "/x\r\nSet-Cookie: admin=1"), ("x-note", "kept")], b"x"),
    "a str body": (200, {"content-type": "text/plain; charset=utf-8"}, "h\xe9llo"),
    "a binary body": (200, {"content-type": "application/octet-stream"}, b"\xff\x00\xfe"),
    "204 with a body": (204, {"x-note": "n"}, b"ignored"),
    "304": (304, {}, b""),
    "a body over the cap": (200, {"location": "/big"}, b"b" * 65),
    "the capture's oversize marker": (200, {"location": "/big"}, OversizeBody(10_000)),
    "headers over the cap": (200, [("set-cookie", "c" * 100)] * 3, b"x"),
    "no headers at all": (201, None, b"made"),
}


@pytest.mark.parametrize("status, headers, body", SHAPES.values(), ids=SHAPES.keys())
def test_the_first_answer_is_what_a_replay_of_the_stored_columns_sends(status, headers, body, caplog):
    stored = to_store(status, headers, body, POLICY, row=("acct_1", "k1"))
    assert stored.answer == from_stored(stored.status, stored.body, stored.headers_json)


def test_a_first_answer_and_its_replay_through_the_ledger_are_equal_for_a_repeated_header():
    ledger = Ledger.open(":memory:", policy=Policy(replayable_headers=("location", "set-cookie")))
    ledger.init()
    app_headers = [("Set-Cookie", "a=1"), ("Location", "/o/1"), ("set-cookie", "b=2"), ("x-other", "no")]
    first = ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"{}", lambda body: (201, app_headers, "made"))
    replay = ledger.handle("acct_1", "k1", "POST", "/orders", {}, b"{}", lambda body: (500, [], b"never"))
    assert (
        first.wire
        == replay.wire
        == (
            201,
            (("location", "/o/1"), ("set-cookie", "a=1"), ("set-cookie", "b=2")),
            b"made",
        )
    )


def test_the_stored_headers_column_is_the_compact_json_object_for_any_strings():
    grouped = {"a": ["1", '2 "quoted" \\ back'], "b": ["\x01 caf\xe9 \u2028"]}
    stored = {"a": ["1", '2 "quoted" \\ back'], "b": "\x01 caf\xe9 \u2028"}
    expected = json.dumps(stored, separators=(",", ":"), ensure_ascii=False)
    assert headers_to_json(grouped) == expected
    assert headers_to_json({}) == "{}"


def test_a_foreign_row_with_nested_header_values_replays_without_them_every_time(caplog):
    row = '{"location":[["/x"]],"content-type":{"a":1},"x-note":"kept"}'
    for _ in range(2):  # the second time as well: nothing about a bad pair is remembered as good
        assert from_stored(200, "ok", row) == (200, (("x-note", "kept"),), b"ok")
    assert header_problem("x-note", "kept") is None
    assert header_problem("location", "/x\r\nSet-Cookie: a=1") == "its value contains CR, LF or NUL"
