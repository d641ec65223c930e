"""A WSGI environ read for the request sequence: the request target the
fingerprint covers, the fingerprint headers, and the parsed
:class:`~idemctl.exchange.sequence.Request`. The WSGI middleware, Flask's
decorator and Django (under WSGI) read the same environ the same way.

>>> parse({"REQUEST_METHOD": "post", "PATH_INFO": "/orders", "HTTP_IDEMPOTENCY_KEY": "k1"}, ()).method
'POST'
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from urllib.parse import quote
from wsgiref.types import WSGIEnvironment

from .sequence import Request

#: Where the app finds the principal the request ran under.
PRINCIPAL_ENVIRON_KEY = "idemctl.principal"

# RFC 3986 pchar minus the unreserved set (which quote() never escapes): a
# rebuilt path keeps the characters a client may send unescaped in a path.
_PATH_SAFE = "/:@!$&'()*+,;="


def request_target(environ: WSGIEnvironment) -> str:
    """The request target the fingerprint covers: path and query as received.

    `RAW_URI` (gunicorn) or `REQUEST_URI` (uWSGI, mod_wsgi) verbatim when the
    server provides one; otherwise rebuilt as PEP 3333 describes from
    `SCRIPT_NAME` + `PATH_INFO` (percent-encoded again, since servers decode
    them) and `QUERY_STRING` (never decoded), with no `?` when the query is
    empty. An absolute-form target (`http://host/path`) is reduced to its path.

    >>> request_target({"SCRIPT_NAME": "/api", "PATH_INFO": "/orders", "QUERY_STRING": "b=2&a=1"})
    '/api/orders?b=2&a=1'
    """
    raw = environ.get("RAW_URI") or environ.get("REQUEST_URI")
    if raw:
        return _origin_form(str(raw))
    # PEP 3333 strings carry the raw bytes as latin-1: recover them before quoting.
    path = (environ.get("SCRIPT_NAME", "") or "") + (environ.get("PATH_INFO", "") or "")
    target = _quoted_path(path)
    query = environ.get("QUERY_STRING", "") or ""
    return f"{target}?{query}" if query else target


@functools.lru_cache(maxsize=1024)  # an app has few paths: each quoted once, not on every request
def _quoted_path(path: str) -> str:
    return quote(path.encode("latin-1", "replace"), safe=_PATH_SAFE) or "/"


def _origin_form(target: str) -> str:
    if target.startswith("/") or "://" not in target:
        return target
    rest = target.split("://", 1)[1]
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    tail = rest[cut:]
    return tail if tail.startswith("/") else "/" + tail


def environ_headers(environ: WSGIEnvironment, names: Iterable[str]) -> list[tuple[str, str]]:
    """The named request headers (lower-case names) as the environ carries them.

    >>> environ = {"CONTENT_TYPE": "application/json", "HTTP_X_API_VERSION": "2"}
    >>> environ_headers(environ, ["content-type", "x-api-version"])
    [('content-type', 'application/json'), ('x-api-version', '2')]
    """
    return _picked(environ, environ_names(tuple(names)))


def _picked(environ: WSGIEnvironment, pairs: tuple[tuple[str, str], ...]) -> list[tuple[str, str]]:
    out = []
    for lname, var in pairs:
        value = environ.get(var)
        if value is not None:
            out.append((lname, str(value)))
    return out


@functools.lru_cache(maxsize=32)  # one policy's names, mapped once rather than each request
def environ_names(names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """Each header name (lower-cased) with the environ key that carries it.

    >>> environ_names(("Content-Type", "x-api-version"))
    (('content-type', 'CONTENT_TYPE'), ('x-api-version', 'HTTP_X_API_VERSION'))
    """
    out = []
    for name in names:
        lname = name.lower()
        if lname in ("content-type", "content-length"):
            var = lname.upper().replace("-", "_")
        else:
            var = "HTTP_" + lname.upper().replace("-", "_")
        out.append((lname, var))
    return tuple(out)


def parse(environ: WSGIEnvironment, fingerprint_headers: Iterable[str]) -> Request:
    """What the sequence needs of a WSGI request.

    >>> parse({"REQUEST_METHOD": "post", "PATH_INFO": "/orders", "HTTP_IDEMPOTENCY_KEY": "k1"}, ()).key_fields
    ('k1',)
    """
    return parse_environ(environ, environ_names(tuple(fingerprint_headers)))


def parse_environ(environ: WSGIEnvironment, pairs: tuple[tuple[str, str], ...]) -> Request:
    """`parse` with the fingerprint headers' environ names mapped already
    (:func:`environ_names`), as a door does once for its policy."""
    # A WSGI server joins repeated header fields into one value (k1,k2)
    # before the app sees them: only one field can be seen here.
    key = environ.get("HTTP_IDEMPOTENCY_KEY")
    headers = []
    for lname, var in pairs:  # _picked, inlined: one call less a request
        value = environ.get(var)
        if value is not None:
            headers.append((lname, str(value)))
    return Request(
        str(environ.get("REQUEST_METHOD", "GET")).upper(),
        request_target(environ),
        () if key is None else (key,),
        headers,
        environ.get("CONTENT_LENGTH"),
        # A body is coming that the server cannot delimit for us.
        bool(environ.get("HTTP_TRANSFER_ENCODING")) and not environ.get("wsgi.input_terminated"),
    )


__all__ = [
    "PRINCIPAL_ENVIRON_KEY",
    "environ_headers",
    "environ_names",
    "parse",
    "parse_environ",
    "request_target",
]
