"""A PostgreSQL ledger URL: idemctl's pool parameters taken out of it, the
session settings added to it, and the password kept out of what is shown."""

from __future__ import annotations

import contextlib
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

# URL query parameters that configure the pool. They are idemctl's, not
# libpq's, so they are taken out of the URL before it reaches libpq.
POOL_PARAMS = ("pool_min_size", "pool_max_size", "pool_timeout")
DEFAULT_POOL_MIN_SIZE = 1
DEFAULT_POOL_MAX_SIZE = 10
DEFAULT_CONNECT_TIMEOUT_S = 5


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


def _pool_int(given: int | None, params: dict[str, str], name: str, default: int, floor: int) -> int:
    raw: object = given if given is not None else params.get(name, default)
    try:
        value = int(str(raw))
    except ValueError:
        raise StorageError(f"bad PostgreSQL URL: {name}={raw!r} is not a whole number") from None
    if value < floor:
        raise StorageError(f"bad PostgreSQL URL: {name} must be >= {floor}, got {value}")
    return value


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
        # Session settings ride in libpq's `options`, ahead of the URL's own,
        # so an explicit `-c lock_timeout=…` in the URL still wins.
        # lock_timeout=0 would mean "wait forever"; a zero busy timeout means
        # "do not wait", as on SQLite.
        ours = [f"-c lock_timeout={max(1, busy_timeout_ms)}"]
        if readonly:
            ours.append("-c default_transaction_read_only=on")
        options = " ".join([*ours, str(params["options"])] if params.get("options") else ours)
        extra: dict[str, Any] = {"options": options}
        if "connect_timeout" not in params:
            extra["connect_timeout"] = DEFAULT_CONNECT_TIMEOUT_S
        hosts = str(params.get("host") or params.get("hostaddr") or "")
        if "," in hosts and not readonly and "target_session_attrs" not in params:
            # Several hosts are a primary and its standbys: only a host that
            # accepts writes can serve the ledger, whichever one that is now.
            extra["target_session_attrs"] = "read-write"
        return cls(
            conninfo=make_conninfo(libpq_url, **extra),
            url_params={k: str(v) for k, v in params.items() if k != "password"},
            secrets=secrets,
            pool_min_size=min_size,
            pool_max_size=max_size,
            pool_timeout_s=float(pool_timeout_s),
        )

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
