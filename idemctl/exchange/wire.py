"""How an Answer goes on the wire: the same bytes from every adapter.

The WSGI and ASGI middleware (and any other adapter) send an answer through
`wire_headers`, so a first answer, its replays and the same request through
another adapter carry the same status, headers and body."""

from __future__ import annotations

import functools
from http import HTTPStatus

from ..outcomes import Answer, Outcome

DEFAULT_MAX_BODY_BYTES = 1024 * 1024
DEFAULT_UNAVAILABLE_RETRY_AFTER_MS = 1000
REPLAYED_HEADER = "idempotent-replayed"  # lower-case, like every header idemctl emits
# Never a body: no Content-Length (RFC 9110 §8.6 forbids it on 204) and no Content-Type.
NO_LENGTH_STATUSES = frozenset({204, 304})
# RFC 9110 §15 status classes: the reason phrase of a code HTTPStatus does not know.
_CLASS_PHRASES = {1: "Informational", 2: "Success", 3: "Redirection", 4: "Client Error", 5: "Server Error"}


def wire_headers(answer: Answer, *, replayed_header: bool = False) -> list[tuple[str, str]]:
    """The headers to send with `answer`: its own, then Idempotent-Replayed
    (opt-in, replays only) and Content-Length.

    >>> wire_headers(Answer(201, (("content-type", "text/plain"),), b"ok", Outcome.REPLAYED), replayed_header=True)
    [('content-type', 'text/plain'), ('idempotent-replayed', 'true'), ('content-length', '2')]
    """
    status = answer.status
    out = []
    # A loop, not a comprehension: a comprehension is a call of its own, on every answer sent.
    if status in NO_LENGTH_STATUSES:
        # No content, so nothing for a Content-Type to describe (frameworks
        # add one by default; wsgiref.validate rejects it).
        for k, v in answer.headers:
            if str(k).lower() != "content-type":
                out.append((str(k), str(v)))
    else:
        for k, v in answer.headers:
            out.append((str(k), str(v)))
    if replayed_header and answer.outcome is Outcome.REPLAYED:
        out.append((REPLAYED_HEADER, "true"))
    if status >= 200 and status not in NO_LENGTH_STATUSES:
        out.append(("content-length", str(len(answer.body))))
    return out


@functools.lru_cache(maxsize=128)  # a few codes, each line built once: HTTPStatus(code) is a Python call
def status_line(status: int) -> str:
    """The WSGI status string for a stored status code. Replays only know the
    code, so the first answer uses the same standard phrase to stay identical.

    >>> status_line(201), status_line(299)
    ('201 Created', '299 Success')
    """
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = _CLASS_PHRASES.get(status // 100, "Unknown")
    return f"{status} {phrase}"
