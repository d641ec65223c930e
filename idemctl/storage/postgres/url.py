"""A PostgreSQL ledger URL: idemctl's pool parameters taken out of it, the
session settings added to it, and the password kept out of what is shown."""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ...errors import StorageError
from ...text import single_line
from ..locations import dsn_url, keyword_dsn
from ..server import scrub

# URL query parameters that configure the pool, the connections and the
# commit timeout: they are idemctl's, not libpq's, so they are taken out of
# the URL before it reaches libpq. `prepare_threshold` goes to psycopg's
# connection.
POOL_PARAMS = (
    "pool_min_size",
    "pool_max_size",
    "pool_timeout",
    "commit_timeout",
    "pooler",
    "prepare_threshold",
    "async_driver",
)
DEFAULT_POOL_MIN_SIZE = 1
DEFAULT_POOL_MAX_SIZE = 10
DEFAULT_CONNECT_TIMEOUT_S = 5

# How the URL leads to PostgreSQL (the `pooler` URL parameter):
#  auto         detect it (the default): `direct` if the server takes and
#               honours startup options, else `transaction`;
#  none         a server that must take startup options (an error if it does not);
#  session      a pooler that gives a connection one server session for its
#               lifetime (PgBouncer's session pooling);
#  transaction  a pooler that may switch server sessions between
#               transactions (PgBouncer's transaction pooling);
#  statement    between statements (PgBouncer's statement pooling: no
#               transaction of more than one statement).
POOLER_MODES = ("auto", "none", "session", "transaction", "statement")
# Which driver serves the asynchronous request path (the `async_driver` URL
# parameter): asyncpg when it is installed (auto, the default), or psycopg.
ASYNC_DRIVERS = ("auto", "psycopg")
# A custom setting sent with the startup options: a server that ignored them
# (a pooler with ignore_startup_parameters=options) does not have it.
MARKER_SETTING = "idemctl.startup_options"
# The transaction-level twins of the default_transaction_* settings: a
# setting applied inside a transaction must change that transaction.
_IN_TRANSACTION = {
    "default_transaction_read_only": "transaction_read_only",
    "default_transaction_isolation": "transaction_isolation",
    "default_transaction_deferrable": "transaction_deferrable",
}


def _split_pool_params(url: str) -> tuple[str, dict[str, str]]:
    """Take idemctl's pool_* parameters out of the query string, leaving the
    rest of the URL byte for byte as given."""
    base, sep, query = url.partition("?")
    if not sep:
        return url, {}
    kept: list[str] = []
    pool: dict[str, str] = {}
    for part in query.split("&"):
        name, _, value = part.partition("=")
        if name in POOL_PARAMS:
            pool[name] = unquote(value)
        elif part:
            kept.append(part)
    return (base + "?" + "&".join(kept)) if kept else base, pool


def option_settings(options: str) -> list[tuple[str, str]] | None:
    """The ``-c name=value`` settings in libpq's `options` string, in order;
    None if it holds anything else (another server switch).

    >>> option_settings(r"-c lock_timeout=100 -csearch_path=a,b --work_mem=4MB -c x.y=a\\ b")
    [('lock_timeout', '100'), ('search_path', 'a,b'), ('work_mem', '4MB'), ('x.y', 'a b')]
    """
    # libpq splits on unescaped whitespace; a backslash escapes the next character.
    words: list[str] = []
    current: list[str] | None = None
    chars = iter(options)
    for ch in chars:
        if ch.isspace():
            if current is not None:
                words.append("".join(current))
                current = None
            continue
        if current is None:
            current = []
        current.append(next(chars, "") if ch == "\\" else ch)
    if current is not None:
        words.append("".join(current))
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word == "-c" and i + 1 < len(words):
            pair, i = words[i + 1], i + 2
        elif (word.startswith("-c") and word != "-c") or (word.startswith("--") and "=" in word):
            pair, i = word[2:], i + 1
        else:
            return None
        name, eq, value = pair.partition("=")
        if not eq or not name:
            return None
        out.append((name.replace("-", "_"), value))
    return out


def secrets_of(url: str) -> list[str]:
    """Every spelling of the password the URL carries, for scrubbing messages."""
    found: list[str] = []
    with contextlib.suppress(ValueError):
        if urlsplit(url).password:
            found.append(urlsplit(url).password or "")
    for match in re.finditer(r"[?&]password=([^&]*)", url):
        found.append(match.group(1))
    out: list[str] = []
    for s in found:
        out.extend(v for v in (s, unquote(s)) if v and v not in out)
    return out


def _check_database_named(params: dict[str, Any]) -> None:
    """Refuse a URL that names no database, as MariaDB's engine does: libpq
    would take the role's name (``postgres`` for the superuser: the
    maintenance database), and `init` would put the ledger's tables there.
    A service file or PGDATABASE may name it instead.

    >>> try:
    ...     _check_database_named({"host": "db", "port": "5432", "user": "app"})
    ... except StorageError as exc:
    ...     for part in str(exc).split("; "):
    ...         print(part)
    bad PostgreSQL URL: it names no database (libpq would use the role's name, app)
    name the ledger's own, e.g. postgresql://app@db:5432/idempotency
    """
    if params.get("dbname") or params.get("service") or os.environ.get("PGDATABASE") or os.environ.get("PGSERVICE"):
        return
    user = str(params.get("user") or "")
    host = str(params.get("host") or "localhost")
    port = f":{params['port']}" if params.get("port") else ""
    example = f"postgresql://{user + '@' if user else ''}{host}{port}/idempotency"
    role = user or "your login name"
    raise StorageError(
        f"bad PostgreSQL URL: it names no database (libpq would use the role's name, {role}); "
        f"name the ledger's own, e.g. {example}"
    )


def default_commit_timeout_s(busy_timeout_ms: int) -> float:
    """The commit timeout when the URL sets none: twice the busy timeout, at
    least 1 s. A statement may wait its whole lock timeout (the busy timeout)
    for a row lock and still has as long again to commit.

    >>> default_commit_timeout_s(5000), default_commit_timeout_s(0)
    (10.0, 1.0)
    """
    return max(2 * busy_timeout_ms / 1000, 1.0)


def _seconds(given: float | None, params: dict[str, str], name: str, default: float) -> float:
    raw: object = given if given is not None else params.get(name)
    try:
        value = float(str(raw)) if raw is not None else default
    except ValueError:
        raise StorageError(f"bad PostgreSQL URL: {name}={raw!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise StorageError(f"bad PostgreSQL URL: {name} must be a number of seconds > 0, got {raw}")
    return value


def _pool_int(given: int | None, params: dict[str, str], name: str, default: int, floor: int) -> int:
    raw: object = given if given is not None else params.get(name, default)
    try:
        value = int(str(raw))
    except ValueError:
        raise StorageError(f"bad PostgreSQL URL: {name}={raw!r} is not a whole number") from None
    if value < floor:
        raise StorageError(f"bad PostgreSQL URL: {name} must be >= {floor}, got {value}")
    return value


def _prepare_threshold(params: dict[str, str]) -> tuple[int | None, bool]:
    """psycopg's prepare_threshold from the URL: a whole number >= 0 (how
    many runs of a statement before it is prepared on the server) or
    ``none`` (never)."""
    raw = params.get("prepare_threshold")
    if raw is None:
        return 5, False
    if raw.strip().lower() in ("none", "off", "never"):
        return None, True
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise StorageError(f"bad PostgreSQL URL: prepare_threshold={raw!r} is neither a whole number >= 0 nor 'none'")
    return value, True


@dataclass(frozen=True)
class ServerSettings:
    """What a PostgreSQL URL (and the engine's arguments) say: `conninfo`
    is what libpq gets, with the password; `url_params` are libpq's
    parameters without it."""

    conninfo: str
    url_params: dict[str, str]
    secrets: list[str]
    pool_min_size: int
    pool_max_size: int
    pool_timeout_s: float
    commit_timeout_s: float
    # What follows serves a pooler (see POOLER_MODES): `pooled_conninfo`
    # carries no startup options; `settings` are what the options ask for,
    # as (name, value) in the order they apply (None: the URL's options
    # hold something other than -c name=value, which only a server takes).
    pooler: str = "auto"
    pooled_conninfo: str = ""
    settings: tuple[tuple[str, str], ...] | None = ()
    # psycopg's prepare_threshold (None: never prepare); unset: psycopg's default.
    prepare_threshold: int | None = 5
    prepare_threshold_set: bool = False
    async_driver: str = "auto"

    def transaction_settings(self) -> list[tuple[str, str]]:
        """`settings` as they apply inside one transaction: each
        default_transaction_* as its transaction_* twin, the last word for a
        name winning where the first one stood."""
        merged: dict[str, str] = {}
        for name, value in self.settings or ():
            merged[_IN_TRANSACTION.get(name.lower(), name)] = value
        return list(merged.items())

    @classmethod
    def parse(
        cls,
        url: str,
        *,
        readonly: bool,
        busy_timeout_ms: int,
        pool_min_size: int | None,
        pool_max_size: int | None,
        pool_timeout_s: float | None,
        commit_timeout_s: float | None = None,
    ) -> ServerSettings:
        pairs = keyword_dsn(url)
        if pairs is not None:  # a connection string: the same as a URL (locations.py)
            url = dsn_url(pairs)
        secrets = secrets_of(url)
        libpq_url, pool_params = _split_pool_params(url)
        try:
            params = conninfo_to_dict(libpq_url)
        except psycopg.Error as exc:
            raise StorageError(f"bad PostgreSQL URL: {scrub(single_line(str(exc)), secrets)}") from exc
        for port in str(params.get("port", "")).split(","):
            if port and not (port.isdigit() and 0 < int(port) < 65536):
                raise StorageError(f"bad PostgreSQL URL: port {port!r} is not a number from 1 to 65535")
        _check_database_named(params)
        min_size = _pool_int(pool_min_size, pool_params, "pool_min_size", DEFAULT_POOL_MIN_SIZE, 0)
        max_size = _pool_int(pool_max_size, pool_params, "pool_max_size", DEFAULT_POOL_MAX_SIZE, 1)
        if max_size < min_size:
            raise StorageError(f"bad PostgreSQL URL: pool_max_size ({max_size}) is below pool_min_size ({min_size})")
        if pool_timeout_s is None:
            raw = pool_params.get("pool_timeout")
            try:
                pool_timeout_s = float(raw) if raw is not None else max(busy_timeout_ms / 1000, 0.1)
            except ValueError:
                raise StorageError(f"bad PostgreSQL URL: pool_timeout={raw!r} is not a number of seconds") from None
        if pool_timeout_s <= 0:
            raise StorageError(f"bad PostgreSQL URL: pool_timeout must be > 0 seconds, got {pool_timeout_s}")
        commit_timeout = _seconds(
            commit_timeout_s, pool_params, "commit_timeout", default_commit_timeout_s(busy_timeout_ms)
        )
        pooler = pool_params.get("pooler", "auto").strip().lower()
        if pooler not in POOLER_MODES:
            raise StorageError(f"bad PostgreSQL URL: pooler={pooler!r} is not one of {', '.join(POOLER_MODES)}")
        threshold, threshold_set = _prepare_threshold(pool_params)
        driver = pool_params.get("async_driver", "auto").strip().lower()
        if driver not in ASYNC_DRIVERS:
            raise StorageError(f"bad PostgreSQL URL: async_driver={driver!r} is not one of {', '.join(ASYNC_DRIVERS)}")
        # Session settings ride in libpq's `options`, ahead of the URL's own,
        # so an explicit `-c lock_timeout=…` in the URL still wins.
        # lock_timeout=0 would mean "wait forever"; a zero busy timeout means
        # "do not wait", as on SQLite.
        ours = [("lock_timeout", str(max(1, busy_timeout_ms)))]
        if readonly:
            ours.append(("default_transaction_read_only", "on"))
        given = str(params["options"]) if params.get("options") else ""
        from_url = option_settings(given) if given else []
        settings = None if from_url is None else (*ours, *from_url)
        # The marker goes last: a server that honoured the options has it.
        words = [f"-c {name}={value}" for name, value in ours]
        options = " ".join([*words, given, f"-c {MARKER_SETTING}=on"] if given else [*words, f"-c {MARKER_SETTING}=on"])
        extra: dict[str, Any] = {"options": options}
        if "connect_timeout" not in params:
            extra["connect_timeout"] = DEFAULT_CONNECT_TIMEOUT_S
        hosts = str(params.get("host") or params.get("hostaddr") or "")
        if "," in hosts and not readonly and "target_session_attrs" not in params:
            # Several hosts are a primary and its standbys: only a host that
            # accepts writes can serve the ledger, whichever one that is now.
            extra["target_session_attrs"] = "read-write"
        pooled = {**{k: v for k, v in params.items() if k != "options"}, **extra}
        del pooled["options"]
        return cls(
            conninfo=make_conninfo(libpq_url, **extra),
            url_params={k: str(v) for k, v in params.items() if k != "password"},
            secrets=secrets,
            pool_min_size=min_size,
            pool_max_size=max_size,
            pool_timeout_s=float(pool_timeout_s),
            commit_timeout_s=commit_timeout,
            pooler=pooler,
            pooled_conninfo=make_conninfo("", **pooled),
            settings=settings,
            prepare_threshold=threshold,
            prepare_threshold_set=threshold_set,
            async_driver=driver,
        )

    @property
    def acquire_s(self) -> float:
        """How long a statement waits for a connection, a new one or a free
        pooled one: no longer than it may run, or a frozen server would hold
        a request past the commit timeout it is promised an answer in (by
        the pool timeout, or libpq's 5 s connect_timeout)."""
        return min(self.pool_timeout_s, self.commit_timeout_s)

    def describe(self) -> str:
        """The URL without its password (nor idemctl's or libpq's options)."""
        p = self.url_params
        user = f"{quote(p['user'], safe='')}@" if p.get("user") else ""
        hosts = (p.get("host") or p.get("hostaddr") or "").split(",")
        ports = p["port"].split(",") if p.get("port") else []
        # libpq: one port for every host, or one port per host.
        netloc = ",".join(
            quote(h, safe="") + (f":{ports[min(i, len(ports) - 1)]}" if ports else "") for i, h in enumerate(hosts)
        )
        return f"postgresql://{user}{netloc}/{quote(p.get('dbname', ''), safe='')}"
