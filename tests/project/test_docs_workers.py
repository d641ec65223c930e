"""docs/workers.md starts from an example that runs as printed."""

from __future__ import annotations

import re

from tests.helpers import ROOT

PAGE = ROOT / "docs" / "workers.md"


def test_the_workers_page_first_example_charges_once_and_replays(tmp_path, monkeypatch, capsys):
    first = re.search(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)
    assert first, "docs/workers.md lost its first example"
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "workers_example"}
    exec(compile(first.group(1), str(PAGE), "exec"), namespace)
    namespace["ledger"].close()  # type: ignore[attr-defined]
    assert capsys.readouterr().out == (
        "charging pay_1\n{'charged': 1250, 'currency': 'EUR'}\n{'charged': 1250, 'currency': 'EUR'}\n"
    )
    assert (tmp_path / "idempotency.db").exists()


def test_the_workers_page_serializer_example_brings_back_a_dataclass_a_model_and_a_decimal(capsys):
    from idemctl import Ledger

    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)
    example = next((b for b in blocks if "serializer=(asdict" in b), None)
    assert example, "docs/workers.md lost its serializer example"
    ledger = Ledger.open(":memory:")
    ledger.init()
    # Compiled as a page reader runs it: without this module's __future__ import.
    exec(compile(example, str(PAGE), "exec", dont_inherit=True), {"__name__": "workers_serializers", "ledger": ledger})
    ledger.close()
    assert capsys.readouterr().out == (
        "Receipt(payment_id='pay_9', amount='12.50') Receipt(payment_id='pay_9', amount='12.50')\n"
        "True\n"
        "Decimal('99.95')\n"
    )
