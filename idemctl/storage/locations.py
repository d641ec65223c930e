"""Where a ledger is: what a location string means before any engine is
chosen. A libpq keyword/value connection string (``host=… dbname=…``) is a
PostgreSQL ledger, read as libpq reads it, and is handed on as the
postgresql:// URL that says the same, so every engine, message and hint
deals with URLs only (and never shows the password)."""

from __future__ import annotations

import re
from urllib.parse import quote

# libpq's connection keywords (its manual, "Parameter Key Words") and
# idemctl's pool parameters: a string made only of `keyword=value` pairs
# with these keywords is a PostgreSQL connection string, never a file name.
LIBPQ_KEYWORDS = frozenset(
    {
        "host", "hostaddr", "port", "dbname", "user", "password", "passfile", "require_auth",
        "channel_binding", "connect_timeout", "client_encoding", "options", "application_name",
        "fallback_application_name", "keepalives", "keepalives_idle", "keepalives_interval",
        "keepalives_count", "tcp_user_timeout", "replication", "gssencmode", "sslmode", "requiressl",
        "sslcompression", "sslcert", "sslkey", "sslpassword", "sslcertmode", "sslrootcert", "sslcrl",
        "sslcrldir", "sslsni", "requirepeer", "ssl_min_protocol_version", "ssl_max_protocol_version",
        "krbsrvname", "gsslib", "gssdelegation", "service", "target_session_attrs", "load_balance_hosts",
        "pool_min_size", "pool_max_size", "pool_timeout",
    }
)  # fmt: skip
# One pair: a keyword, `=` (spaces around it allowed), and a value that is
# single-quoted (\' and \\ escaped) or runs to the next space.
_DSN_PAIR = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*('(?:[^'\\]|\\.)*'|(?:[^\s'\\]|\\.)+)")
_DSN_ESCAPE = re.compile(r"\\(.)")


def keyword_dsn(target: object) -> list[tuple[str, str]] | None:
    r"""The pairs of a libpq keyword/value connection string, or None when
    `target` is not one (a file path, a URL). Every keyword must be one of
    libpq's: ``data=1.db`` stays a file name.

    >>> keyword_dsn("host=db user=app password='a b\\'c' dbname=payments")
    [('host', 'db'), ('user', 'app'), ('password', "a b'c"), ('dbname', 'payments')]
    >>> keyword_dsn("ledger=1.db"), keyword_dsn("idempotency.db"), keyword_dsn("postgresql://db/x")
    (None, None, None)
    """
    if not isinstance(target, str) or "://" in target or "=" not in target:
        return None
    pairs: list[tuple[str, str]] = []
    pos, end = 0, len(target.rstrip())
    while pos < end:
        match = _DSN_PAIR.match(target, pos)
        if match is None or match.group(1) not in LIBPQ_KEYWORDS:
            return None
        pos = match.end()
        if pos < end and not target[pos].isspace():
            return None
        raw = match.group(2)
        value = raw[1:-1] if raw.startswith("'") else raw
        pairs.append((match.group(1), _DSN_ESCAPE.sub(r"\1", value)))
    return pairs or None


def dsn_url(pairs: list[tuple[str, str]]) -> str:
    """A keyword/value connection string as the postgresql:// URL libpq reads
    the same way (every pair a query parameter).

    >>> dsn_url([("host", "db"), ("dbname", "pay ments")])
    'postgresql://?host=db&dbname=pay%20ments'
    """
    return "postgresql://?" + "&".join(f"{name}={quote(value, safe='')}" for name, value in pairs)
