"""One capture for every adapter: an app's answer, collected for the ledger
and bounded by the body cap.

An adapter feeds what its framework produces (WSGI chunks, ASGI messages,
a Django or Flask response's iterator) into a :class:`Capture`. While the
body fits under ``Policy.body_cap_bytes`` it is kept, to be stored and
replayed byte for byte. Once it outgrows the cap it can never be stored:
the capture keeps only its size, drains the rest without holding it, and
the ledger stores the oversize sentinel, which the client then gets like
every retry. Memory per request is therefore bounded by the cap, whatever
the app streams.

Trailer fields (an ASGI app's ``http.response.trailers``) are not part of
the answer: they are neither stored nor sent, to the first caller or on a
replay, so the first answer and every replay stay identical. An app that
sends them anyway (the adapters take the trailers extension out of the
scope, so it was told they cannot be sent) is answered and stored as if it
had not; a WARNING says so once per process.

>>> capture = Capture(cap=4)
>>> capture.start(201, [("content-type", "text/plain")])
>>> capture.add(b"ok")
>>> capture.body()
b'ok'
>>> capture.add(b"and more")
>>> capture.body()
OversizeBody(size=10)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ..responses import OversizeBody

log = logging.getLogger("idemctl.capture")
_warned_trailers: list[bool] = []  # one WARNING a process: an app that sends trailers sends them every time


class CaptureError(RuntimeError):
    """The app's answer is not a complete HTTP answer (no status, a body
    before its start, a second start)."""


class Capture:
    """An app's status, headers and body, the body bounded by `cap` bytes."""

    __slots__ = ("_chunks", "cap", "complete", "headers", "size", "status")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.status: int | None = None
        self.headers: list[tuple[str, str]] = []
        self.size = 0
        self.complete = False
        self._chunks: list[bytes] = []

    def start(self, status: int, headers: Iterable[tuple[str, str]]) -> None:
        if self.status is not None:
            raise CaptureError("the app started its answer twice")
        self.status = int(status)
        kept: list[tuple[str, str]] = []
        for k, v in headers:  # a loop, not a comprehension: one call less on every first request
            kept.append((str(k), str(v)))
        self.headers = kept

    def add(self, chunk: bytes) -> None:
        if self.status is None:
            raise CaptureError("the app sent a body before its status")
        if not chunk:
            return
        self.size += len(chunk)
        if self.size > self.cap:
            # It can never be stored: hold nothing more of it.
            self._chunks.clear()
            return
        self._chunks.append(bytes(chunk))

    def trailers(self) -> None:
        """Trailer fields after the body: left out of the answer (see above).

        >>> capture = Capture(cap=64); capture.start(200, []); capture.add(b"ok"); capture.trailers()
        >>> capture.answer()
        (200, [], b'ok')
        """
        if self.status is None:
            raise CaptureError("the app sent trailers before its status")
        if not _warned_trailers:
            _warned_trailers.append(True)
            log.warning(
                "an app sent HTTP trailer fields: they are not part of an idempotent answer and are sent to no client "
                "(the answer is stored and replayed without them)"
            )

    def drain(self, chunks: Iterable[bytes]) -> None:
        """Add every chunk of an iterable, closing it afterwards as a server would."""
        try:
            for chunk in chunks:
                self.add(chunk)
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
        self.complete = True

    @property
    def oversize(self) -> bool:
        return self.size > self.cap

    def body(self) -> bytes | OversizeBody:
        """The whole body, or only its size once it outgrew the cap."""
        if self.oversize:
            return OversizeBody(self.size)
        return b"".join(self._chunks)

    def answer(self) -> tuple[int, list[tuple[str, str]], bytes | OversizeBody]:
        status = self.status
        if status is None:
            raise CaptureError("the app returned without starting its answer")
        # `body()` inlined: one call less on every first request.
        size = self.size
        return status, self.headers, OversizeBody(size) if size > self.cap else b"".join(self._chunks)


__all__ = ["Capture", "CaptureError"]
