"""How the CLI writes: one-line messages on stderr, JSON documents on stdout,
and a rich console for everything else."""

from __future__ import annotations

import errno
import json
import os
import sys
from collections.abc import Iterable, Iterator
from typing import IO, Any, Generic, TextIO, TypeVar, cast

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..text import single_line
from .documents import JsonListing
from .escaping import terminal_safe_json, visible

T = TypeVar("T")


def one_line(message: object) -> str:
    """A message on one line, escaped: messages can quote stored values (a
    foreign row's principal).

    >>> one_line("no row for\\n  principal 'a\\x1b'")
    "no row for principal 'a\\\\x1b'"
    """
    return visible(single_line(message))


def say_error(message: object) -> None:
    # typer.echo, not rich: rich would wrap a long message onto several lines.
    label = "error:" if os.environ.get("NO_COLOR") else typer.style("error:", fg="red", bold=True)
    typer.echo(f"{label} {one_line(message)}", err=True)


def say_no(message: object) -> None:
    """The reason for a "no" answer (exit code 1), on stderr."""
    typer.echo(one_line(message), err=True)


# The width of piped output: wider than any line it holds, so that no line is
# wrapped to a terminal's width (a grep for a key finds the whole record).
PIPE_WIDTH = 1 << 20


class TrimmedLines:
    """A text stream that drops the blanks at the end of every line: rich pads
    table cells to their column's width, which piped output should not carry.

    >>> import io
    >>> out = io.StringIO(); trimmed = TrimmedLines(out)
    >>> _ = trimmed.write("key  k1   \\nstatus  "); _ = trimmed.write("201  \\n")
    >>> out.getvalue()
    'key  k1\\nstatus  201\\n'
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._held = ""  # blanks at the end of the last write: kept until the line goes on
        self.encoding = getattr(stream, "encoding", None) or "utf-8"  # rich picks its box characters by it

    def write(self, text: str) -> int:
        whole = self._held + text
        kept = whole.rstrip(" ")
        self._held = whole[len(kept) :]
        self._stream.write("\n".join(line.rstrip(" ") for line in kept.split("\n")))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return False


class CliConsole(Console):
    """rich's Console, except on a closed pipe: rich would exit 1, which
    means "no" here; the error goes on to the CLI's one rule instead. And
    NO_COLOR means no styles at all (rich would keep bold and dim)."""

    def __init__(self, **kwargs: Any) -> None:
        if os.environ.get("NO_COLOR"):
            kwargs["color_system"] = None
        super().__init__(**kwargs)

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


def console() -> Console:
    """The console for human output. On a terminal, rich as usual (tables fit
    its width). Anywhere else (a pipe, a file), lines as long as their content
    and without trailing blanks, so that grep, cut and diff see each record
    whole, on one line."""
    # Made per command so it writes to whatever sys.stdout is now (CliRunner swaps it).
    terminal = CliConsole(highlight=False)
    if terminal.is_terminal:
        return terminal
    return CliConsole(
        file=cast(IO[str], TrimmedLines(sys.stdout)),  # rich only writes, flushes and asks the encoding
        width=PIPE_WIDTH,
        force_terminal=False,
        color_system=None,
        highlight=False,
    )


def progress_bar(err: Console, label: str) -> Progress:
    """A bar on `err` (stderr) for a long run: `label` (a rich column
    template), the bar, done of total and the time taken. Gone when it ends,
    and shown only on a terminal, so that pipes and logs stay clean."""
    return Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    )


def emit_json(doc: object) -> None:
    """One JSON document on stdout, indented, with terminal controls escaped."""
    typer.echo(terminal_safe_json(json.dumps(doc, indent=2, ensure_ascii=False)))


def _scalar(value: object) -> str:
    return terminal_safe_json(json.dumps(value, ensure_ascii=False))


def emit_json_listing(listing: JsonListing) -> None:
    """Write `listing.document()` exactly as `emit_json` would, item by item,
    so that a long listing is never built in memory."""
    out = sys.stdout
    out.write("{\n")
    for k, v in listing.head.items():
        out.write(f"  {json.dumps(k)}: {_scalar(v)},\n")
    out.write(f"  {json.dumps(listing.name)}: [")
    first = True
    for item in listing.items:
        text = terminal_safe_json(json.dumps(item, indent=2, ensure_ascii=False)).replace("\n", "\n    ")
        out.write(("\n    " if first else ",\n    ") + text)
        first = False
    out.write("]" if first else "\n  ]")
    for k, v in listing.tail().items():
        out.write(f",\n  {json.dumps(k)}: {_scalar(v)}")
    out.write("\n}\n")
    out.flush()


def emit_json_lines(items: Iterable[object]) -> int:
    """Newline-delimited JSON: each item one compact object on its own line,
    written as it comes (a million rows are never held), terminal controls
    escaped. Returns how many were written."""
    out = sys.stdout
    written = 0
    for item in items:
        out.write(_scalar(item) + "\n")
        written += 1
    out.flush()
    return written


class Capped(Generic[T]):
    """At most `cap` items of a stream, noting whether more were there. Ask
    the stream for cap + 1 items, so that one extra reveals the truncation.

    >>> capped = Capped(iter("abc"), 2)
    >>> list(capped), capped.truncated
    (['a', 'b'], True)
    """

    def __init__(self, items: Iterable[T], cap: int | None) -> None:
        self._items = items
        self._cap = cap
        self.truncated = False

    def __iter__(self) -> Iterator[T]:
        for count, item in enumerate(self._items):
            if self._cap is not None and count >= self._cap:
                self.truncated = True
                return
            yield item


def chunks(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """Consecutive lists of `size` items (the last may be shorter).

    >>> list(chunks(range(5), 2))
    [[0, 1], [2, 3], [4]]
    """
    chunk: list[T] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
