"""The engine boundary, held as tests: every engine-specific import and
branch lives under `idemctl/storage/`. Outside it no module imports a
database driver, imports an engine's own module, or tells engines apart by
comparing a URL scheme or an engine's name or by probing an engine for a
capability's method: it asks the registry (`idemctl.storage.registry`). docs/engines.md says how an engine is added."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import idemctl
from idemctl.storage import kinds
from idemctl.storage.capabilities import CAPABILITY_METHODS

PACKAGE = Path(idemctl.__file__).parent
STORAGE = PACKAGE / "storage"

# The drivers of the engines idemctl has, and of those being added.
DRIVERS = frozenset({"psycopg", "psycopg_pool", "pymysql", "sqlite3", "redis", "cloudflare"})
# Words that name an engine or its URL scheme: compared against a string, they
# tell engines apart. The registered kinds' names and schemes are added.
ENGINE_WORDS = frozenset(
    {"sqlite", "sqlite3", "postgres", "postgresql", "mysql", "mariadb", "redis", "rediss", "d1", "cloudflare"}
    | {kind.name for kind in kinds()}
    | {scheme for kind in kinds() for scheme in kind.locations.schemes}
)
# String methods that, given a scheme or "://", read a location's scheme.
SCHEME_READERS = frozenset(
    {"startswith", "endswith", "split", "rsplit", "partition", "rpartition", "find", "index", "removeprefix"}
)
# Engine-named things storage/ exports that any module may use: the settings
# of a SQLite file, the fallback kind, which `Ledger.open` takes and passes on.
SHARED_NAMES = frozenset({"SqliteOptions", "SQLITE_DEFAULTS"})
# Functions, wherever they live, whose scheme strings are about something
# else than a ledger's location, and what.
ALLOWED_FUNCTIONS = {
    "_origin_form": "an HTTP request's absolute-form target (`http://host/path`)",
}
# Modules outside storage/ that may do one of those things, and why.
ALLOWED = {
    # The old import paths of the failover facts, kept for code written against them.
    ("idemctl.operations.replication", "engine module idemctl.storage.failover.postgres"),
    ("idemctl.operations.replication_mysql", "engine module idemctl.storage.failover.mysql"),
}


def _engine_word(text: str) -> bool:
    """Whether a string constant names an engine or a scheme: "mysql",
    "postgresql://", "redis+cluster", or "://" itself."""
    if "://" in text:
        return True
    word = text.strip().lower()
    return word in ENGINE_WORDS or word.split("+", 1)[0] in ENGINE_WORDS


def _engine_name(name: str) -> bool:
    """A name storage/ exports that is one engine's (`is_postgres_url`,
    `PostgresEngine`, `MysqlFacts`), not the registry's."""
    lowered = name.lower()
    return name not in SHARED_NAMES and any(word in lowered for word in ENGINE_WORDS if len(word) > 2)


def _engine_module(name: str) -> bool:
    """A module under idemctl.storage named for one engine (its package,
    its admin or failover module): any part of its name after `storage`
    starting with a kind's name."""
    if not name.startswith("idemctl.storage."):
        return False
    parts = name.split(".")[2:]
    return any(part.startswith(kind.name) for part in parts for kind in kinds())


def _constants(node: ast.AST) -> list[str]:
    """The string constants an operand is made of (a tuple, list or set of them included)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for elt in node.elts for s in _constants(elt)]
    return []


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def boundary_crossings(module: str, source: str, *, is_package: bool = False) -> list[str]:
    """What in `source` (the text of `module`) belongs inside storage/: each
    as "driver X", "engine module X", "engine name X", "scheme string 'S'"
    or "capability probe M" (getattr or hasattr of an engine's capability
    method: the registry's capability queries say whether it has one)."""
    found: set[str] = set()
    tree = ast.parse(source)
    exempt = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in ALLOWED_FUNCTIONS
        for inner in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in exempt:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in DRIVERS:
                    found.add(f"driver {alias.name.split('.')[0]}")
                elif _engine_module(alias.name):
                    found.add(f"engine module {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            source_module = _absolute(module, node, is_package)
            if source_module.split(".")[0] in DRIVERS:
                found.add(f"driver {source_module.split('.')[0]}")
            for alias in node.names:
                target = f"{source_module}.{alias.name}"
                if _engine_module(source_module):
                    found.add(f"engine module {source_module}")
                elif _engine_module(target):
                    found.add(f"engine module {target}")
                elif source_module.startswith("idemctl.storage") and _engine_name(alias.name):
                    found.add(f"engine name {alias.name}")
        elif isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                found.update(f"scheme string {s!r}" for s in _constants(operand) if _engine_word(s))
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in SCHEME_READERS:
                for arg in node.args:
                    found.update(f"scheme string {s!r}" for s in _constants(arg) if _engine_word(s))
            if isinstance(func, ast.Name) and func.id in ("getattr", "hasattr") and len(node.args) > 1:
                probed = _constants(node.args[1])
                found.update(f"capability probe {m}" for m in probed if m in CAPABILITY_METHODS.values())
            is_import = isinstance(func, ast.Attribute) and func.attr == "import_module"
            if is_import or (isinstance(func, ast.Name) and func.id in ("import_module", "__import__")):
                for arg in node.args[:1]:
                    for s in _constants(arg):
                        if s.split(".")[0] in DRIVERS:
                            found.add(f"driver {s.split('.')[0]}")
    return sorted(found)


def _modules_outside_storage() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if STORAGE in path.parents:
            continue
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _crossings() -> dict[str, list[str]]:
    out = {}
    for name, path in sorted(_modules_outside_storage().items()):
        text = path.read_text(encoding="utf-8")
        found = [
            c for c in boundary_crossings(name, text, is_package=path.name == "__init__.py") if (name, c) not in ALLOWED
        ]
        if found:
            out[name] = found
    return out


def test_no_module_outside_storage_imports_a_driver_or_tells_engines_apart():
    assert _crossings() == {}


def test_every_allowed_exception_is_still_needed():
    # An exception nobody needs any more would let the same crossing back in unseen.
    modules = _modules_outside_storage()
    needed = {
        (name, crossing)
        for name, crossing in ALLOWED
        if crossing in boundary_crossings(name, modules[name].read_text(encoding="utf-8"))
    }
    assert needed == ALLOWED
    # Each exempt function still exists somewhere outside storage/.
    defined = {
        node.name
        for path in modules.values()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in ALLOWED_FUNCTIONS
    }
    assert defined == set(ALLOWED_FUNCTIONS)


@pytest.mark.parametrize(
    ("source", "crossing"),
    [
        ("import psycopg\n", "driver psycopg"),
        ("from psycopg_pool import ConnectionPool\n", "driver psycopg_pool"),
        ("def f():\n    import pymysql.cursors\n", "driver pymysql"),
        ("import sqlite3 as db\n", "driver sqlite3"),
        ("from redis.cluster import RedisCluster\n", "driver redis"),
        ("import cloudflare\n", "driver cloudflare"),
        ("import importlib\nimportlib.import_module('redis')\n", "driver redis"),
        ("from ..storage.postgres import PostgresEngine\n", "engine module idemctl.storage.postgres"),
        ("from ..storage import mysql\n", "engine module idemctl.storage.mysql"),
        ("import idemctl.storage.sqlite.engine\n", "engine module idemctl.storage.sqlite.engine"),
        ("from ..storage import is_postgres_url\n", "engine name is_postgres_url"),
        ("from idemctl.storage.registry import POSTGRES_KIND\n", "engine name POSTGRES_KIND"),
        ("ok = target.startswith('postgresql://')\n", "scheme string 'postgresql://'"),
        ("ok = target.startswith(('mysql://', 'x'))\n", "scheme string 'mysql://'"),
        ("ok = '://' in target\n", "scheme string '://'"),
        ("ok = store.dialect.name == 'mysql'\n", "scheme string 'mysql'"),
        ("ok = kind.name != 'postgres'\n", "scheme string 'postgres'"),
        ("ok = scheme.lower() in ('mysql', 'mariadb')\n", "scheme string 'mariadb'"),
        ("scheme = target.split('://', 1)[0]\n", "scheme string '://'"),
        ("opener = getattr(store.engine, 'open_async', None)\n", "capability probe open_async"),
        ("ok = hasattr(engine, 'failover_facts')\n", "capability probe failover_facts"),
        ("ok = url.partition(':')[0] == 'rediss+cluster'\n", "scheme string 'rediss+cluster'"),
    ],
)
def test_the_boundary_check_finds_each_kind_of_crossing(source: str, crossing: str):
    # The check above must be able to fail: each of these, in a module of
    # the CLI, is something only storage/ may do.
    assert crossing in boundary_crossings("idemctl.cli.fake", source)


def test_an_exempt_function_is_exempt_only_inside_itself():
    source = (
        "def _origin_form(target):\n"
        "    return target.split('://', 1)[1]\n"
        "def ledger_scheme(db):\n"
        "    return db.split('://', 1)[0]\n"
    )
    assert boundary_crossings("idemctl.cli.fake", source) == ["scheme string '://'"]
    assert boundary_crossings("idemctl.cli.fake", source.split("def ledger_scheme")[0]) == []


def test_the_boundary_check_lets_through_what_asks_the_registry():
    source = (
        "from .. import storage\n"
        "from ..storage import SqliteOptions, kind_of, is_file_location\n"
        "creates = kind_of(target).capabilities.creates_database\n"
        "message = f'use a file path, a postgresql:// URL or {x}'\n"
        "ok = is_file_location(target) and target.startswith('/srv')\n"
        "word = command == 'init'\n"
    )
    assert boundary_crossings("idemctl.cli.fake", source) == []


def test_the_boundary_check_finds_a_crossing_in_a_real_module():
    # The whole-package check, not only the function: a module of the CLI
    # that read a scheme would be reported under its own name.
    modules = _modules_outside_storage()
    text = modules["idemctl.cli.doctor"].read_text(encoding="utf-8")
    assert boundary_crossings("idemctl.cli.doctor", text + "\nx = db.startswith('mysql://')\n") == [
        "scheme string 'mysql://'"
    ]
