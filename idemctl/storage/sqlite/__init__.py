"""SQLite: one ledger file shared by threads and processes.

`engine.py` runs the statements; `connections.py` holds the per-thread
connections and their safety across fork; `writer_queue.py` the flock queue
that writers of every process take turns in; `group_commit.py` the commits
shared by threads; `errors.py` SQLite's errors as idemctl's; `files.py` how
the ledger file is made and with which permission bits; `options.py` the
settings only a SQLite file has; `schema.py` the schema transactions."""

from .engine import SqliteEngine
from .files import DEFAULT_FILE_MODE
from .options import SQLITE_DEFAULTS, SqliteOptions

__all__ = ["DEFAULT_FILE_MODE", "SQLITE_DEFAULTS", "SqliteEngine", "SqliteOptions"]
