"""The `idemctl` console script's first module, outside the idemctl package so
that it runs before the package (and Typer and rich) are imported: Ctrl-C in
that half second exits 130 like Ctrl-C anywhere else, without a traceback."""

from __future__ import annotations

import sys


def main() -> None:
    """Import the CLI, then run it; Ctrl-C during the import exits 130."""
    try:
        from idemctl.cli import main as run
    except KeyboardInterrupt:
        sys.exit(130)
    run()
