"""Is that process still the one we started? A pid alone can be reused after a reboot or a
long run; the pid and its start time (in clock ticks since boot, /proc/PID/stat field 22)
name one process for good."""

from __future__ import annotations

from pathlib import Path


def start_ticks(pid: int) -> int | None:
    """The start time of a live process, None when it is gone (or a zombie: it has ended and
    only waits for its parent to collect it)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')'.
    fields = text[text.rindex(")") + 2:].split()
    state, start = fields[0], fields[19]
    if state in ("Z", "X"):
        return None
    return int(start)


def is_running(pid: int, started: int | None) -> bool:
    ticks = start_ticks(pid)
    return ticks is not None and (started is None or ticks == started)
