"""How the CLI writes: one-line messages on stderr, JSON documents on stdout,
and a rich console for everything else."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

import typer
from rich.console import Console

from ..render import JsonListing, terminal_safe_json, visible
from ..text import single_line

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
    typer.echo(f"{typer.style('error:', fg='red', bold=True)} {one_line(message)}", err=True)


def say_no(message: object) -> None:
    """The reason for a "no" answer (exit code 1), on stderr."""
    typer.echo(one_line(message), err=True)


def console() -> Console:
    # Made per command so it writes to whatever sys.stdout is now (CliRunner swaps it).
    return Console(highlight=False)


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
