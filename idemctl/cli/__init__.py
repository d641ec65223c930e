"""`idemctl`: the operator's CLI. Each command opens the ledger, calls one
library method and renders what it returns; every error the library raises on
purpose becomes one line on stderr and a documented exit code.

`core` holds the app, the settings and the error mapping, `options` the
options the commands share; `documents` builds the --json document of every
command but `simulate` (whose timeline document `timeline` builds with the
timeline it shows), `words` and `views` the human output, and `escaping`
keeps what clients sent off the terminal's controls; `scenario`,
`simulation`, `race` and `timeline` are what `simulate` runs and shows. The other modules hold the commands, grouped by
what they do."""

from __future__ import annotations

from .core import EXIT_INTERRUPTED, EXIT_NO, EXIT_OK, EXIT_PIPE_CLOSED, EXIT_USAGE, app, main
from .views import PENDING_TABLE_CHUNK

# Importing a command module registers its commands on `app`, and
# `idemctl --help` lists commands in the order they were registered.
# isort: off
from . import schema as schema  # init
from . import inspect as inspect  # inspect, pending, fenced, stats
from . import sweep as sweep  # sweep, purge
from . import fingerprint as fingerprint  # fingerprint
from . import simulate as simulate  # simulate
from . import doctor as doctor  # doctor
from . import copy as copy  # copy
from . import monitoring as monitoring  # monitoring
# isort: on

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_NO",
    "EXIT_OK",
    "EXIT_PIPE_CLOSED",
    "EXIT_USAGE",
    "PENDING_TABLE_CHUNK",
    "app",
    "main",
]
