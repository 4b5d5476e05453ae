"""Rewrite one benchmark's summary in README.md, between its markers
``<!-- bench/NAME summary: begin -->`` and ``<!-- bench/NAME summary: end -->``."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def replace_block(script: str, lines: list[str]) -> bool:
    """Put ``lines`` between the markers of ``script`` (e.g. "bench/faults.py"); False when
    README.md has no such markers (nothing is changed)."""
    begin, end = f"<!-- {script} summary: begin -->", f"<!-- {script} summary: end -->"
    text = README.read_text()
    if begin not in text or end not in text:
        return False
    head, rest = text.split(begin, 1)
    README.write_text(head + "\n".join([begin, *lines, end]) + rest.split(end, 1)[1])
    return True
