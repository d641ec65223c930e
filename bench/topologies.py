"""Deployment topologies measured against the server itself in the same
run: `python -m bench.topologies NAME` (see docs/topologies.md)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    names = {"pgbouncer": "bench.topology_pgbouncer"}
    if not args or args[0] not in names:
        raise SystemExit(f"usage: python -m bench.topologies {{{','.join(sorted(names))}}} [options]")
    import importlib

    importlib.import_module(names[args[0]]).main(args[1:])


if __name__ == "__main__":
    main()
