"""Upgrading a ledger whose rows hold keys as an older writer stored the
Idempotency-Key header ("k", quotes included) to schema 3, where such a row
is the key k: its rows are found and replayed, and a key stored in both
forms stops the upgrade before anything changes."""

from __future__ import annotations

import pytest

from idemctl import Ledger
from idemctl.errors import SchemaOutdatedError
from idemctl.outcomes import Outcome
from idemctl.storage.store_base import KeyStoredTwiceError
from tests.helpers import RecipeWriter

# The SQL schema's upgrade to key_id (schema 3), over rows older writers
# stored: a Redis ledger starts at the current version and has no such rows.
pytestmark = pytest.mark.engines("sqlite", "postgres", "mysql")


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
    make_ledger().close()
    writer = as_schema_2(ledger_target)
    try:
        writer.insert_completed("acct_1", '"legacy-1"', "fp", 201, "{}", "made", clock.now)
        writer.insert_completed("acct_1", "bare-1", "fp", 201, "{}", "made too", clock.now)
        before = stored(writer)
        ledger = Ledger.open(ledger_target, clock=clock)
        try:
            # Before the upgrade: an operator's read finds the row; requests
            # are refused before anything is claimed (no index guards a claim yet).
            assert ledger.get("acct_1", '"legacy-1"').row.key == '"legacy-1"'
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
        finally:
            ledger.close()
    finally:
        writer.close()


def test_a_key_stored_in_both_forms_stops_the_upgrade_and_changes_nothing(make_ledger, ledger_target, clock):
    make_ledger().close()
    writer = as_schema_2(ledger_target)
    try:
        writer.insert_completed("acct_1", '"k"', "fp", 201, "{}", "first", clock.now)
        writer.insert_completed("acct_1", "k", "fp", 201, "{}", "second", clock.now)
        before = stored(writer)
        ledger = Ledger.open(ledger_target, clock=clock)
        try:
            with pytest.raises(KeyStoredTwiceError, match=r"cannot upgrade to schema 3: a key is stored twice"):
                ledger.init()
            assert ledger.schema_version() == 2
            assert stored(writer) == before
            # Settled (one row deleted by hand, as the runbook says): the upgrade goes through.
            writer._run("DELETE FROM idempotency_keys WHERE principal = ? AND key = ?", ("acct_1", '"k"'))
            assert ledger.init().describe() == "upgraded from 2 to 3"
        finally:
            ledger.close()
    finally:
        writer.close()


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
