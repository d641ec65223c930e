"""The DDL files in schema/, shipped inside the wheel as idemctl/schema."""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path

# The schema version this idemctl writes. The recipe's table alone is version 0.
SCHEMA_VERSION = 3

_VERSION_IN_NAME = re.compile(r"_v(\d+)\.sql\Z")


@dataclass(frozen=True)
class SchemaFile:
    name: str
    version: int  # 0 for the recipe's own table
    sql: str


def schema_root() -> Traversable:
    """Installed wheels carry idemctl/schema; a source checkout has ../schema."""
    packaged = resources.files("idemctl").joinpath("schema")
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "schema"


def schema_files(dialect: str) -> list[SchemaFile]:
    """The DDL files of one engine's dialect, in apply order: the folder
    under ``schema/`` named for it (its ``Dialect.name``), one folder per
    storage engine.

    >>> [(f.name, f.version) for f in schema_files("sqlite")][-1]
    ('0004_idemctl_v3.sql', 3)
    """
    folder = schema_root().joinpath(dialect)
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".sql")), key=lambda f: f.name)
    out = []
    for f in files:
        match = _VERSION_IN_NAME.search(f.name)
        out.append(SchemaFile(f.name, int(match.group(1)) if match else 0, f.read_text(encoding="utf-8")))
    return out
