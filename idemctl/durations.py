"""Operator-facing durations and instants: "90s", "15m", "24h", "7d" in, "3 h 5 min" out.

Every timestamp in the ledger is integer milliseconds since the epoch, so
these helpers parse to and format from milliseconds."""

from __future__ import annotations

import re
from datetime import UTC, datetime

_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def parse_duration(text: str) -> int:
    """Milliseconds in a duration such as ``"90s"``, ``"15m"``, ``"1h30m"`` or ``"500ms"``.

    A bare number is refused: "30" could mean 30 ms or 30 s, and a TTL of
    30 ms would let retries take over requests that are still running.

    >>> parse_duration("1h30m"), parse_duration("500ms"), parse_duration("7d")
    (5400000, 500, 604800000)
    """
    raw = str(text).strip().lower().replace(" ", "")
    if not raw:
        raise ValueError("empty duration: use a number with a unit, e.g. 30s, 15m, 24h, 7d")
    if re.fullmatch(r"\d+(\.\d+)?", raw):
        raise ValueError(f"duration {text!r} needs a unit (ms, s, m, h or d), e.g. {raw}s")
    pos, total = 0, 0.0
    for match in _PART.finditer(raw):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNIT_MS[match.group(2)]
        pos = match.end()
    if pos != len(raw) or pos == 0:
        raise ValueError(f"cannot read duration {text!r}: use e.g. 500ms, 30s, 15m, 24h, 7d or 1h30m")
    return round(total)


_UNITS = (("d", 86_400_000), ("h", 3_600_000), ("min", 60_000), ("s", 1000))


def human_duration(ms: int) -> str:
    """A short reading of a duration, at most two units: ``"12 s"``, ``"3 h 5 min"``.

    Rounded to the nearest step of the last unit shown, so that a duration
    reads the same wherever it appears: a day less a second is ``"1 d"``, as
    the retention it counts down from is.

    >>> human_duration(12_400), human_duration(11_100_000), human_duration(90_061_000)
    ('12 s', '3 h 5 min', '1 d 1 h')
    >>> human_duration(86_399_000), human_duration(59_600), human_duration(5_399_999)
    ('1 d', '1 min', '1 h 30 min')
    """
    ms = int(ms)
    if ms < 0:
        return "-" + human_duration(-ms)
    if ms < 1000:
        return f"{ms} ms"
    top = next(i for i, (_, size) in enumerate(_UNITS) if ms >= size or i == len(_UNITS) - 1)
    step = _UNITS[min(top + 1, len(_UNITS) - 1)][1]
    rest = (ms + step // 2) // step * step
    parts: list[str] = []
    for name, size in _UNITS:
        if rest >= size or parts:
            count, rest = divmod(rest, size)
            if count:
                parts.append(f"{count} {name}")
            if len(parts) == 2 or (parts and count == 0):
                break
    return " ".join(parts)


def iso(ms: int | None, *, millis: bool = True) -> str:
    """An instant in ms as ISO 8601 UTC, with milliseconds unless `millis=False`.

    >>> iso(1_700_000_000_123), iso(1_700_000_000_123, millis=False)
    ('2023-11-14T22:13:20.123Z', '2023-11-14T22:13:20Z')
    """
    if ms is None:
        return "-"
    stamp = datetime.fromtimestamp(int(ms) // 1000, tz=UTC)
    fraction = f".{int(ms) % 1000:03d}" if millis else ""
    return stamp.strftime("%Y-%m-%dT%H:%M:%S") + fraction + "Z"


def ago(ms: int, now: int) -> str:
    """``"12 s ago"`` for a past instant, ``"in 12 s"`` for a future one.

    >>> ago(1_000, 13_000), ago(20_000, 13_000)
    ('12 s ago', 'in 7 s')
    """
    delta = now - ms
    return f"{human_duration(delta)} ago" if delta >= 0 else f"in {human_duration(-delta)}"
