"""The package's shape, held as tests: no module over 600 lines, no import
cycle (imports under TYPE_CHECKING included), layers that import only
downwards, the library never imports the CLI, and a public API small
enough to read in one screen."""

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


# The package's layers, lowest first: a module may import its own layer and
# the ones below it, never one above. A module or package named here holds
# everything under it (the package root, "idemctl", only itself).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundation",
        (
            "idemctl.outcomes",
            "idemctl.errors",
            "idemctl.policy",
            "idemctl.text",
            "idemctl.durations",
            "idemctl.schema",
            "idemctl.fingerprint",
            "idemctl.call_values",
            "idemctl.leases",
            "idemctl.subscribers",
        ),
    ),
    ("storage", ("idemctl.storage",)),
    # The decision loop (and how it awaits a write), the answers it stores,
    # and idempotent calls: built on the store, never on the ledger.
    ("contract", ("idemctl.decision", "idemctl.landing", "idemctl.responses", "idemctl.functions")),
    # The operator's tools over a store: copying, failover checks.
    ("operations", ("idemctl.operations",)),
    ("ledger", ("idemctl.ledger",)),
    ("integrations", ("idemctl.config", "idemctl.prometheus", "idemctl.otel", "idemctl.monitoring")),
    # The request kit: the gate, the body rules, the capture, the wire, and
    # the one request sequence every HTTP door drives.
    ("request kit", ("idemctl.exchange",)),
    ("adapters", ("idemctl.wsgi", "idemctl.asgi", "idemctl.fastapi", "idemctl.flask", "idemctl.django")),
    # The package's own names, and the old import paths of moved modules.
    ("front", ("idemctl", "idemctl.copying", "idemctl.replication", "idemctl.gate", "idemctl.capture", "idemctl.wire")),
    ("cli", ("idemctl.cli", "idemctl.__main__")),
]


def _layer_of(name: str) -> int | None:
    """The layer holding `name`: the one naming it or its closest package."""
    best: tuple[int, int] | None = None  # (length of the name matched, layer)
    for number, (_, owned) in enumerate(LAYERS):
        for owner in owned:
            under = owner != "idemctl" and name.startswith(owner + ".")
            if (name == owner or under) and (best is None or len(owner) > best[0]):
                best = (len(owner), number)
    return None if best is None else best[1]


def _upward_imports() -> dict[str, list[str]]:
    found = {}
    for name, imported in GRAPH.items():
        mine = _layer_of(name)
        assert mine is not None, name
        up = sorted(other for other in imported if (_layer_of(other) or 0) > mine)
        if up:
            found[name] = up
    return found


def test_every_module_belongs_to_one_layer():
    assert sorted(name for name in MODULES if _layer_of(name) is None) == []
    assert _layer_of("idemctl.new_module") is None  # a new module is placed on purpose


def test_layers_import_only_their_own_and_the_ones_below():
    assert _upward_imports() == {}


# The doors: each one leans on the request kit below it, never on another
# door (what two doors share belongs in the kit). A door that is a package
# holds everything under it.
DOORS = ("idemctl.wsgi", "idemctl.asgi", "idemctl.fastapi", "idemctl.flask", "idemctl.django")


def _door_of(name: str) -> str | None:
    return next((door for door in DOORS if name == door or name.startswith(door + ".")), None)


def _imports_between_doors() -> dict[str, list[str]]:
    found = {}
    for name, imported in GRAPH.items():
        door = _door_of(name)
        if door is None:
            continue
        others = sorted(other for other in imported if _door_of(other) not in (None, door))
        if others:
            found[name] = others
    return found


def test_every_door_is_in_the_adapters_layer():
    adapters = dict(LAYERS)["adapters"]
    assert sorted(DOORS) == sorted(adapters)


def test_no_door_imports_another_door():
    assert _imports_between_doors() == {}


def test_the_door_check_finds_a_door_importing_another():
    # The check above must be able to fail: Flask's door reading the WSGI door's
    # helpers, and a module of Django's package reading the ASGI door's.
    GRAPH["idemctl.flask"].add("idemctl.wsgi")
    GRAPH["idemctl.django.exchange"].add("idemctl.asgi")
    try:
        assert _imports_between_doors() == {
            "idemctl.django.exchange": ["idemctl.asgi"],
            "idemctl.flask": ["idemctl.wsgi"],
        }
        assert _upward_imports() == {}  # one layer: the layer table alone cannot see it
    finally:
        GRAPH["idemctl.flask"].discard("idemctl.wsgi")
        GRAPH["idemctl.django.exchange"].discard("idemctl.asgi")


def test_the_layer_check_finds_an_import_upwards():
    # The check above must be able to fail: the ledger importing the request kit.
    GRAPH["idemctl.ledger.core"].add("idemctl.exchange.gate")
    try:
        assert _upward_imports() == {"idemctl.ledger.core": ["idemctl.exchange.gate"]}
    finally:
        GRAPH["idemctl.ledger.core"].discard("idemctl.exchange.gate")


def test_the_operators_tools_live_in_their_own_package_and_the_old_paths_still_import():
    import idemctl.copying
    import idemctl.operations.copying
    import idemctl.operations.replication
    import idemctl.replication

    assert idemctl.replication.check_failover is idemctl.operations.replication.check_failover
    assert idemctl.copying.CopyResult is idemctl.operations.copying.CopyResult
    assert {n for n in MODULES if n.startswith("idemctl.operations.")} == {
        "idemctl.operations.copying",
        "idemctl.operations.findings",
        "idemctl.operations.replication",
        "idemctl.operations.replication_mysql",
    }


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


def test_the_layer_check_finds_a_kit_module_importing_a_door():
    # The request kit knows no framework: a kit module importing a door is an import upwards.
    GRAPH["idemctl.exchange.__fake"] = {"idemctl.wsgi"}
    try:
        assert _upward_imports() == {"idemctl.exchange.__fake": ["idemctl.wsgi"]}
    finally:
        del GRAPH["idemctl.exchange.__fake"]
