"""The benchmark harness has no import cycle either: what several entry
points share (the results file, the page) lives in bench/common.py, which
imports no entry point."""

from __future__ import annotations

import ast

from tests.helpers import ROOT

BENCH = ROOT / "bench"


def bench_imports() -> dict[str, set[str]]:
    """Each bench module and the bench modules it imports (function bodies included)."""
    names = {path.stem for path in BENCH.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in BENCH.glob("*.py"):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    found.add(node.module.split(".")[0])
                else:
                    found.update(alias.name for alias in node.names)
        graph[path.stem] = found & names - {path.stem}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each module that reaches itself again, with the path that does."""
    found = []
    for start in sorted(graph):
        stack = [(start, [start])]
        seen: set[str] = set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    found.append([*path, start])
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    return found


def test_no_bench_module_imports_one_that_imports_it_back():
    assert cycles(bench_imports()) == []


def test_the_cycle_check_finds_an_entry_point_imported_back():
    # The check above must be able to fail: renewal reading __main__'s paths again.
    graph = bench_imports()
    graph["renewal"] = graph["renewal"] | {"__main__"}
    assert ["__main__", "renewal", "__main__"] in cycles(graph)
