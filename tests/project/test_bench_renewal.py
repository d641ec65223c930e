"""The lease renewal benchmark still runs: `python -m bench.renewal --quick`
times a renewal tick on small ledgers of every engine, records each plan,
and its section renders. It asserts which plans were used, never how fast."""

from __future__ import annotations

import os

import pytest

from bench import report
from tests.helpers import quick_bench

pytestmark = pytest.mark.slow


def test_quick_renewal_benchmark_times_both_forms_and_records_primary_key_plans(tmp_path):
    res = quick_bench("renewal", tmp_path / "work")
    assert (res["held"], res["sizes"]) == (300, [1000, 3000])
    engines = res["engines"]
    for engine in engines.values():
        if "missing" in engine:  # no server here: a gap in the table, never silently dropped
            assert not os.environ.get("CI"), engine["missing"]
    sqlite = engines["sqlite"]
    assert sqlite["form"] == "each"
    assert {p["now_plan"] for p in sqlite["points"]} == {
        "SEARCH idempotency_keys USING INDEX idx_idempotency_keys_key_id (principal=? AND key_id=?)"
    }
    assert all(p["before_plan"].startswith("SCAN idempotency_keys") for p in sqlite["points"])
    if "missing" not in engines["mysql"]:
        assert engines["mysql"]["form"] == "or"
        assert all(
            "type range, key idx_idempotency_keys_key_id, rows 300" in p["now_plan"] for p in engines["mysql"]["points"]
        )
        assert all("type index, key PRIMARY" in p["before_plan"] for p in engines["mysql"]["points"])
    if "missing" not in engines["postgres"]:
        assert engines["postgres"]["form"] == "values" and "before_ms" not in engines["postgres"]["points"][0]
    table = "\n".join(report.renewal_table(res))
    assert "| lease renewal: one tick of 300 live reservations, ms (median) | 1,000 rows | 3,000 rows |" in table
    assert "| SQLite, now: one `UPDATE` per reservation by the key's unique index, one transaction |" in table
