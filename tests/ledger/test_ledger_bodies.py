"""What is stored and replayed: TEXT or BLOB bodies, the header allowlist."""

from __future__ import annotations

import json

from idemctl import Outcome

HEADERS = {"Content-Type": "application/octet-stream"}


def post(ledger, run, *, key="k-1", body=b"\x00\x01", principal="acct_A"):
    return ledger.handle(principal, key, "POST", "/blobs", HEADERS, body, run)


def test_non_utf8_response_is_stored_as_blob_and_replayed_byte_for_byte(ledger):
    payload = bytes(range(256))
    first = post(ledger, lambda b: (200, [("Content-Type", "application/octet-stream")], payload))
    row = ledger.lookup("acct_A", "k-1")
    assert isinstance(row.response_body, bytes)
    assert row.response_body == payload
    replay = post(ledger, lambda b: (500, [], b"never"))
    assert replay.outcome is Outcome.REPLAYED
    assert replay.body == payload == first.body


def test_valid_utf8_response_is_stored_as_text(ledger):
    payload = "naïve café ✓".encode()
    post(ledger, lambda b: (200, {}, payload))
    row = ledger.lookup("acct_A", "k-1")
    assert row.response_body == "naïve café ✓"
    assert post(ledger, lambda b: (500, [], b"")).body == payload


def test_empty_body_is_stored_as_empty_text_and_replayed_empty(ledger):
    post(ledger, lambda b: (201, {}, b""))
    assert ledger.lookup("acct_A", "k-1").response_body == ""
    replay = post(ledger, lambda b: (500, [], b"x"))
    assert (replay.status, replay.body) == (201, b"")


def test_binary_request_body_reaches_the_mutation_untouched(ledger):
    seen = []
    body = b"\xff\xfe\xfd\x00"
    post(ledger, lambda b: (seen.append(b), (200, {}, b"ok"))[1], body=body)
    assert seen == [body]


def test_only_allowlisted_headers_are_stored_and_repeats_stay_separate_fields(ledger):
    headers = [
        ("content-type", "application/json"),
        ("LOCATION", " /a "),
        ("Location", "/b"),
        ("Set-Cookie", "s=1"),
        ("Cache-Control", "no-store"),
    ]
    answer = post(ledger, lambda b: (201, headers, b"{}"))
    row = ledger.lookup("acct_A", "k-1")
    assert json.loads(row.response_headers) == {"content-type": "application/json", "location": ["/a", "/b"]}
    assert answer.headers == (("content-type", "application/json"), ("location", "/a"), ("location", "/b"))


def test_response_with_no_replayable_headers_stores_empty_object(ledger):
    post(ledger, lambda b: (200, None, b"ok"))
    assert ledger.lookup("acct_A", "k-1").response_headers == "{}"
    assert post(ledger, lambda b: (500, [], b"")).headers == ()


def test_str_response_body_is_encoded_as_utf8(ledger):
    answer = post(ledger, lambda b: (200, {}, "plain ✓"))
    assert answer.body == "plain ✓".encode()
