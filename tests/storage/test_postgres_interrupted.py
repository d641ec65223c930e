"""Ctrl-C that stops a statement on a pooled PostgreSQL connection: the
connection goes back to the pool still running it, and the pool closes it.
psycopg_pool says so in two WARNING lines ("closing returned connection",
"discarding closed connection"), which reached an operator's terminal after
the CLI's own line; for a connection idemctl saw interrupted, nothing."""

from __future__ import annotations

import logging

import pytest

psycopg = pytest.importorskip("psycopg")
from psycopg.pq import TransactionStatus  # noqa: E402

from idemctl.storage.postgres import PostgresEngine  # noqa: E402

pytestmark = pytest.mark.engines("postgres")


class InterruptedMidStatement:
    """A statement cursor whose statement is sent, and then Ctrl-C comes
    before its result is read: the connection is left ACTIVE."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn

    def execute(self, sql: str, params: object) -> None:
        self.conn.pgconn.send_query(b"SELECT pg_sleep(0.2)")
        assert self.conn.pgconn.transaction_status == TransactionStatus.ACTIVE
        raise KeyboardInterrupt


def one_connection_engine(ledger_target: str) -> PostgresEngine:
    sep = "&" if "?" in ledger_target else "?"
    return PostgresEngine(f"{ledger_target}{sep}pool_min_size=1&pool_max_size=1")


@pytest.mark.parametrize("how", ["statement", "turn"])
def test_a_statement_stopped_by_ctrl_c_leaves_the_pool_silent(how, ledger_target, caplog) -> None:
    engine = one_connection_engine(ledger_target)
    try:
        assert engine.read("SELECT 1", {}) == [(1,)]
        caplog.set_level(logging.INFO, logger="psycopg")
        with pytest.raises(KeyboardInterrupt):
            if how == "statement":
                pool, conn = engine._checkout()
                conn.statement_cursor = InterruptedMidStatement(conn)  # type: ignore[assignment]
                pool.putconn(conn)
                engine.read("SELECT 1", {})
            else:
                with engine._connection() as conn:
                    InterruptedMidStatement(conn).execute("", {})
        # The pool replaced the connection: the next statement works.
        assert engine.read("SELECT 2", {}) == [(2,)]
    finally:
        engine.close()
    pool_lines = [r.getMessage() for r in caplog.records if r.name == "psycopg.pool" and r.levelno >= logging.WARNING]
    assert pool_lines == []


def test_a_connection_given_back_mid_statement_without_ctrl_c_is_still_reported(ledger_target, caplog) -> None:
    # The filter is for interrupted connections only: the pool's warning
    # about any other one still reaches the log.
    engine = one_connection_engine(ledger_target)
    try:
        pool, conn = engine._checkout()
        conn.pgconn.send_query(b"SELECT 1")
        caplog.set_level(logging.INFO, logger="psycopg")
        pool.putconn(conn)
    finally:
        engine.close()
    assert any(
        r.name == "psycopg.pool" and r.getMessage().startswith("closing returned connection") for r in caplog.records
    )
