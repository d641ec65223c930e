"""PostgreSQL: a ledger in a database shared by any number of threads,
processes and hosts.

`engine.py` runs the statements on a per-process connection pool; `aio.py`
the same statements on one event loop's asynchronous pool; `watch.py` bounds
each of them, commit included (the commit timeout); `url.py` reads the
URL (idemctl's pool parameters, the session settings, the password kept out
of what is shown); `errors.py` turns what psycopg raises into idemctl's
errors; `schema.py` holds the schema transactions; `pooler.py` what changes
behind a connection pooler (PgBouncer)."""

from ..capabilities import DatabaseNotCreatedError
from .aio import AsyncPostgresEngine
from .engine import PostgresEngine
from .errors import PoolerError

__all__ = ["AsyncPostgresEngine", "DatabaseNotCreatedError", "PoolerError", "PostgresEngine"]
