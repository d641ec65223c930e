"""Ledger.open's storage switches reach the backend."""

from __future__ import annotations

import os
import sqlite3

from idemctl import Ledger, Outcome


def ok(body):
    return 201, {}, b"ok"


def test_open_with_write_queue_off_never_creates_the_lock_file(tmp_path):
    path = str(tmp_path / "ledger.db")
    with Ledger.open(path, write_queue=False) as ledger:
        ledger.init()
        assert ledger.handle("acct", "k", "POST", "/o", {}, b"x", ok).outcome is Outcome.EXECUTED
        assert ledger.store.engine.write_queue_path is None
    assert not os.path.exists(path + "-idemctl.lock")
    with Ledger.open(path) as ledger:
        ledger.handle("acct", "k2", "POST", "/o", {}, b"x", ok)
        assert ledger.store.engine.write_queue_path == os.path.realpath(path) + "-idemctl.lock"
    assert os.path.exists(path + "-idemctl.lock")


def test_open_passes_synchronous_to_every_connection(tmp_path):
    path = str(tmp_path / "ledger.db")
    with Ledger.open(path, synchronous="NORMAL") as ledger:
        ledger.init()
        # 1 = NORMAL, 2 = FULL (https://sqlite.org/pragma.html#pragma_synchronous)
        assert ledger.store.engine.read("PRAGMA synchronous", {}) == [(1,)]
    with Ledger.open(path) as ledger:
        assert ledger.store.engine.read("PRAGMA synchronous", {}) == [(2,)]
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()


def test_sqlite_only_switches_are_accepted_for_any_backend(ledger_target):
    with Ledger.open(ledger_target, synchronous="NORMAL", write_queue=False) as ledger:
        ledger.init()
        assert ledger.handle("acct", "k", "POST", "/o", {}, b"x", ok).status == 201
