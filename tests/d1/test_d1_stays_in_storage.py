"""D1 is a storage concern: no module of the package outside
idemctl/storage/ names it (the registry finds it by its d1:// URLs), so the
CLI, the operations and the ledger learn nothing engine-specific."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "idemctl"
NAMES_D1 = re.compile(r"\bd1\b|cloudflare", re.IGNORECASE)


def modules_naming_d1(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "storage":
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if NAMES_D1.search(line):
                found.append(f"{path.relative_to(root.parent)}:{number}: {line.strip()}")
    return found


def test_no_module_outside_storage_names_d1() -> None:
    assert modules_naming_d1(PACKAGE) == []


def test_the_check_finds_a_module_that_names_d1(tmp_path: Path) -> None:
    (tmp_path / "storage").mkdir()
    (tmp_path / "storage" / "d1.py").write_text("KIND = 'd1'\n")
    (tmp_path / "cli.py").write_text("if url.startswith('d1://'):\n    pass\n")
    assert modules_naming_d1(tmp_path) == [f"{tmp_path.name}/cli.py:1: if url.startswith('d1://'):"]
