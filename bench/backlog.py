"""Large ledgers, loaded fast: rows written with executemany in one
transaction with the journal off, then the file is put back into WAL mode.
Keys are random 128-bit hex strings, so the (principal, key) primary-key index
is as scattered as it is with real UUID keys."""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Iterator

from idemctl import Ledger

DAY_MS = 24 * 60 * 60 * 1000
BACKLOG_BODY = "o" * 256  # stored body of the pre-existing rows (kept small so loading stays fast)
PRINCIPALS = 1000


# One idempotency_keys row: principal, key, fingerprint, status, generation,
# response status, body and headers, created_at, updated_at.
Row = tuple[str, str, str, str, int, int | None, str | None, str | None, int, int]


def _rows(count: int, seed: int, updated_at: int, expired: bool) -> Iterator[Row]:
    rnd = random.Random(seed)
    for i in range(count):
        key = "%032x" % rnd.getrandbits(128)
        principal = "acct_%04d" % (i % PRINCIPALS)
        if i % 10 == 0:  # one in ten abandoned while pending
            yield (principal, key, "e" * 64, "pending", 1, None, None, None, updated_at + i, updated_at + i)
        else:
            yield (
                principal,
                key,
                "e" * 64,
                "completed",
                1,
                201,
                BACKLOG_BODY,
                '{"content-type":"application/json"}',
                updated_at + i,
                updated_at + i,
            )


def init_ledger(path: str) -> None:
    ledger = Ledger.open(path)
    ledger.init()
    ledger.close()


def add_rows(path: str, count: int, *, seed: int, updated_at: int) -> None:
    """Append `count` rows stamped from `updated_at` on; no other connection may be open."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=OFF").fetchall()
    conn.execute("PRAGMA synchronous=OFF")
    conn.execute("PRAGMA cache_size=-262144")
    conn.execute("BEGIN")
    conn.executemany(
        "INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, response_status, "
        "response_body, response_headers, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        _rows(count, seed, updated_at, True),
    )
    conn.execute("COMMIT")
    conn.execute("PRAGMA journal_mode=WAL").fetchall()
    conn.close()


def count_rows(path: str, where: str = "1 = 1", params: tuple[object, ...] = ()) -> int:
    conn = sqlite3.connect(path)
    try:
        return int(conn.execute(f"SELECT count(*) FROM idempotency_keys WHERE {where}", params).fetchone()[0])
    finally:
        conn.close()
