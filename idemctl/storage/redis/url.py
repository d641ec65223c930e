"""A Redis ledger's URL: what redis-py reads (``redis://``, ``rediss://``),
Sentinel's form (``redis+sentinel://``), idemctl's own options taken out of
the query before redis-py sees it, and the URL as it may be printed (never
the password).

Sentinel: ``redis+sentinel://[user:password@]host:port[,host:port…]/service[/db]``;
the password is the primary's (and, unless ``sentinel_password`` is given,
the sentinels'). idemctl's options in the query of any form:

- ``prefix``: the first part of every key the ledger writes (default ``idemctl``);
- ``wait_replicas=N``: a completion is acknowledged only once N replicas hold
  it (``WAIT``), with ``wait_timeout_ms`` (default 1000) before the request
  is told the ledger is unavailable."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from urllib.parse import SplitResult, parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

from ...errors import StorageError
from ..server import number_option

SCHEMES = ("redis://", "rediss://", "redis+sentinel://", "rediss+sentinel://")
DEFAULT_PREFIX = "idemctl"
# A prefix is part of every key and of the names SCAN matches: plain characters only.
_PREFIX = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_OWN_OPTIONS = ("prefix", "wait_replicas", "wait_timeout_ms", "sentinel_password")


def is_redis_url(target: object) -> bool:
    """A ``redis://``, ``rediss://`` or ``redis+sentinel://`` URL.

    >>> is_redis_url("redis://127.0.0.1:6379/0"), is_redis_url("ledger.db")
    (True, False)
    """
    return isinstance(target, str) and target.startswith(SCHEMES)


@dataclass(frozen=True)
class RedisLocation:
    """A parsed Redis ledger URL."""

    url: str  # what redis-py reads (idemctl's options removed)
    shown: str  # safe to print
    secrets: tuple[str, ...]
    prefix: str = DEFAULT_PREFIX
    wait_replicas: int = 0
    wait_timeout_ms: int = 1000
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str | None = None
    db: int = 0
    password: str | None = field(default=None, repr=False)
    username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)
    tls: bool = False
    options: dict[str, str] = field(default_factory=dict)


def parse(target: str) -> RedisLocation:
    """Read a Redis ledger URL; a malformed one is a StorageError whose
    message holds no password.

    >>> loc = parse("redis://:s3cret@cache:6380/2?prefix=pay&wait_replicas=1")
    >>> loc.shown, loc.prefix, loc.wait_replicas, loc.url
    ('redis://:***@cache:6380/2?prefix=pay&wait_replicas=1', 'pay', 1, 'redis://:s3cret@cache:6380/2')
    >>> parse("redis+sentinel://:pw@s1:26379,s2:26379/pay/1").sentinels
    (('s1', 26379), ('s2', 26379))
    """
    parts = urlsplit(target)
    secrets = tuple(s for s in {parts.password or "", unquote(parts.password or "")} if s)
    shown = _mask(target, parts.password)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    options = dict(pairs)
    for secret in (options.get("password"), options.get("sentinel_password")):
        if secret:
            secrets += (secret,)
            shown = shown.replace(quote(secret, safe=""), "***").replace(secret, "***")
    own = {name: options.pop(name) for name in _OWN_OPTIONS if name in options}
    prefix = own.get("prefix", DEFAULT_PREFIX)
    if not _PREFIX.fullmatch(prefix):
        raise StorageError(f"{shown}: prefix must be 1 to 64 of A-Z a-z 0-9 _ . : -, got {prefix!r}")
    wait_replicas = number_option(own, "wait_replicas", 0, int, 0, shown)
    wait_timeout_ms = number_option(own, "wait_timeout_ms", 1000, int, 0, shown)
    # What both forms share: idemctl's own options and the URL as shown.
    common = RedisLocation(
        "", shown, secrets, prefix, wait_replicas, wait_timeout_ms, tls=parts.scheme.startswith("rediss")
    )
    if "+sentinel" in parts.scheme:
        return _sentinel(parts, common, own.get("sentinel_password"), options)
    rest = urlencode([(k, v) for k, v in pairs if k not in _OWN_OPTIONS])
    url = urlunsplit((parts.scheme, parts.netloc, parts.path, rest, ""))
    try:
        db = int(parts.path.strip("/") or 0)
    except ValueError:
        raise StorageError(f"{shown}: the database must be a number, got {parts.path.strip('/')!r}") from None
    return replace(common, url=url, db=db, password=parts.password)


def _sentinel(
    parts: SplitResult, common: RedisLocation, sentinel_password: str | None, options: dict[str, str]
) -> RedisLocation:
    shown = common.shown
    hosts = parts.netloc.rpartition("@")[2]
    sentinels: list[tuple[str, int]] = []
    for one in hosts.split(","):
        host, _, port = one.rpartition(":") if ":" in one else (one, "", "26379")
        try:
            sentinels.append((host.strip("[]"), int(port)))
        except ValueError:
            raise StorageError(f"{shown}: a sentinel must be host:port, got {one!r}") from None
    path = [p for p in parts.path.split("/") if p]
    if not path or not sentinels or not sentinels[0][0]:
        raise StorageError(
            f"{shown}: a Sentinel URL names its sentinels and the service: redis+sentinel://host:port/service"
        )
    try:
        db = int(path[1]) if len(path) > 1 else 0
    except ValueError:
        raise StorageError(f"{shown}: the database must be a number, got {path[1]!r}") from None
    password = unquote(parts.password) if parts.password else None
    return replace(
        common,
        sentinels=tuple(sentinels),
        service=path[0],
        db=db,
        password=password,
        username=unquote(parts.username) if parts.username else None,
        sentinel_password=password if sentinel_password is None else sentinel_password,
        options=options,
    )


def _mask(target: str, password: str | None) -> str:
    """The URL with its password as ``***``.

    >>> _mask("redis://u:p%40ss@h:1/0", "p%40ss")
    'redis://u:***@h:1/0'
    """
    if not password:
        return target
    head, sep, tail = target.partition("://")
    auth, at, rest = tail.rpartition("@")
    if not at:
        return target
    user = auth.partition(":")[0]
    return f"{head}{sep}{user}:***@{rest}"
