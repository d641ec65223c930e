"""Text helpers shared by the library's messages and the CLI."""

from __future__ import annotations


def single_line(text: object) -> str:
    """Any message on one line: runs of whitespace (newlines included) become
    one space, so a multi-line driver error stays one log or stderr line.

    >>> single_line("connection failed:\\n\\tFATAL:  no such role")
    'connection failed: FATAL: no such role'
    """
    return " ".join(str(text).split())
