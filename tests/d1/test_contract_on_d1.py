"""The ledger's contract tests (tests/ledger/: the contract, the fencing
token, the sweep, the operator's reads), run on D1 through its HTTP API:
the recipe's database, the same answers. The imported tests that do not run
on D1 (marked for other engines, or on no engine at all) are deselected here
by tests/d1/conftest.py: they run in their own modules."""

import pytest

from tests.ledger.test_fencing_token import *  # noqa: F403
from tests.ledger.test_ledger_contract import *  # noqa: F403 (the contract's tests, collected here again)
from tests.ledger.test_ledger_sweep import *  # noqa: F403
from tests.ledger.test_operator_reads import *  # noqa: F403

pytestmark = [pytest.mark.engines("d1"), pytest.mark.slow]


def test_pending_read_in_pages_on_d1_lists_every_row_once_in_order(ledger, clock, monkeypatch):
    pending_in_pages(ledger, clock, monkeypatch)  # noqa: F405 (from test_operator_reads)
