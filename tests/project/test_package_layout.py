"""The package's shape, held as tests: no module over 600 lines, no import
cycle (imports under TYPE_CHECKING included), the library never imports the
CLI, and a public API small enough to read in one screen."""

from __future__ import annotations

import ast
from pathlib import Path

import idemctl

PACKAGE = Path(idemctl.__file__).parent
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every idemctl module this one imports, wherever the import statement is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in MODULES)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if target in MODULES:
                    out.add(target)
                elif source in MODULES:
                    out.add(source)
    out.discard(name)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in GRAPH[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    return found


def test_no_module_is_longer_than_six_hundred_lines():
    lengths = {name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in MODULES.items()}
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}


def test_no_two_modules_import_each_other_even_for_type_checking():
    assert _cycles() == []


def test_the_library_never_imports_the_cli():
    # `python -m idemctl` is the CLI's own entry point.
    library = {name for name in GRAPH if not name.startswith("idemctl.cli") and name != "idemctl.__main__"}
    assert {name: sorted(d for d in GRAPH[name] if d.startswith("idemctl.cli")) for name in library} == {
        name: [] for name in library
    }


def test_the_public_api_is_at_most_thirty_names_and_each_one_exists():
    assert len(idemctl.__all__) <= 30
    assert [name for name in idemctl.__all__ if not hasattr(idemctl, name)] == []


def test_the_cycle_finder_finds_a_cycle():
    # The check above must be able to fail: two modules that import each other.
    GRAPH["idemctl.__fake_a"], GRAPH["idemctl.__fake_b"] = {"idemctl.__fake_b"}, {"idemctl.__fake_a"}
    try:
        assert ["idemctl.__fake_a", "idemctl.__fake_b"] in _cycles()
    finally:
        del GRAPH["idemctl.__fake_a"], GRAPH["idemctl.__fake_b"]


# Who may import whom: a module under the prefix on the left imports none of
# the modules under the prefixes on the right.
DOORS = ("idemctl.wsgi", "idemctl.asgi", "idemctl.fastapi", "idemctl.flask", "idemctl.django")
KIT = ("idemctl.exchange", "idemctl.gate", "idemctl.capture", "idemctl.wire")
LAYERS = {
    # The request kit (gate, body rules, capture, wire, the sequence) knows no framework.
    "idemctl.exchange": DOORS,
    # The ledger knows nothing of HTTP doors or of the kit around it.
    "idemctl.ledger": DOORS + KIT,
}


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def _layer_breaches() -> dict[str, list[str]]:
    return {
        name: sorted(d for d in deps if _under(d, forbidden))
        for layer, forbidden in LAYERS.items()
        for name, deps in GRAPH.items()
        if _under(name, (layer,)) and any(_under(d, forbidden) for d in deps)
    }


def test_each_layer_imports_only_what_is_below_it():
    assert _layer_breaches() == {}


def test_the_layer_check_finds_a_kit_module_importing_a_door():
    GRAPH["idemctl.exchange.__fake"] = {"idemctl.wsgi"}
    try:
        assert _layer_breaches() == {"idemctl.exchange.__fake": ["idemctl.wsgi"]}
    finally:
        del GRAPH["idemctl.exchange.__fake"]
