"""An ASGI request read for the request sequence, and the app's answer
captured from its messages: the request target the fingerprint covers, the
header fields, the parsed :class:`~idemctl.exchange.sequence.Request`, the
scope an app runs under when its answer is captured, and the capture of its
messages. The ASGI middleware, FastAPI's route class and Django (under
ASGI) read a scope the same way.

>>> parse({"method": "post", "path": "/orders", "headers": [(b"idempotency-key", b"k1")]}, ()).method
'POST'
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any
from urllib.parse import quote

from .capture import Capture, CaptureError
from .sequence import Request

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# RFC 3986 pchar minus the unreserved set, as a WSGI environ's path is rebuilt.
_PATH_SAFE = "/:@!$&'()*+,;="
# Extensions that would let the app send a response we cannot capture, and
# trailers, which no stored answer carries: an app told they are unsupported
# sends none (one that sends them anyway is answered without them).
_UNCAPTURABLE_EXTENSIONS = ("http.response.pathsend", "http.response.zerocopysend", "http.response.trailers")


def request_target(scope: Scope) -> str:
    """The request target the fingerprint covers: path and query as received,
    the same string the WSGI middleware sees for the same request.

    >>> request_target({"path": "/orders", "raw_path": b"/orders", "query_string": b"b=2&a=1"})
    '/orders?b=2&a=1'
    >>> request_target({"path": "/caf\\u00e9", "query_string": b""})
    '/caf%C3%A9'
    """
    raw = scope.get("raw_path")
    if raw:
        path = bytes(raw).decode("latin-1")
    else:
        path = quote((scope.get("root_path", "") or "") + scope.get("path", ""), safe=_PATH_SAFE) or "/"
    query = bytes(scope.get("query_string", b"") or b"").decode("latin-1")
    return f"{path}?{query}" if query else path


def scope_headers(scope: Scope, names: Iterable[str]) -> list[tuple[str, str]]:
    """The named request headers (lower-case names), every occurrence, as sent.

    >>> scope_headers({"headers": [(b"content-type", b"application/json"), (b"x-other", b"1")]}, ["content-type"])
    [('content-type', 'application/json')]
    """
    wanted = {n.lower() for n in names}
    out = []
    for name, value in scope.get("headers", ()):
        lname = bytes(name).decode("latin-1").lower()
        if lname in wanted:
            out.append((lname, bytes(value).decode("latin-1")))
    return out


def header_fields(scope: Scope, name: bytes) -> list[str]:
    """Every field of one request header, in the order sent.

    >>> header_fields({"headers": [(b"idempotency-key", b"k1"), (b"Idempotency-Key", b"k2")]}, b"idempotency-key")
    ['k1', 'k2']
    """
    return [bytes(v).decode("latin-1") for k, v in scope.get("headers", ()) if bytes(k).lower() == name]


@functools.lru_cache(maxsize=32)
def _wanted(names: tuple[str, ...]) -> frozenset[bytes]:
    # A policy's fingerprint headers, as the bytes a scope carries them in.
    return frozenset(n.lower().encode("latin-1") for n in names)


def parse(scope: Scope, fingerprint_headers: Iterable[str], *, exact_length: bool = False) -> Request:
    """What the sequence needs of an ASGI request (the server delimits every
    body; `exact_length` refuses one shorter than its Content-Length too).

    >>> parse({"method": "post", "path": "/orders", "headers": [(b"idempotency-key", b"k1")]}, ()).key_fields
    ['k1']
    """
    # One pass over the headers (the key fields, Content-Length, the
    # fingerprint's), compared as bytes: only the fields kept are decoded.
    wanted = _wanted(tuple(fingerprint_headers))  # a Policy's tuple: the same object, no copy
    keys: list[str] = []
    length: str | None = None
    fingerprinted: list[tuple[str, str]] = []
    for name, value in scope.get("headers", ()):
        lname = (name if name.__class__ is bytes else bytes(name)).lower()
        if lname == b"idempotency-key":
            keys.append(bytes(value).decode("latin-1"))
        elif lname == b"content-length" and length is None:
            length = bytes(value).decode("latin-1")
        if lname in wanted:
            fingerprinted.append((lname.decode("latin-1"), bytes(value).decode("latin-1")))
    return Request(
        str(scope.get("method", "GET")).upper(), request_target(scope), keys, fingerprinted, length, False, exact_length
    )


class MessageCapture:
    """The app's ASGI messages, fed into the gate's bounded capture."""

    def __init__(self, capture: Capture) -> None:
        self.capture = capture

    async def send(self, message: Message) -> None:
        kind = message.get("type")
        capture = self.capture
        if kind == "http.response.start":
            headers = [(bytes(k).decode("latin-1"), bytes(v).decode("latin-1")) for k, v in message.get("headers", ())]
            capture.start(int(message["status"]), headers)
        elif kind == "http.response.body":
            if capture.complete:
                raise CaptureError("the app sent a body after its last one")
            capture.add(bytes(message.get("body", b"") or b""))
            capture.complete = not message.get("more_body", False)
        elif kind == "http.response.trailers":
            capture.trailers()
        else:
            raise CaptureError(f"the app sent {kind!r}, which an idempotent response cannot carry")

    def check_complete(self) -> None:
        if self.capture.status is None or not self.capture.complete:
            raise CaptureError("the app returned before it finished its response")


def capturable_scope(scope: Scope) -> Scope:
    """A copy of `scope` without the extensions that would let the app send
    a response the capture cannot see (a file by path, zero-copy, trailers).

    >>> capturable_scope({"type": "http", "extensions": {"http.response.pathsend": {}}})["extensions"]
    {}
    """
    inner = dict(scope)
    extensions = dict(inner.get("extensions") or {})
    for name in _UNCAPTURABLE_EXTENSIONS:
        extensions.pop(name, None)
    inner["extensions"] = extensions
    return inner


__all__ = [
    "Message",
    "MessageCapture",
    "Receive",
    "Scope",
    "Send",
    "capturable_scope",
    "header_fields",
    "parse",
    "request_target",
    "scope_headers",
]
