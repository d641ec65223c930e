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
