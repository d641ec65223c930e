"""How an Answer goes on the wire: the same bytes from every adapter.

The WSGI and ASGI middleware (and any other adapter) send an answer through
`wire_headers`, so a first answer, its replays and the same request through
another adapter carry the same status, headers and body."""

from __future__ import annotations

import logging

from .errors import AnswerNotStoredError
from .outcomes import Answer, Outcome

DEFAULT_MAX_BODY_BYTES = 1024 * 1024
DEFAULT_UNAVAILABLE_RETRY_AFTER_MS = 1000
REPLAYED_HEADER = "idempotent-replayed"  # lower-case, like every header idemctl emits
# Never a body: no Content-Length (RFC 9110 §8.6 forbids it on 204) and no Content-Type.
NO_LENGTH_STATUSES = frozenset({204, 304})


def wire_headers(answer: Answer, *, replayed_header: bool = False) -> list[tuple[str, str]]:
    """The headers to send with `answer`: its own, then Idempotent-Replayed
    (opt-in, replays only) and Content-Length.

    >>> wire_headers(Answer(201, (("content-type", "text/plain"),), b"ok", Outcome.REPLAYED), replayed_header=True)
    [('content-type', 'text/plain'), ('idempotent-replayed', 'true'), ('content-length', '2')]
    """
    out = [(str(k), str(v)) for k, v in answer.headers]
    if answer.status in NO_LENGTH_STATUSES:
        # No content, so nothing for a Content-Type to describe (frameworks
        # add one by default; wsgiref.validate rejects it).
        out = [(k, v) for k, v in out if k.lower() != "content-type"]
    if answer.outcome is Outcome.REPLAYED and replayed_header:
        out.append((REPLAYED_HEADER, "true"))
    if answer.status >= 200 and answer.status not in NO_LENGTH_STATUSES:
        out.append(("content-length", str(len(answer.body))))
    return out


def check_options(principal: object, max_body_bytes: object, unavailable_retry_after_ms: object, *, takes: str) -> None:
    """The options every adapter shares, refused the same way by each.

    >>> check_options(lambda scope: None, 1024, 1000, takes="scope")
    >>> check_options(None, 1024, 1000, takes="environ")
    Traceback (most recent call last):
    ...
    TypeError: principal must be a callable environ -> str | None
    """
    if not callable(principal):
        raise TypeError(f"principal must be a callable {takes} -> str | None")
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 0:
        raise ValueError(f"max_body_bytes must be an integer >= 0, got {max_body_bytes!r}")
    retry_ms = unavailable_retry_after_ms
    if isinstance(retry_ms, bool) or not isinstance(retry_ms, int) or retry_ms < 1:
        raise ValueError(f"unavailable_retry_after_ms must be an integer >= 1, got {retry_ms!r}")


def log_not_stored(log: logging.Logger, exc: AnswerNotStoredError, principal: object, key: object) -> None:
    """The ERROR line for an answer the app computed but the ledger could not
    store: every adapter sends that answer instead of inviting a retry that
    would run the mutation again."""
    log.error(
        "principal=%s key=%s: the mutation ran but its answer (status %d) could not be stored: %s — "
        "the reservation stays pending and a retry after the TTL will run it again",
        principal,
        key,
        exc.answer.status,
        exc.cause,
    )
