"""The CLI's human output: rich grids and tables of what the ledger returns.
Every value a client or the database chose is escaped (`escaping.visible`)
and never read as rich markup."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import typer
from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.highlighter import JSONHighlighter
from rich.live import Live
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from ..durations import ago, human_duration, iso
from ..ledger import Operator
from ..outcomes import FencedEvent, RowView, State, Stats, Status
from ..policy import Policy
from ..responses import header_problem, stored_header_pairs
from .core import EXIT_INTERRUPTED
from .escaping import visible
from .hints import hint_command
from .output import PIPE_WIDTH, console
from .words import body_kind, state_words, takeovers_words

# A long listing is printed as a run of tables of this many rows (the header
# on the first only): a rich Table holds all its rows until it is printed.
PENDING_TABLE_CHUNK = 500


def shown(value: object) -> Text:
    """A value from a client or the database as a rich cell: escaped (see
    `escaping.visible`), and a Text so that rich never reads it as markup.

    >>> shown("[bold]acct\\x1b").plain
    '[bold]acct\\\\x1b'
    """
    return Text(visible(value))


# The longest token a value keeps whole on a narrow terminal: an ISO
# timestamp with milliseconds.
WHOLE_TOKEN = len("2026-01-01T00:00:00.000Z")


class Pairs:
    """Labels and their values: two columns where they fit with a whole
    timestamp beside the widest label; on a narrower terminal each label on
    its own line and its value indented below it, so that no timestamp or
    label is split in the middle."""

    def __init__(self) -> None:
        self.rows: list[tuple[str | Text, RenderableType]] = []

    def add_row(self, label: str | Text, value: RenderableType) -> None:
        self.rows.append((label, value))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        widest = max((cell_len(label.plain if isinstance(label, Text) else label) for label, _ in self.rows), default=0)
        if widest + 2 + WHOLE_TOKEN <= options.max_width:
            grid = Table.grid(padding=(0, 2))
            grid.add_column(style="bold", no_wrap=True)
            grid.add_column(overflow="fold")
            for label, value in self.rows:
                grid.add_row(label, value)
            yield grid
            return
        for label, value in self.rows:
            yield Text(label, style="bold") if isinstance(label, str) else label
            yield Padding(value, (0, 0, 0, 2))


def _grid() -> Pairs:
    return Pairs()


# -- one row (inspect) ------------------------------------------------------------------------
def _headers_text(headers_json: str | None) -> Text:
    # Listed from the stored JSON itself, so a header that a replay leaves out
    # (a foreign row's CR/LF value, a number) is shown with the reason.
    pairs = stored_header_pairs(headers_json)
    if not pairs:
        return Text("(none stored)")
    lines = []
    for name, value in pairs:
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        line = f"{visible(name)}: {visible(text)}"
        problem = header_problem(name, value)
        if problem is not None:
            line += f"  (not replayed: {problem})"
        lines.append(line)
    return Text("\n".join(lines))


def _response_rows(grid: Pairs, view: RowView) -> None:
    row = view.row
    if row.status is not Status.COMPLETED:
        grid.add_row("response", "none yet: the row is pending")
        return
    kind = body_kind(row)
    raw = row.body_bytes
    size = 0 if raw is None else len(raw)
    describe = {
        "json": f"{size} bytes, JSON",
        "text": f"{size} bytes, text",
        "empty": "no body",
        "blob": f"{size} bytes, BLOB (not UTF-8): replayed byte for byte",
        "oversize": "no body: the real answer was over the body cap, so the ledger stored this 500 sentinel "
        "and every replay fails loudly (purge the key to let the client run it again)",
    }.get(kind, "no body")
    grid.add_row("response", Text(f"{visible(row.response_status)} · {describe}"))
    grid.add_row("headers", _headers_text(row.response_headers))


def _print_body(console: Console, view: RowView) -> None:
    row = view.row
    kind = body_kind(row) if row.status is Status.COMPLETED else "none"
    raw = row.body_bytes
    if kind == "json":
        console.print(Text("body", style="bold"))
        # As rich's JSON renderable draws it, but escaped: JSON strings may hold
        # DEL, C1 and bidi characters unescaped.
        indented = json.dumps(json.loads(str(row.response_body)), indent=2, ensure_ascii=False)
        pretty = Text(visible(indented, multiline=True))
        if console.is_terminal:
            pretty = JSONHighlighter()(pretty)
        # soft_wrap: a line wider than the terminal is neither cut nor broken by rich.
        console.print(pretty, soft_wrap=True)
    elif kind == "text":
        console.print(Text("body", style="bold"))
        console.print(Text(visible(str(row.response_body), multiline=True)), soft_wrap=True)
    elif kind == "blob" and raw is not None:
        console.print(Text("body (hex, first 32 bytes)", style="bold"))
        console.print(Text(raw[:32].hex(" ") + (" …" if len(raw) > 32 else "")))


def print_row(console: Console, view: RowView, events: Sequence[FencedEvent], fenced_log: bool) -> None:
    """Everything about one reservation (`inspect`)."""
    row, now = view.row, view.now
    console.print(Text(f"{visible(row.principal)} / {visible(row.key)}", style="bold"), soft_wrap=True)
    grid = _grid()
    grid.add_row("state", Text(state_words(view)))
    grid.add_row("status", shown(row.status.value))
    grid.add_row("generation", Text(takeovers_words(row.generation)))
    grid.add_row("fingerprint", shown(row.fingerprint))
    grid.add_row("created", f"{iso(row.created_at)} ({ago(row.created_at, now)})")
    grid.add_row("updated", f"{iso(row.updated_at)} ({ago(row.updated_at, now)})")
    _response_rows(grid, view)
    console.print(grid)
    _print_body(console, view)
    console.print()
    if events:
        console.print(
            Text(
                f"fenced-out events ({len(events)}): a late owner's answer was not stored; "
                "the mutation may have run twice",
                style="bold",
            )
        )
        print_events(console, events, now, show_key=False)
    elif not fenced_log:
        console.print(
            Text(
                "fenced-out events: not recorded (this ledger has only the recipe's table; "
                f"`{hint_command('init')}` adds the log)"
            )
        )
    else:
        console.print(Text("fenced-out events: none", style="bold"))


# -- listings -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Column:
    """A column of a listing. A `whole` column holds values an operator
    copies or greps for (a principal, a key, a status): they are never
    wrapped or cut; the others may fold onto further lines."""

    name: str
    whole: bool = True
    right: bool = False


def _longest_word(text: Text) -> int:
    return max((cell_len(word) for word in text.plain.split()), default=0)


class Records:
    """A listing, printed a run of rows at a time. Piped, and on a terminal
    wide enough, it is a table (the header on the first run only); on a
    terminal too narrow for the whole columns at full width, each row becomes
    a block of "column  value" lines, so that no column vanishes and no key is
    broken. Once a listing has gone to blocks it stays so."""

    def __init__(self, console: Console, columns: Sequence[Column]) -> None:
        self._console = console
        self._columns = columns
        self._blocks = False
        self._printed = False

    def _table(self, rows: Sequence[Sequence[Text]], header: bool) -> Table:
        # No edge: SIMPLE_HEAD's is a blank line above and below, and a
        # listing's first line is its header (`idemctl pending | head -1`).
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_header=header, show_edge=False)
        for c in self._columns:
            table.add_column(c.name, no_wrap=c.whole, overflow="fold", justify="right" if c.right else "left")
        for row in rows:
            table.add_row(*row)
        return table

    def _fits(self, table: Table, rows: Sequence[Sequence[Text]]) -> bool:
        """Whether the table fits the terminal with its whole columns at full
        width and its other columns folded at most down to their longest word."""
        natural = Measurement.get(self._console, self._console.options.update_width(PIPE_WIDTH), table).maximum
        slack = 0
        for i, c in enumerate(self._columns):
            if not c.whole:
                cells = [Text(c.name), *(row[i] for row in rows)]
                slack += max(cell.cell_len for cell in cells) - max(_longest_word(cell) for cell in cells)
        return natural - slack <= self._console.width

    def print(self, rows: Sequence[Sequence[Text]]) -> None:
        if not rows:
            return
        table = self._table(rows, header=not self._printed)
        if not self._blocks and (not self._console.is_terminal or self._fits(table, rows)):
            self._console.print(table)
        else:
            self._blocks = True
            width = max(cell_len(c.name) for c in self._columns)
            for row in rows:
                if self._printed:  # a blank line between records, none before the first
                    self._console.print()
                for c, cell in zip(self._columns, row, strict=True):
                    # soft_wrap: rich inserts no line break; a value longer than
                    # the terminal is wrapped by the terminal alone, and copies whole.
                    self._console.print(Text(c.name.ljust(width) + "  ", style="bold") + cell, soft_wrap=True)
                self._printed = True
        self._printed = True


def _event_columns(show_key: bool) -> list[Column]:
    columns = [Column("fenced at (UTC)"), Column("age")]
    if show_key:
        columns += [Column("principal"), Column("key")]
    return [*columns, Column("late", right=True), Column("row", right=True), Column("status", right=True)]


def print_events(console: Console, events: Sequence[FencedEvent], now: int, show_key: bool) -> None:
    """Fenced-out events, with the principal and key unless they are known."""
    rows = []
    for e in events:
        cells = [iso(e.fenced_at, millis=False), ago(e.fenced_at, now)]
        if show_key:
            cells += [e.principal, e.key]
        cells += [
            str(e.superseded_generation),
            "gone" if e.current_generation is None else str(e.current_generation),
            str(e.computed_status),
        ]
        rows.append([shown(c) for c in cells])
    Records(console, _event_columns(show_key)).print(rows)


PENDING_COLUMNS = (
    Column("principal"),
    Column("key"),
    Column("gen"),
    Column("age"),
    Column("a retry now", whole=False),
)


def pending_cells(v: RowView) -> list[Text]:
    """One pending row of the listing (see PENDING_COLUMNS)."""
    if v.state is State.PENDING_FRESH:
        verdict = Text(f"409 in progress for {human_duration(v.takeover_in_ms or 0)} more")
    else:
        verdict = Text(f"takes over as generation {v.row.generation + 1}", style="yellow")
    return [shown(v.row.principal), shown(v.row.key), shown(v.row.generation), Text(human_duration(v.age_ms)), verdict]


def stats_grid(where: str, st: Stats, policy: Policy) -> Pairs:
    """`stats` for a person: each count with what it means."""
    grid = _grid()
    grid.add_row("ledger", Text(f"{where} (schema version {st.schema_version})"))
    counts = (st.total, st.pending_fresh, st.pending_stale, st.completed, st.expired, st.taken_over)
    # Every count right-aligned to the widest, so that the notes beside them
    # start in one column whatever the number of digits.
    width = max(len(str(n)) for n in (*counts, st.fenced_out_events))

    def count(n: int, note: str = "") -> str:
        return f"{n:>{width}}" + (f"  ({note})" if note else "")

    grid.add_row("rows", count(st.total))
    grid.add_row("  pending, fresh", count(st.pending_fresh, "retries get 409 in progress"))
    grid.add_row("  pending, stale", count(st.pending_stale, "the next retry takes over, whatever their age"))
    grid.add_row("  completed", count(st.completed, "retries are replayed"))
    retention = human_duration(policy.retention_ms)
    also = f"; {st.expired_pending} of them pending, also counted as stale" if st.expired_pending else ""
    grid.add_row("  expired", count(st.expired, f"past the {retention} retention: the sweep deletes them{also}"))
    grid.add_row("taken over", count(st.taken_over, "rows with generation > 1"))
    grid.add_row("fenced-out events", count(st.fenced_out_events))
    for label, at in (
        ("oldest pending", st.oldest_pending_at),
        ("oldest completed", st.oldest_completed_at),
    ):
        grid.add_row(label, "-" if at is None else f"{iso(at)} ({ago(at, st.now)})")
    grid.add_row("size", "-" if st.storage_bytes is None else f"{st.storage_bytes:,} bytes")
    ttl, retention = human_duration(policy.pending_ttl_ms), human_duration(policy.retention_ms)
    grid.add_row("policy", f"TTL {ttl}, retention {retention}")
    return grid


def watch_stats(ledger: Operator, *, interval_ms: int, count: int | None) -> None:
    """`stats --watch`: the counts refreshed every interval until Ctrl-C (or
    `count` refreshes). On a terminal a live view that also shows what
    changed since the watch began (new fenced-out events stand out); piped,
    one line per refresh."""
    out = console()
    first = ledger.stats()
    where = ledger.describe()
    shown_count = 0
    try:
        if out.is_terminal:
            with Live(_watch_view(where, first, first, ledger.policy), console=out, auto_refresh=False) as live:
                while count is None or shown_count < count:
                    st = ledger.stats() if shown_count else first
                    live.update(_watch_view(where, st, first, ledger.policy), refresh=True)
                    shown_count += 1
                    if count is not None and shown_count >= count:
                        break
                    time.sleep(interval_ms / 1000)
        else:
            while count is None or shown_count < count:
                st = ledger.stats() if shown_count else first
                typer.echo(_watch_line(st, first))
                shown_count += 1
                if count is not None and shown_count >= count:
                    break
                time.sleep(interval_ms / 1000)
    except KeyboardInterrupt:
        # The live view has been put away by now; Ctrl-C exits 130 in every command.
        raise typer.Exit(EXIT_INTERRUPTED) from None


def _watch_line(st: Stats, first: Stats) -> str:
    # With what the live view says since the watch began: new fenced-out
    # events and how the expired count moved.
    return (
        f"{iso(st.now)} rows={st.total} pending_fresh={st.pending_fresh} pending_stale={st.pending_stale} "
        f"completed={st.completed} expired={st.expired} taken_over={st.taken_over} "
        f"fenced_out={st.fenced_out_events} since={iso(first.now)} "
        f"new_fenced_out={st.fenced_out_events - first.fenced_out_events} "
        f"expired_change={st.expired - first.expired:+d}"
    )


def _watch_view(where: str, st: Stats, first: Stats, policy: Policy) -> Pairs:
    grid = stats_grid(where, st, policy)
    new_fenced = st.fenced_out_events - first.fenced_out_events
    since = f"since {iso(first.now)}: "
    if new_fenced > 0:
        alert = since + f"{new_fenced} new fenced-out event(s): see {hint_command('fenced --since 1h')}"
        grid.add_row(Text("watching", style="bold red"), Text(alert, style="bold red"))
    else:
        grid.add_row("watching", since + f"no new fenced-out events; expired {st.expired - first.expired:+d}")
    grid.add_row("refreshed", f"{iso(st.now)} (Ctrl-C to stop)")
    return grid
