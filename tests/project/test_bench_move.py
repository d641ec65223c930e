"""The cutover benchmark still runs: `python -m bench.move --quick` copies a
small SQLite ledger into PostgreSQL three times, and its section renders.
It asserts what each pass copied, never how fast."""

from __future__ import annotations

import os

import pytest

from bench import report
from tests.helpers import quick_bench

pytestmark = pytest.mark.slow


def test_quick_move_benchmark_copies_then_finds_all_then_only_the_changes(tmp_path):
    res = quick_bench("move", tmp_path / "work")
    if "missing" in res:  # no PostgreSQL here: a gap, never silently dropped
        assert not os.environ.get("CI"), res["missing"]
        return
    assert (res["rows"], res["changed_rows"], res["destination_rows"]) == (2000, 20, 2010)
    first, again, after = res["first"], res["again"], res["after_changes"]
    assert (first["inserted"], first["unchanged"], first["fenced_copied"]) == (2000, 0, 1000)
    assert (again["inserted"], again["updated"], again["unchanged"], again["fenced_copied"]) == (0, 0, 2000, 0)
    assert (after["rows_read"], after["inserted"], after["updated"], after["unchanged"]) == (2010, 10, 10, 1990)
    assert all(p["conflicts"] == p["kept_newer"] == 0 for p in (first, again, after))
    table = "\n".join(report.move_table(res))
    assert "| moving a ledger: `idemctl copy`, 2,000 SQLite rows → PostgreSQL |" in table
    assert "| after 20 rows changed (the paused pass) | 2,010 | 20 |" in table
