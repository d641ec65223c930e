"""Upgrading a ledger whose rows hold keys as an older writer stored the
Idempotency-Key header ("k", quotes included) to schema 3, where such a row
is the key k: its rows are found and replayed, and a key stored in both
forms stops the upgrade before anything changes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest

from idemctl import Ledger
from idemctl.errors import SchemaOutdatedError
from idemctl.outcomes import InitAction, Outcome
from idemctl.storage.store_base import KeyStoredTwiceError
from tests.helpers import RecipeWriter

# The SQL schema's upgrade to key_id (schema 3), over rows older writers
# stored: a Redis ledger starts at the current version and has no such rows.
pytestmark = pytest.mark.engines("sqlite", "postgres", "mysql")


@contextlib.contextmanager
def schema_2_holding(
    make_ledger: Callable[..., Ledger], target: str, now: int, rows: list[tuple[str, str, str]]
) -> Iterator[RecipeWriter]:
    """This test's ledger as schema 2 left it, holding completed `rows`
    (principal, key as stored, body), through a writer of its own."""
    make_ledger().close()
    writer = as_schema_2(target)
    try:
        for principal, key, body in rows:
            writer.insert_completed(principal, key, "fp", 201, "{}", body, now)
        yield writer
    finally:
        writer.close()


def as_schema_2(target: str) -> RecipeWriter:
    """This test's ledger as idemctl's schema 2 left it (no key_id), through
    a connection of its own."""
    writer = RecipeWriter(target)
    if writer.mysql:
        writer._run("ALTER TABLE idempotency_keys DROP INDEX idx_idempotency_keys_key_id, DROP COLUMN key_id", ())
    else:
        writer._run("DROP INDEX idx_idempotency_keys_key_id", ())
        writer._run("ALTER TABLE idempotency_keys DROP COLUMN key_id", ())
    writer._run("DELETE FROM idemctl_schema_version", ())
    writer._run("INSERT INTO idemctl_schema_version (version, applied_at) VALUES (2, 0)", ())
    return writer


def stored(writer: RecipeWriter) -> list[tuple[str, str, str]]:
    _, rows = writer._run("SELECT principal, key, status FROM idempotency_keys ORDER BY principal, key", ())
    return [tuple(v.decode() if isinstance(v, bytes) else v for v in row) for row in rows]  # type: ignore[misc]


def test_upgrading_keeps_the_quoted_rows_and_replays_them(make_ledger, ledger_target, clock):
    rows = [("acct_1", '"legacy-1"', "made"), ("acct_1", "bare-1", "made too")]
    with schema_2_holding(make_ledger, ledger_target, clock.now, rows) as writer:
        before = stored(writer)
        with Ledger.open(ledger_target, clock=clock) as ledger:
            # Before the upgrade: an operator's read finds the row; requests
            # are refused before anything is claimed (no index guards a claim yet).
            assert ledger.operator.get("acct_1", '"legacy-1"').row.key == '"legacy-1"'
            refused: list[bytes] = []
            for key in ('"legacy-1"', "fresh"):
                with pytest.raises(SchemaOutdatedError):
                    ledger.handle("acct_1", key, "POST", "/", {}, b"", lambda b: refused.append(b) or (201, {}, b""))
            assert refused == [] and stored(writer) == before
            assert ledger.init().describe() == "upgraded from 2 to 3"
            assert stored(writer) == before
            ran: list[bytes] = []
            again = ledger.handle(
                "acct_1", '"legacy-1"', "POST", "/", {}, b"", lambda b: ran.append(b) or (500, {}, b"")
            )
            # The stored fingerprint "fp" is no request's: a reuse, refused, never a run.
            assert (again.status, again.outcome, ran) == (409, Outcome.REUSED, [])


def test_a_key_stored_in_both_forms_stops_the_upgrade_and_changes_nothing(make_ledger, ledger_target, clock):
    rows = [("acct_1", '"k"', "first"), ("acct_1", "k", "second")]
    with schema_2_holding(make_ledger, ledger_target, clock.now, rows) as writer:
        before = stored(writer)
        with Ledger.open(ledger_target, clock=clock) as ledger:
            with pytest.raises(KeyStoredTwiceError, match=r"cannot upgrade to schema 3: a key is stored twice"):
                ledger.init()
            assert ledger.schema_version() == 2
            assert stored(writer) == before
            # Settled (one row deleted by hand, as the runbook says): the upgrade goes through.
            writer._run("DELETE FROM idempotency_keys WHERE principal = ? AND key = ?", ("acct_1", '"k"'))
            assert ledger.init().describe() == "upgraded from 2 to 3"


def test_the_runbooks_rewrite_gives_quoted_rows_their_bare_key_and_they_stay_one_key(make_ledger, ledger_target, clock):
    ledger: Ledger = make_ledger()
    writer = RecipeWriter(ledger_target)
    try:
        writer.insert_completed("acct_1", '"legacy-1"', "fp", 201, "{}", "made", clock.now)
        _, pairs = writer._run(
            "SELECT q.principal FROM idempotency_keys q JOIN idempotency_keys b"
            " ON b.principal = q.principal AND q.key = "
            + ("CONCAT('\"', b.key, '\"')" if writer.mysql else "'\"' || b.key || '\"'"),
            (),
        )
        assert pairs == []  # the runbook's search for keys stored in both forms: none here
        writer._run("UPDATE idempotency_keys SET key = key_id WHERE key <> key_id", ())
        assert stored(writer) == [("acct_1", "legacy-1", "completed")]
        _, left = writer._run("SELECT count(*) FROM idempotency_keys WHERE key <> key_id", ())
        assert left[0][0] == 0
    finally:
        writer.close()
    ran: list[bytes] = []
    again = ledger.handle("acct_1", '"legacy-1"', "POST", "/", {}, b"", lambda b: ran.append(b) or (201, {}, b""))
    assert (again.status, again.outcome, ran) == (409, Outcome.REUSED, [])


@pytest.mark.engines("mysql")
def test_an_upgrade_run_again_after_its_alter_went_through_finishes(make_ledger, ledger_target):
    # MySQL's ALTER has no IF NOT EXISTS: an init that failed after the ALTER
    # (before its version row) is run again and finds the column and index.
    make_ledger().close()
    writer = RecipeWriter(ledger_target)
    try:
        writer._run("DELETE FROM idemctl_schema_version", ())
        writer._run("INSERT INTO idemctl_schema_version (version, applied_at) VALUES (2, 0)", ())
    finally:
        writer.close()
    with Ledger.open(ledger_target) as ledger:
        assert ledger.init().describe() == "upgraded from 2 to 3"


@pytest.mark.parametrize(
    "twice",
    [
        pytest.param(('"k"', "k"), id="quoted-and-bare"),
        pytest.param(('"k"', '"k" trailing'), id="two-quoted-forms"),
        pytest.param(('"a\\"b"', 'a"b'), id="escaped-quote"),
    ],
)
def test_init_dry_run_finds_a_key_stored_twice_as_init_does_and_writes_nothing(
    make_ledger, ledger_target, clock, twice, tmp_path, monkeypatch
):
    from typer.testing import CliRunner

    from idemctl.cli import app
    from tests.helpers import clean_env

    rows = [("acct_1", twice[0], "first"), ("acct_1", twice[1], "second"), ("acct_2", twice[1], "another principal's")]
    with schema_2_holding(make_ledger, ledger_target, clock.now, rows) as writer:
        before = stored(writer)
        clean_env(monkeypatch, tmp_path)
        dry = CliRunner().invoke(app, ["--db", ledger_target, "init", "--dry-run"])
        real = CliRunner().invoke(app, ["--db", ledger_target, "init"])
        assert (dry.exit_code, dry.stdout) == (real.exit_code, real.stdout) == (2, "")
        assert dry.stderr == real.stderr
        assert "cannot upgrade to schema 3: a key is stored twice for one principal" in dry.stderr
        assert stored(writer) == before


def test_init_dry_run_of_a_ledger_whose_keys_are_each_stored_once_would_upgrade(make_ledger, ledger_target, clock):
    keys = [("acct_1", '"k"'), ("acct_2", "k"), ("acct_1", '"open'), ("acct_1", "open")]
    rows = [(p, k, "made") for p, k in keys]
    with (
        schema_2_holding(make_ledger, ledger_target, clock.now, rows),
        Ledger.open(ledger_target, clock=clock) as ledger,
    ):
        would = ledger.init(dry_run=True)
        assert (would.action, would.from_version, would.dry_run) == (InitAction.UPGRADED, 2, True)
        assert ledger.schema_version() == 2
        assert ledger.init().describe() == "upgraded from 2 to 3"


def test_the_dry_runs_key_identity_is_the_databases_key_id(make_ledger, ledger_target, clock):
    from idemctl.storage.store_base import key_id

    keys = ['"k"', "k2", '"a\\"b"', '"c\\\\"', '"d\\\\\\"e" x', '"open', '""', '"x"y"', 'plain"quote']
    make_ledger()  # schema 3: the database computes key_id
    writer = RecipeWriter(ledger_target)
    try:
        for key in keys:
            writer.insert_completed("acct_9", key, "fp", 201, "{}", "made", clock.now)
        _, rows = writer._run("SELECT key, key_id FROM idempotency_keys WHERE principal = 'acct_9'", ())
        computed = {
            (k.decode() if isinstance(k, bytes) else k): (i.decode() if isinstance(i, bytes) else i) for k, i in rows
        }
        assert computed == {key: key_id(key) for key in keys}
    finally:
        writer.close()
