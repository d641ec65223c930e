"""Where a D1 ledger lives: ``d1://ACCOUNT_ID/DATABASE_ID``, the API's base
URL and the token, read from the environment as Cloudflare's own SDK reads
them (``CLOUDFLARE_BASE_URL``, ``CLOUDFLARE_API_TOKEN``)."""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ...errors import StorageError

SCHEME = "d1://"
DEFAULT_BASE_URL = "https://api.cloudflare.com/client/v4"
TOKEN_VARIABLE = "CLOUDFLARE_API_TOKEN"
BASE_URL_VARIABLE = "CLOUDFLARE_BASE_URL"

# Account ids are 32 hex digits, database ids UUIDs; anything of letters,
# digits, dashes and underscores is accepted so a test's or a proxy's ids work.
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def is_d1_url(target: object) -> bool:
    """Whether `target` names a D1 database.

    >>> is_d1_url("d1://0123abcd/9f8e-77"), is_d1_url("ledger.db")
    (True, False)
    """
    return isinstance(target, str) and target.startswith(SCHEME)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def checked_base_url(base: str) -> str:
    """The API's base URL: https, or plain http to a loopback address only
    (a local stand-in); the token never crosses a network in clear text.

    >>> checked_base_url("http://127.0.0.1:8787/client/v4/")
    'http://127.0.0.1:8787/client/v4'
    """
    parts = urlsplit(base)
    if parts.scheme == "https" and parts.hostname:
        return base.rstrip("/")
    if parts.scheme == "http" and parts.hostname and _loopback(parts.hostname):
        return base.rstrip("/")
    raise StorageError(
        f"{BASE_URL_VARIABLE} must be an https:// URL (plain http:// only to a loopback address), got {base!r}"
    )


@dataclass(frozen=True)
class D1Location:
    """One D1 database behind the HTTP API. The token is kept out of repr.

    >>> loc = D1Location.parse("d1://acct/db", {"CLOUDFLARE_API_TOKEN": "s3cret"})
    >>> loc.describe(), "s3cret" in repr(loc)
    ('d1://acct/db', False)
    """

    account_id: str
    database_id: str
    base_url: str
    token: str = field(repr=False)

    @classmethod
    def parse(cls, url: str, environ: Mapping[str, str] | None = None) -> D1Location:
        env = os.environ if environ is None else environ
        rest = url[len(SCHEME) :] if url.startswith(SCHEME) else ""
        parts = rest.split("/")
        if len(parts) != 2 or not all(_ID.fullmatch(p) for p in parts):
            raise StorageError(f"a D1 ledger is d1://ACCOUNT_ID/DATABASE_ID, got {url!r}")
        token = env.get(TOKEN_VARIABLE, "")
        if not token.strip():
            raise StorageError(f"a D1 ledger needs an API token with D1 edit rights in {TOKEN_VARIABLE}")
        base = checked_base_url(env.get(BASE_URL_VARIABLE) or DEFAULT_BASE_URL)
        return cls(parts[0], parts[1], base, token.strip())

    def describe(self) -> str:
        return f"{SCHEME}{self.account_id}/{self.database_id}"

    def endpoint(self, form: str) -> str:
        """The URL of the database's `query` or `raw` endpoint."""
        return f"{self.base_url}/accounts/{self.account_id}/d1/database/{self.database_id}/{form}"
