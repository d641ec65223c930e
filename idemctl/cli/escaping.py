"""Text from clients and the database made safe for a terminal: the CLI's
one escaping scheme, for its human output and its JSON documents alike."""

from __future__ import annotations

import re
import unicodedata

# Candidates for escaping: everything but printable ASCII. Which of them are
# escaped is then decided per character by its Unicode category, so that
# ordinary non-ASCII text ("café", "注文") stays readable.
_NOT_PLAIN = re.compile(r"[^\x20-\x7e]")
_NOT_PLAIN_BLOCK = re.compile(r"[^\x20-\x7e\n\t]")
# Cc: C0 controls, DEL, C1 controls (ESC, CSI U+009B, OSC U+009D ...).
# Cf: invisible format characters, among them the bidi embeddings, overrides
# and isolates (U+202A-U+202E, U+2066-U+2069) and marks (U+200E, U+200F).
# Zl, Zp: U+2028 and U+2029, which some programs treat as line breaks.
# Cs: lone surrogates, which cannot even be encoded for the terminal.
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})
_SHORT = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape_char(match: re.Match[str]) -> str:
    ch = match.group()
    if unicodedata.category(ch) not in _ESCAPED_CATEGORIES:
        return ch
    if ch in _SHORT:
        return _SHORT[ch]
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def visible(value: object, *, multiline: bool = False) -> str:
    """Text from a client or a database, made safe to print on a terminal.

    The one escaping scheme of the CLI's human output: every control
    character (C0, DEL, C1), invisible format character (bidi overrides and
    isolates, zero-width characters), line or paragraph separator and lone
    surrogate is shown as the escape a Python string literal would use:
    ``\\t`` ``\\n`` ``\\r``, else ``\\xNN``, ``\\uNNNN`` or
    ``\\UNNNNNNNN``. Everything else is shown as is: printable ASCII (so
    an Idempotency-Key's visible text never changes, backslashes included)
    and ordinary Unicode text. `multiline` keeps newlines and tabs, for a
    stored body shown as a block. `--json` output is exact instead.

    >>> visible("acct\\x1b[2J\\r\\n\\x9b\\u202eA")
    'acct\\\\x1b[2J\\\\r\\\\n\\\\x9b\\\\u202eA'
    >>> print(visible("line 1\\r\\nline 2\\x07", multiline=True))
    line 1\\r
    line 2\\x07
    """
    text = value if isinstance(value, str) else str(value)
    return (_NOT_PLAIN_BLOCK if multiline else _NOT_PLAIN).sub(_escape_char, text)


def _json_escape_char(match: re.Match[str]) -> str:
    ch = match.group()
    if unicodedata.category(ch) not in _ESCAPED_CATEGORIES:
        return ch
    code = ord(ch)
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000  # a UTF-16 surrogate pair, as JSON spells characters beyond the BMP
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def terminal_safe_json(text: str) -> str:
    """JSON text from `json.dumps(..., ensure_ascii=False)` with the characters
    `visible` escapes written as JSON escapes too: json.dumps escapes only
    U+0000-U+001F, so DEL, C1 controls and bidi overrides would reach the
    terminal raw. The document parses to exactly the same values.

    >>> terminal_safe_json('{"p": "a\u202eb\u009b", "q": "caf\u00e9"}')
    '{"p": "a\\\\u202eb\\\\u009b", "q": "café"}'
    """
    # Outside strings json.dumps writes only spaces and newlines, and inside
    # them it never writes a raw newline, so only string contents change.
    return _NOT_PLAIN_BLOCK.sub(_json_escape_char, text)
