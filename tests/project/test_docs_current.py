"""The generated documentation is what its generators would write now, and
the shipped pages link only to files that exist."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# It runs the installed idemctl once per command, and its text follows the
# installed typer and rich, so it belongs with the process-starting tests
# that CI runs on the newest versions.
@pytest.mark.slow
def test_cli_reference_is_what_the_generator_writes_from_the_installed_idemctl():
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "gen_cli.py"), "--check"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{done.stderr}\n{done.stdout[-6000:]}"


def test_cli_help_is_made_plain_for_the_page():
    gen_cli = load(ROOT / "docs" / "gen_cli.py", "gen_cli")
    rich_help = "\n".join(
        [
            "                                        ",
            " Usage: idemctl sweep [OPTIONS]         ",
            "                                        ",
            "╭─ Options ────────────────────────────╮",
            "│ --dry-run          Delete nothing.   │",
            "│ --help     -h      Show this.        │",
            "╰──────────────────────────────────────╯",
            "                                        ",
            " Example: idemctl sweep --dry-run       ",
            "                                        ",
        ]
    )
    assert gen_cli.plain(rich_help) == "\n".join(
        [
            "Usage: idemctl sweep [OPTIONS]",
            "",
            "Options:",
            "  --dry-run          Delete nothing.",
            "  --help     -h      Show this.",
            "",
            "Example: idemctl sweep --dry-run",
        ]
    )
    assert gen_cli.commands(
        "Commands:\n  init   Create it.\n  sweep  Delete rows,\n         in batches.\n\nExit codes: 0"
    ) == [
        "init",
        "sweep",
    ]


def test_performance_page_is_rendered_from_the_published_results():
    sys.path.insert(0, str(ROOT))
    try:
        from bench import report
    finally:
        sys.path.remove(str(ROOT))
    results = json.loads((ROOT / "bench" / "results" / "latest.json").read_text(encoding="utf-8"))
    page = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    assert page == report.render_page(results), "docs/performance.md is stale: run python -m bench --report"


SHIPPED = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", SHIPPED, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_at_files_in_the_checkout(page):
    text = page.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        assert path.is_relative_to(ROOT) and path.exists(), f"{page.name} links to missing {target}"


@pytest.mark.parametrize("page", SHIPPED, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_pages_say_nothing_about_how_the_work_was_organised(page):
    text = page.read_text(encoding="utf-8")
    assert not re.search(r"owned by|\(issue \d+\)|issue #?\d+|previous run", text, re.I)
