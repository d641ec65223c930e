"""Pin every dependency of pyproject.toml to its stated lower bound.

    python .ci/lowest_constraints.py                 # constraints: NAME==LOWER, one a line
    python .ci/lowest_constraints.py --extras        # the extras, comma-separated: postgres,test
    python .ci/lowest_constraints.py --verify FILE   # exit 1 unless this environment has exactly FILE's versions

CI installs the project with these constraints into a second virtual
environment and runs the core suite there, so a lower bound that no longer
works fails the build instead of a user's install. Only the direct
dependencies (runtime and every extra) are pinned; theirs float, as they do
for a user who has an old release of ours next to new releases of theirs.
A dependency without a `>=` bound is an error: its lowest version is untested.
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
_REQUIREMENT = re.compile(
    r"^\s*(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(?P<spec>[^;]*)(?:;(?P<marker>.*))?$"
)


def canonical(name: str) -> str:
    """PEP 503 name normalisation: psycopg_pool and psycopg-pool are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _is_self(requirement: str, project: str) -> bool:
    m = _REQUIREMENT.match(requirement)
    return bool(m) and canonical(m["name"]) == canonical(project) and not m["spec"].strip()


def lower_bounds(pyproject: dict) -> dict[str, tuple[str, str | None]]:
    """{canonical name: (lowest version, environment marker or None)}."""
    project = pyproject["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        # An extra that pulls in another of ours ("idemctl[bench]") adds no
        # package: that extra's own requirements are pinned where they stand.
        requirements += [r for r in extra if not _is_self(r, project["name"])]
    found: dict[str, tuple[str, str | None]] = {}
    problems: list[str] = []
    for requirement in requirements:
        m = _REQUIREMENT.match(requirement)
        if not m:
            problems.append(f"cannot read requirement {requirement!r}")
            continue
        name = canonical(m["name"])
        lows = [s.strip()[2:].strip() for s in m["spec"].split(",") if s.strip().startswith(">=")]
        if len(lows) != 1:
            problems.append(f"{requirement!r} needs exactly one '>=' lower bound")
            continue
        marker = m["marker"].strip() if m["marker"] else None
        if name in found and found[name] != (lows[0], marker):
            problems.append(f"{name} has two different lower bounds: {found[name][0]} and {lows[0]}")
            continue
        found[name] = (lows[0], marker)
    if problems:
        raise SystemExit("pyproject.toml: " + "; ".join(problems))
    return found


def constraints(bounds: dict[str, tuple[str, str | None]]) -> str:
    lines = [f"{name}=={low}" + (f"; {marker}" if marker else "") for name, (low, marker) in sorted(bounds.items())]
    return "\n".join(lines) + "\n"


def _release(version: str) -> tuple[int, ...]:
    """'3.1' and '3.1.0' are the same release."""
    parts = [int(p) for p in re.match(r"\d+(?:\.\d+)*", version).group(0).split(".")]  # type: ignore[union-attr]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def verify(path: Path) -> list[str]:
    """What differs between the constraints file and this environment."""
    wrong = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        spec = line.split(";", 1)[0].strip()
        name, wanted = spec.split("==")
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            wrong.append(f"{name}: not installed (wanted {wanted})")
            continue
        if _release(installed) != _release(wanted):
            wrong.append(f"{name}: {installed} installed, wanted {wanted}")
    return wrong


def main(argv: list[str]) -> int:
    with open(PYPROJECT, "rb") as f:
        pyproject = tomllib.load(f)
    if argv[:1] == ["--extras"]:
        print(",".join(sorted(pyproject["project"].get("optional-dependencies", {}))))
        return 0
    if argv[:1] == ["--verify"] and len(argv) == 2:
        wrong = verify(Path(argv[1]))
        for line in wrong:
            print(f"lowest versions: {line}", file=sys.stderr)
        return 1 if wrong else 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    sys.stdout.write(constraints(lower_bounds(pyproject)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
