"""The fingerprint and key rules, checked against the recipe's own vectors."""

from __future__ import annotations

import base64
import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from idemctl import fingerprint, is_valid_key
from idemctl.errors import InvalidBodyError
from tests.helpers import VECTORS_DIR

with open(os.path.join(VECTORS_DIR, "fingerprint.json"), encoding="utf-8") as _f:
    VECTORS = json.load(_f)
FINGERPRINT_CASES = VECTORS["fingerprints"]
KEY_CASES = VECTORS["keys"]


def test_vectors_file_has_the_expected_cases():
    assert VECTORS["fingerprint_headers"] == ["content-type", "x-api-version"]
    assert len(FINGERPRINT_CASES) == 79
    assert len(KEY_CASES) == 16


@pytest.mark.parametrize("case", FINGERPRINT_CASES, ids=[f"fp{i}" for i in range(len(FINGERPRINT_CASES))])
def test_fingerprint_matches_recipe_vector(case):
    body = base64.b64decode(case["body_b64"])
    got = fingerprint(case["method"], case["path_and_query"], case["headers"], body, VECTORS["fingerprint_headers"])
    assert got == case["fingerprint"]


@pytest.mark.parametrize("case", KEY_CASES, ids=[f"key{i}" for i in range(len(KEY_CASES))])
def test_key_validity_matches_recipe_vector(case):
    assert is_valid_key(case["key"]) is case["valid"]


def test_trailing_newline_key_is_invalid_even_though_python_dollar_would_accept_it():
    assert is_valid_key("abc") is True
    assert is_valid_key("abc\n") is False


def test_non_string_keys_are_invalid():
    assert is_valid_key(None) is False
    assert is_valid_key(b"abc") is False
    assert is_valid_key(123) is False


def test_mapping_and_pairs_give_the_same_fingerprint():
    body = b'{"a":1}'
    as_map = fingerprint("POST", "/o", {"Content-Type": "application/json", "X-Trace": "1"}, body)
    as_pairs = fingerprint("POST", "/o", [("content-type", "application/json")], body)
    assert as_map == as_pairs


def test_vertical_tab_is_not_trimmed_like_http_whitespace():
    # Fetch trims only space, tab, CR and LF; \x0b must survive and change the hash.
    plain = fingerprint("POST", "/o", [("content-type", "a")], b"")
    assert fingerprint("POST", "/o", [("content-type", " \ta\r\n")], b"") == plain
    assert fingerprint("POST", "/o", [("content-type", "\x0ba")], b"") != plain


def test_non_bytes_body_is_rejected_with_typed_error():
    with pytest.raises(InvalidBodyError, match="must be bytes, got str"):
        fingerprint("POST", "/o", [], "text")  # type: ignore[arg-type]


def test_custom_header_list_changes_what_counts():
    base = fingerprint("POST", "/o", [("if-match", "1")], b"", names=("if-match",))
    other = fingerprint("POST", "/o", [("if-match", "2")], b"", names=("if-match",))
    assert base != other
    assert fingerprint("POST", "/o", [("if-match", "1")], b"") == fingerprint("POST", "/o", [("if-match", "2")], b"")


header_names = st.sampled_from(["X-Trace-Id", "User-Agent", "Accept", "X-Request-Id", "Cookie"])


@given(
    noise=st.lists(
        st.tuples(header_names, st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20)),
        max_size=6,
    ),
    body=st.binary(max_size=64),
)
def test_headers_outside_the_list_never_affect_the_fingerprint(noise, body):
    listed = [("Content-Type", "application/json")]
    assert (
        fingerprint("POST", "/o", listed + noise, body)
        == fingerprint("POST", "/o", noise + listed, body)
        == fingerprint("POST", "/o", listed, body)
    )


@given(a=st.binary(max_size=64), b=st.binary(max_size=64))
def test_different_bodies_give_different_fingerprints(a, b):
    assert (fingerprint("POST", "/o", [], a) == fingerprint("POST", "/o", [], b)) == (a == b)


@given(st.text(max_size=300).filter(lambda k: not k.startswith('"')))
def test_key_rule_is_exactly_printable_ascii_1_to_255(key):
    # A value that begins with a quote is an sf-string (tests/ledger/test_structured_keys.py).
    # A comma outside quotes makes a list (several fields): never a bare key.
    expected = 1 <= len(key) <= 255 and all(0x20 <= ord(c) <= 0x7E for c in key) and "," not in key
    assert is_valid_key(key) is expected
