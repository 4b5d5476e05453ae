"""Text that users control, made safe to print and log.

Job files, the files a runner writes (outcome.json, heartbeat.json, exit.json) and a job's
output are written by its owner. Printed as they are, a newline in them writes a line of its
own into the daemon's log ("[12:00:00] job 2 bob-job: cancelled: ..."), an ESC sequence moves
the cursor, recolours, retitles or clears the terminal of whoever reads `oomguard show`, and a
bidi override turns the rest of a line around. ``escape`` shows each such character as a
visible escape (``\\n``, ``\\x1b``, ``\\u202e``) instead, at the place where the text is printed
or logged (the CLI, the daemon's log, notifications, the report's figure).

Escaping is idempotent: what it returns has no character it would escape again, so text that
went through it once (an event's message in the store) may go through it again where it is
printed. Backslashes are left as they are: a literal ``\\n`` in a message looks like an
escaped newline, but it cannot start a line.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

__all__ = ["escape", "escape_block", "shorten"]

# C0 controls (newline, CR, tab, ESC, BEL, backspace, ...), DEL and the C1 controls (0x80-0x9f:
# CSI 0x9b and OSC 0x9d act as ESC [ and ESC ] on some terminals); the Unicode line and paragraph
# separators; the bidi embeddings, overrides, isolates and marks; the byte order mark; the
# "tag" characters (invisible ASCII look-alikes); lone surrogates (from undecodable bytes: a
# UTF-8 stream cannot even print them, it raises).
_UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff\ud800-\udfff\U000e0000-\U000e007f]"
)
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _shown(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def escape(text: Any, *, keep: str = "") -> str:
    """``text`` (made a str) with every control, bidi and invisible formatting character
    written as a visible escape, except those in ``keep`` (e.g. ``"\\n"`` for text whose lines
    are its own: a report; ``"\\n\\r\\t"`` for a training log). Without ``keep`` the result is
    one line."""
    text = text if isinstance(text, str) else str(text)
    if keep:
        return _UNSAFE.sub(lambda m: m.group() if m.group() in keep else _shown(m), text)
    return _UNSAFE.sub(_shown, text)


def escape_block(first: Any, rest: Any = "", *, indent: str = "    ") -> str:
    """A log record of several lines: ``first`` as one line, then the lines of ``rest`` (kept
    as lines, escaped otherwise), each indented, so that nothing in either can start a line
    that reads as a record of its own."""
    head = escape(first)
    body = escape(rest, keep="\n").strip("\n")
    if not body:
        return head
    return head + "\n" + "\n".join(indent + line for line in body.split("\n"))


def shorten(text: str, width: int) -> str:
    """``text`` escaped, on one line (runs of whitespace made one space) and at most ``width``
    characters, cut between words with " …" where it was longer."""
    return textwrap.shorten(escape(" ".join(text.split())), width=width, placeholder=" …")
