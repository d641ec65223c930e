"""`idemctl pending` streams: a long listing is written as it is read, never
built in memory first (bench/ measures the memory; this proves the shape)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from idemctl import Ledger, wall_clock_ms
from idemctl.cli import PENDING_TABLE_CHUNK, app
from idemctl.ledger import Operator
from tests.helpers import clean_env

ROWS = PENDING_TABLE_CHUNK * 2 + 1


@pytest.fixture
def many_pending(tmp_path, monkeypatch):
    clean_env(monkeypatch)
    path = str(tmp_path / "ledger.db")
    now = wall_clock_ms()
    with Ledger.open(path) as ledger:
        ledger.init()
        for i in range(ROWS):
            ledger.claim("acct", f"k{i:05d}", "fp", now=now - 60_000 + i)
    return path


def run(*args: str):
    return CliRunner().invoke(app, list(args), prog_name="idemctl", env={"COLUMNS": "200"})


def test_json_listing_of_every_row_is_one_valid_document(many_pending):
    result = run("pending", "--db", many_pending, "--limit", "0", "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert [r["key"] for r in doc["rows"]] == [f"k{i:05d}" for i in range(ROWS)]
    assert doc["truncated"] is False and doc["stale_only"] is False
    assert set(doc) == {"now", "pending_ttl_ms", "stale_only", "rows", "truncated"}


def test_json_listing_says_when_it_was_cut(many_pending):
    doc = json.loads(run("pending", "--db", many_pending, "--limit", str(ROWS - 1), "--json").stdout)
    assert (len(doc["rows"]), doc["truncated"]) == (ROWS - 1, True)
    doc = json.loads(run("pending", "--db", many_pending, "--limit", str(ROWS), "--json").stdout)
    assert (len(doc["rows"]), doc["truncated"]) == (ROWS, False)


def test_table_of_every_row_is_printed_in_chunks_with_one_header(many_pending):
    result = run("pending", "--db", many_pending, "--limit", "0")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert out.count("a retry now") == 1
    for i in (0, PENDING_TABLE_CHUNK, ROWS - 1):
        assert f"k{i:05d}" in out
    assert out.rstrip().splitlines()[-1] == f"{ROWS} pending row(s), oldest first; TTL 30 s"


def test_rows_reach_stdout_before_the_listing_is_finished(many_pending, monkeypatch):
    # The CLI reads through the ledger's operator.
    real_pending = Operator.pending

    def failing_midway(self, **kw):
        for n, view in enumerate(real_pending(self, **kw)):
            if n == 3:
                raise RuntimeError("the listing was still being read")
            yield view

    monkeypatch.setattr(Operator, "pending", failing_midway)
    result = run("pending", "--db", many_pending, "--limit", "0", "--json")
    assert isinstance(result.exception, RuntimeError)
    # The first three rows were already written when the fourth failed.
    assert all(f'"key": "k{i:05d}"' in result.stdout for i in range(3))
    assert '"key": "k00003"' not in result.stdout
