"""A process that opened an outdated ledger sees an upgrade another process
made, on every backend: the tables a running ledger found missing are looked
for again, so nothing it records after the upgrade is silently dropped."""

from __future__ import annotations

import subprocess
import sys

import pytest

from idemctl import Ledger, Outcome
from idemctl.errors import SchemaOutdatedError
from idemctl.schema import schema_files
from idemctl.storage import Store, open_engine

BODY = b'{"sku":"tea"}'


def recipe_only(target: str) -> None:
    """A ledger holding the recipe's table alone (schema version 0)."""
    engine = open_engine(target)
    recipe = schema_files(engine.dialect.name)[0]
    if recipe.version != 0:
        engine.close()
        pytest.skip(f"a {engine.dialect.name} ledger never held the recipe's table alone: it is born at schema 2")
    engine.migrate(lambda tx: tx.script(recipe.sql), write=True)
    engine.close()


def init_in_another_process(target: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "idemctl", "init", "--db", target],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def ok(body: bytes):
    return 201, [], b"done"


# A ledger opened at an older SQL schema (the recipe's table alone): a Redis
# ledger has one version, written by `init`.
@pytest.mark.engines("sqlite", "postgres", "mysql")
def test_a_fenced_out_completion_is_recorded_after_another_process_upgrades_the_open_ledger(ledger_target, clock):
    recipe_only(ledger_target)
    server = Ledger.open(ledger_target, clock=clock)
    assert server.schema_version() == 0 and not server.has_fenced_log()
    with pytest.raises(SchemaOutdatedError):
        server.handle("acct", "k0", "POST", "/o", {}, BODY, ok)

    assert "upgraded" in init_in_another_process(ledger_target)

    # The running server's requests work again, and a completion fenced out
    # by a takeover is recorded, as on a ledger opened after the upgrade.
    late = server.begin("acct", "k1", "POST", "/o", {}, BODY)
    clock.advance(server.policy.pending_ttl_ms + 1)
    other = Ledger.open(ledger_target, clock=clock)
    assert other.handle("acct", "k1", "POST", "/o", {}, BODY, ok).outcome is Outcome.TAKEN_OVER
    fenced = server.finish(late, 201, [], b"late")
    assert fenced.outcome is Outcome.FENCED_OUT
    assert server.has_fenced_log()
    fresh = Ledger.open(ledger_target)
    events = [
        (e.key, e.superseded_generation, e.current_generation, e.computed_status) for e in fresh.operator.fenced()
    ]
    assert events == [("k1", 1, 2, 201)]
    for ledger in (server, other, fresh):
        ledger.close()


@pytest.mark.engines("sqlite", "postgres", "mysql")
def test_a_running_ledger_sweeps_the_fenced_out_log_once_another_process_created_it(ledger_target, clock):
    recipe_only(ledger_target)
    server = Ledger.open(ledger_target, clock=clock)
    assert server.operator.sweep().fenced_deleted == 0  # no log yet: nothing to sweep, no error
    init_in_another_process(ledger_target)
    late = server.claim("acct", "k1", "fp")
    clock.advance(server.policy.pending_ttl_ms + 1)
    server.complete(server.takeover("acct", "k1", "fp"), 201, {}, b"")
    assert server.complete(late, 201, {}, b"").event is not None
    clock.advance(server.policy.fenced_retention_ms + 1)
    assert server.operator.count_fenced_expired() == 1
    assert server.operator.sweep().fenced_deleted == 1
    server.close()


def test_a_current_ledger_looks_its_tables_up_once(ledger_target, monkeypatch):
    ledger = Ledger.open(ledger_target)
    ledger.init()
    store: Store = ledger.store
    lookups = []
    real = store.engine.table_names
    monkeypatch.setattr(store.engine, "table_names", lambda names: lookups.append(1) or real(names))
    store.forget_schema()
    for _ in range(5):
        assert store.has_fenced_log()
    assert len(lookups) == 1
    ledger.close()
