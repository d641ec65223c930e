"""The ledger's contract tests (tests/ledger/: the contract, the fencing
token, the sweep, the operator's reads), run on D1 through its HTTP API:
the recipe's database, the same answers. A test marked for other engines
only is not collected here (its own `engines` mark wins)."""

import pytest

from tests.ledger.test_fencing_token import *  # noqa: F403
from tests.ledger.test_ledger_contract import *  # noqa: F403 (the contract's tests, collected here again)
from tests.ledger.test_ledger_sweep import *  # noqa: F403
from tests.ledger.test_operator_reads import *  # noqa: F403

pytestmark = [pytest.mark.engines("d1"), pytest.mark.slow]
