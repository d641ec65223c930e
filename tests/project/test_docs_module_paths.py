"""Every module the reference pages name exists in the checkout: a file
path (`idemctl/ledger/steps.py`, `cli/simulate.py`, `idemctl/exchange/`)
and a dotted name (`idemctl.ledger.Operator`, `idemctl.decision.run`),
down to the name the module defines. A page that names a module moved or
removed fails here, not in a reader's hands."""

from __future__ import annotations

import ast
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

from tests.helpers import ROOT

PAGES = sorted((ROOT / "docs").glob("*.md"))
# A file path: segments of letters, digits, dots, dashes and underscores
# ending in .py, or a top folder of the checkout with a trailing slash.
PY_PATH = re.compile(r"(?<![\w./:-])((?:[\w.-]+/)*[\w-]+\.py)\b")
FOLDER = re.compile(r"`((?:idemctl|tests|bench|examples|schema|docs)/(?:[\w.-]+/)*)`")
DOTTED = re.compile(r"(?<![\w./-])(idemctl(?:\.\w+)+)")
CODE_BLOCK = re.compile(r"^```.*?^```", re.S | re.M)
# Dotted names under a module's name that are not Python paths.
NOT_PATHS = {
    "idemctl.ledger.duration",  # an OpenTelemetry histogram (observability.md)
}


@cache
def tracked_files() -> tuple[str, ...]:
    """The checkout's files, as git tracks them (and the untracked ones not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return tuple(listed.stdout.split())


@cache
def parsed(path: str) -> ast.Module:
    return ast.parse((ROOT / path).read_text(encoding="utf-8"))


def file_exists(path: str, files: tuple[str, ...]) -> bool:
    """A path as the checkout's, the package's (``cli/core.py``), or the
    tail of one (``orders/views.py`` in the Django example; a bare
    ``statements.py`` where the page's section names its folder)."""
    if path in files or f"idemctl/{path}" in files:
        return True
    return any(f.endswith("/" + path) for f in files)


def folder_exists(path: str, files: tuple[str, ...]) -> bool:
    return any(f.startswith(path) for f in files)


def _defined_names(tree: ast.Module | ast.ClassDef) -> dict[str, ast.AST]:
    """Each name a module (or a class) defines, assigns or imports at its top."""
    names: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names[leaf.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
    return names


def dotted_exists(name: str, files: tuple[str, ...]) -> bool:
    """Whether `name` is a module of the tree, or a module and then the
    names it defines (a class, then one of the class's own), following
    the module's imports to where a name is defined."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        base = "/".join(parts[:cut])
        for candidate in (f"{base}.py", f"{base}/__init__.py"):
            if candidate in files:
                tree = parsed(candidate)
                package = parts[:cut] if candidate.endswith("__init__.py") else parts[: cut - 1]
                return _defined_in(tree, parts[cut:], package, files)
    return False


def _defined_in(node: ast.AST, rest: list[str], package: list[str], files: tuple[str, ...]) -> bool:
    for index, attr in enumerate(rest):
        if not isinstance(node, ast.Module | ast.ClassDef):
            return False
        found = _defined_names(node).get(attr)
        if isinstance(found, ast.ImportFrom):
            # Defined elsewhere: look it up where it comes from.
            source = package[: len(package) - found.level + 1] if found.level else []
            module = [*source, *(found.module or "").split(".")] if found.module else source
            alias = next(a for a in found.names if (a.asname or a.name) == attr)
            return dotted_exists(".".join([*module, alias.name, *rest[index + 1 :]]), files)
        if found is None:
            return False
        node = found
    return True


def missing_paths(text: str, files: tuple[str, ...]) -> list[str]:
    """The module paths `text` names that the checkout does not hold. File
    paths count in the prose and links (a code block's ``# app.py`` is the
    reader's file); dotted names count in code blocks too."""
    prose = CODE_BLOCK.sub("", text)
    missing = [p for p in PY_PATH.findall(prose) if not file_exists(p.removeprefix("../"), files)]
    missing += [p for p in FOLDER.findall(prose) if not folder_exists(p, files)]
    for name in DOTTED.findall(text):
        top = name.split(".")[1]
        is_module_path = f"idemctl/{top}.py" in files or f"idemctl/{top}/__init__.py" in files
        if is_module_path and name not in NOT_PATHS and not dotted_exists(name, files):
            missing.append(name)
    return sorted(set(missing))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_module_a_page_names_exists_in_the_checkout(page: Path):
    assert missing_paths(page.read_text(encoding="utf-8"), tracked_files()) == []


def test_the_module_path_check_finds_what_does_not_exist():
    # The check above must be able to fail: a moved module, a vanished folder,
    # a name the module does not define, and a module that is not there.
    text = (
        "The ledger's steps are in `idemctl/ledger/steps.py` and `cli/simulate.py` runs them; "
        "`idemctl/ledger/gone.py`, `idemctl/nowhere/`, `cli/absent.py`, `idemctl.ledger.Operator`, "
        "`idemctl.ledger.Operator.stats`, `idemctl.ledger.NoSuchName`, `idemctl.exchange.nothing.here` "
        "and the span attribute `idemctl.fenced`."
    )
    assert missing_paths(text, tracked_files()) == [
        "cli/absent.py",
        "idemctl.exchange.nothing.here",
        "idemctl.ledger.NoSuchName",
        "idemctl/ledger/gone.py",
        "idemctl/nowhere/",
    ]
