"""The body rules every door applies alike: Content-Length syntax, 413 over
the limit, 411 for a body of unknown length, 400 for one cut short.

>>> declared_length("2", 10)
2
"""

from __future__ import annotations

from .. import responses


class BodyRefused(Exception):
    """The request body cannot be read safely; carries the answer (400, 411, 413)."""

    def __init__(self, refusal: tuple[int, responses.Headers, bytes]) -> None:
        super().__init__(refusal[0])
        self.refusal = refusal


class ClientGone(Exception):
    """The client disconnected before its request body was complete: nothing
    was claimed, and nothing is sent."""


def declared_length(value: str | None, limit: int) -> int | None:
    """A request's Content-Length as a number, or None without one; 400 when
    it is not a decimal integer, 413 when it announces more than `limit`.

    >>> declared_length(" 12 ", 100), declared_length(None, 100)
    (12, None)
    >>> declared_length("12", 10)
    Traceback (most recent call last):
    ...
    idemctl.exchange.body.BodyRefused: 413
    """
    if value is None:
        return None
    text = str(value).strip(" \t")
    if not text:
        return None
    # [0-9]+ without a regular expression: isdigit alone takes other scripts' digits.
    if not (text.isascii() and text.isdigit()):
        raise BodyRefused(responses.content_length_invalid())
    length = int(text)
    if length > limit:
        raise BodyRefused(responses.body_too_large(limit))
    return length


def check_read(total: int, limit: int) -> None:
    """Refuse (413) once more than `limit` bytes of body have arrived."""
    if total > limit:
        raise BodyRefused(responses.body_too_large(limit))


def check_complete(received: int, declared: int | None) -> None:
    """Refuse (400) a body that ended before its Content-Length."""
    if declared is not None and received != declared:
        raise BodyRefused(responses.body_incomplete())


def length_required() -> BodyRefused:
    """A body is coming but nothing says where it ends (411)."""
    return BodyRefused(responses.length_required())


def incomplete() -> BodyRefused:
    """The client left, or the stream ended, mid-body (400)."""
    return BodyRefused(responses.body_incomplete())


__all__ = [
    "BodyRefused",
    "ClientGone",
    "check_complete",
    "check_read",
    "declared_length",
    "incomplete",
    "length_required",
]
