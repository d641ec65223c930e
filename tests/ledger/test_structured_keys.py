"""The Idempotency-Key header as the IETF draft sends it: an RFC 8941
sf-string ("…", with quotes). The key is the string it carries, so the
quoted and the bare form are one key everywhere: every adapter, the
library, the CLI."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from idemctl import Ledger
from idemctl.cli import app
from idemctl.errors import InvalidKeyError
from idemctl.fingerprint import check_key, is_key_list, parse_key, stored_key, stored_key_identity
from tests.helpers import RecipeWriter, clean_env

# Rows written as the recipe's Worker writes them (its SQL, with the quotes):
# only a SQL ledger has such a writer; a Redis ledger has idemctl's alone.
SQL_ONLY = pytest.mark.engines("sqlite", "postgres", "mysql")

DRAFT_KEY = "8e03978e-40d5-43e8-bc93-6894a57f9324"  # the draft's own example


@pytest.mark.parametrize(
    ("value", "key"),
    [
        (f'"{DRAFT_KEY}"', DRAFT_KEY),
        ("order-42", "order-42"),
        ('"a\\"b\\\\c"', 'a"b\\c'),  # the two escapes
        ('"abc";v=1;x', "abc"),  # parameters are ignored
        ('"abc"  ', "abc"),
        ('"' + "k" * 255 + '"', "k" * 255),
        ('a"b', 'a"b'),  # a bare token may hold a quote after its start
        ('"abc"; v=1', "abc"),  # spaces after the ";" (RFC 8941 §4.2.3.2)
        ('"abc";a=1;b=?1;c="x y";d=:YQ==:;e=tok/1:2;f=-12.5;g=@1700000000;h=%"h%c3%a9";*i', "abc"),
        ('"a,b"', "a,b"),  # a comma inside the string is the key's
        ("a;v=1", "a;v=1"),  # a bare token is the key as sent
    ],
)
def test_a_key_is_the_string_an_sf_string_carries_or_the_bare_token(value, key):
    assert parse_key(value) == key


@pytest.mark.parametrize(
    "value",
    ['"abc', '"a"b"', '""', '"a\\xb"', '"' + "k" * 256 + '"', '"abc" trailing', '"tab\there"', "k" * 256],
    ids=["unterminated", "garbage-after", "empty", "bad-escape", "256-in-quotes", "not-a-parameter", "control", "long"],
)
def test_what_is_not_a_valid_key(value):
    assert parse_key(value) is None


@pytest.mark.parametrize(
    ("value", "is_list"),
    [
        ('"lx" ;x=1', False),  # a space before ";" ends the item: what follows is garbage
        ('"lx"\t;x=1', False),
        ('"lx";X=1', False),  # parameter names are lower-case
        ('"lx";1x=1', False),
        ('"lx";x=', False),
        ('"lx";x=1;', False),
        ('"lx";x="open', False),
        ('"lx";x=a b', False),
        ('"ly";x=1,"other"', True),  # a list, not an item
        ('"ly", "ly"', True),
        ("t2, t2", True),  # two fields a server joined, or a list
        ("t1,t2", True),
        (",", True),
    ],
)
def test_what_is_no_single_sf_item_is_not_a_key(value, is_list):
    assert parse_key(value) is None
    assert is_key_list(value) is is_list


def test_a_key_list_is_refused_by_name_and_a_quoted_comma_is_the_way_to_send_one():
    with pytest.raises(InvalidKeyError, match="a comma outside quotes makes it a list of keys"):
        check_key("inv_1,inv_2")
    assert check_key('"inv_1,inv_2"') == "inv_1,inv_2"
    # An operator still names a row an older writer stored under a bare comma key.
    assert stored_key("inv_1,inv_2") == "inv_1,inv_2"


def test_the_library_answers_a_key_list_as_it_answers_several_fields(ledger):
    runs: list[bytes] = []
    answer = ledger.handle(
        "acct_1", "t2, t2", "POST", "/orders", {}, b"", lambda body: runs.append(body) or (201, {}, b"")
    )
    assert (answer.status, json.loads(answer.body)["message"]) == (
        400,
        "Send exactly one Idempotency-Key: several fields, or a comma outside a quoted key, are a list.",
    )
    assert runs == [] and ledger.operator.stats().total == 0


def test_the_library_takes_the_quoted_key_as_the_bare_one(ledger):
    run = lambda body: (201, {}, b"made")  # noqa: E731
    first = ledger.handle("acct_1", '"abc"', "POST", "/orders", {}, b"", run)
    again = ledger.handle("acct_1", "abc", "POST", "/orders", {}, b"", run)
    assert (first.outcome.value, again.outcome.value) == ("executed", "replayed")
    assert ledger.operator.get("acct_1", '"abc"').row.key == "abc"


def test_inspect_finds_the_row_by_the_quoted_and_by_the_bare_key(ledger_target, make_ledger, monkeypatch, tmp_path):
    clean_env(monkeypatch, tmp_path, columns="200")
    ledger: Ledger = make_ledger()
    ledger.handle("acct_1", '"abc"', "POST", "/orders", {}, b"", lambda body: (201, {}, b"made"))
    documents = []
    for key in ('"abc"', "abc"):
        result = CliRunner().invoke(app, ["--db", ledger_target, "inspect", key, "--principal", "acct_1", "--json"])
        assert result.exit_code == 0, result.output
        document = json.loads(result.stdout)
        documents.append({k: v for k, v in document.items() if k not in ("now", "age_ms")})
    assert documents[0] == documents[1]
    assert documents[0]["key"] == "abc"


@pytest.fixture
def stored_by_the_recipe(ledger_target, make_ledger, monkeypatch, tmp_path, clock):
    """Store a completed row for acct_1 under a key as the recipe stored it
    (the header as it came), in an initialised ledger the CLI reads."""
    clean_env(monkeypatch, tmp_path, columns="200")
    make_ledger()

    def store(key: str) -> None:
        with RecipeWriter(ledger_target) as writer:
            writer.insert_completed("acct_1", key, "f" * 64, 201, "{}", "made", clock.now)

    return store


@SQL_ONLY
def test_inspect_finds_a_row_the_recipe_stored_with_the_quotes(ledger_target, stored_by_the_recipe):
    stored_by_the_recipe('"legacy-1"')
    for key in ('"legacy-1"', "legacy-1"):
        result = CliRunner().invoke(app, ["--db", ledger_target, "inspect", key, "--principal", "acct_1", "--json"])
        assert result.exit_code == 0, result.output
        document = json.loads(result.stdout)
        assert (document["key"], document["status"], document["response"]["status"]) == ('"legacy-1"', "completed", 201)


@pytest.mark.parametrize("value", ['"\\"abc\\""', '"\\"abc"'], ids=["quoted-string-inside", "quote-first"])
def test_a_key_that_itself_begins_with_a_quote_is_refused(value):
    # It would read as the header an older writer stored (see stored_key_identity).
    assert parse_key(value) is None


@SQL_ONLY
@pytest.mark.parametrize(
    ("stored", "key"),
    [
        ('"legacy-1"', "legacy-1"),
        ("k", "k"),
        ('"a\\"b\\\\c";v=1', 'a"b\\c'),
        ('"abc', '"abc'),
        ('"x"y', "x"),
        ('a"b', 'a"b'),
    ],
)
def test_the_database_computes_the_key_a_stored_value_names(stored, key, make_ledger, ledger_target, clock):
    make_ledger()
    with RecipeWriter(ledger_target) as writer:
        writer.insert_completed("acct_1", stored, "f" * 64, 201, "{}", "made", clock.now)
        _, rows = writer._run("SELECT key_id FROM idempotency_keys WHERE principal = ?", ("acct_1",))
    got = rows[0][0]
    assert (got.decode() if isinstance(got, bytes) else got) == key == stored_key_identity(stored)


@SQL_ONLY
def test_inspect_and_purge_reach_a_row_whose_stored_key_no_request_may_send_any_more(
    ledger_target, stored_by_the_recipe
):
    # The recipe took any 1-255 printable characters: "abc (unterminated) is
    # a 400 for idemctl now, but an operator still finds and deletes the row.
    stored_by_the_recipe('"abc')
    shown = CliRunner().invoke(app, ["--db", ledger_target, "inspect", '"abc', "--principal", "acct_1", "--json"])
    assert (shown.exit_code, json.loads(shown.stdout)["key"]) == (0, '"abc')
    purged = CliRunner().invoke(app, ["--db", ledger_target, "purge", '"abc', "--principal", "acct_1", "--yes"])
    assert purged.exit_code == 0, purged.output
    gone = CliRunner().invoke(app, ["--db", ledger_target, "inspect", '"abc', "--principal", "acct_1"])
    assert gone.exit_code == 1
    bad = CliRunner().invoke(app, ["--db", ledger_target, "inspect", "abc\n", "--principal", "acct_1"])
    assert bad.exit_code == 2 and "invalid Idempotency-Key" in bad.output
