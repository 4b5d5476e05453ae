"""Sizes and durations: reading them from text and writing them for people.

The one place for the units oomguard reads and prints. Several formatters live here side by
side because their texts are pinned (tests, notifications, the emulated OOM that must read like
PyTorch's own); each one's name and comment say what it is for.

This module must not import torch (nor anything heavy): the daemon and the CLI parse and print
sizes without paying for a torch import, and tests/integration/test_imports.py checks it.
"""

from __future__ import annotations

import math
import re
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation

__all__ = [
    "GiB",
    "KiB",
    "MiB",
    "PRINTED_NUMBER",
    "PRINTED_SIZE",
    "PRINTED_UNIT",
    "TiB",
    "describe_size",
    "duration_axis_unit",
    "format_bytes",
    "format_duration_short",
    "format_duration_words",
    "format_mib",
    "format_torch_size",
    "parse_size",
    "printed_size_bytes",
    "size_axis_unit",
]

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4


# Reading sizes ---------------------------------------------------------------------------------

# Keys are lower case because units are matched case-insensitively. Decimal units are powers of
# ten, binary units powers of 1024, as in IEC 80000-13.
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": TiB,
}

_USER_SIZE = re.compile(r"\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*([A-Za-z]*)\s*", re.ASCII)
_EXPECTED = "expected a number and a unit such as 48MiB, 1.5GiB or 2GB"


def parse_size(text: str) -> int:
    """Return the number of bytes in ``text`` a person wrote, e.g. ``"48MiB"`` -> 50331648.

    Units are case-insensitive: B, KB/MB/GB/TB (powers of 1000) and KiB/MiB/GiB/TiB
    (powers of 1024); a bare number is bytes. Fractions are rounded to whole bytes.
    Sizes must be positive.
    """
    match = _USER_SIZE.fullmatch(text)
    unit = _UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit is None:
        raise ValueError(f"not a memory size: {text!r} ({_EXPECTED})")
    try:
        number = Decimal(match.group(1))
    except InvalidOperation:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"not a memory size: {text!r} ({_EXPECTED})") from None
    nbytes = int((number * unit).to_integral_value(rounding=ROUND_HALF_EVEN))
    if nbytes <= 0:
        raise ValueError(f"memory size must be positive, got {text!r} ({_EXPECTED})")
    return nbytes


# A size as an error message prints it (PyTorch's allocators, XLA, numpy): a number, then its
# unit. PRINTED_SIZE's groups are the number and the unit; matched case-insensitively where used.
PRINTED_NUMBER = r"\d+(?:\.\d+)?"
PRINTED_UNIT = r"bytes|byte|B|[KMGT]iB|[kKMGT]B"
PRINTED_SIZE = rf"({PRINTED_NUMBER})\s*({PRINTED_UNIT})\b"
_POWER = {"k": 1, "m": 2, "g": 3, "t": 4}


def printed_size_bytes(number: str, unit: str, *, binary_kb: bool = False) -> int:
    """A size as a message printed it, in bytes: ``("20.00", "MiB")`` -> 20971520.

    "KB/MB/GB/TB" are powers of 1000, or of 1024 with ``binary_kb`` (how PyTorch's MPS allocator
    printed them). Unlike ``parse_size`` it never refuses: the number and unit come from a
    pattern (``PRINTED_SIZE``) that matched, and zero is a figure a message may print.
    """
    if unit.lower() in ("b", "byte", "bytes"):
        return int(Decimal(number))
    base = 1024 if unit.lower().endswith("ib") or binary_kb else 1000
    return round(Decimal(number) * base ** _POWER[unit[0].lower()])


# Writing sizes ---------------------------------------------------------------------------------


def format_torch_size(n: int) -> str:
    """Format ``n`` bytes exactly as c10's CUDA caching allocator does in OOM messages.

    Mirrors ``format_size`` in c10/cuda/CUDACachingAllocator.cpp: up to and including
    1024 bytes prints "N bytes", then KiB up to 1 MiB, MiB up to 1 GiB, else GiB, with two
    decimals. The thresholds are inclusive (``<=``), so 1024 is "1024 bytes" and 1 MiB is
    "1024.00 KiB", just like PyTorch. Byte for byte PyTorch's: the emulated device's OOM
    message must read like a real one (jobs/device_memory.py), so do not "improve" it.
    """
    if n < 0:
        raise ValueError(f"a memory size cannot be negative, got {n}")
    if n <= KiB:
        return f"{n} bytes"
    if n <= MiB:
        return f"{n / KiB:.2f} KiB"
    if n <= GiB:
        return f"{n / MiB:.2f} MiB"
    return f"{n / GiB:.2f} GiB"


def format_bytes(n: int | None) -> str:
    """Bytes for the doctor's reasons and the CLI's tables: KiB and MiB with one decimal, GiB
    with two; never bytes, so small figures read "0.5 KiB" ("?" when unknown).

    Its own wording rather than c10's: the doctor's reasons, stored events and the CLI's
    columns are pinned to it."""
    if n is None:
        return "?"
    if n < MiB:
        return f"{n / KiB:.1f} KiB"
    if n < GiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / GiB:.2f} GiB"


def format_mib(n: float) -> str:
    """Bytes in MiB with one decimal whatever the size, e.g. "18.9 MiB": the runner's progress
    lines (the probe's, the loop's) print figures side by side in one unit (README quotes them)."""
    return f"{n / MiB:.1f} MiB"


def describe_size(n: int | None) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1, e.g. "1.50 GiB" ("?" when unknown).

    The wording of the verdicts read from error text (``oomguard diagnose``): two decimals like
    the messages it quotes, but with TiB and without c10's inclusive thresholds, so that it
    reads naturally next to the figures a person sees in the log."""
    if n is None:
        return "?"
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


def size_axis_unit(largest: float) -> tuple[str, float]:
    """The unit (name, bytes) for a plot axis whose largest value is ``largest`` bytes."""
    if largest >= GiB:
        return "GiB", float(GiB)
    if largest >= MiB:
        return "MiB", float(MiB)
    return "KiB", float(KiB)


# Writing durations -----------------------------------------------------------------------------
# Three shapes, on purpose: a table column needs a short token, a sentence needs words, a plot
# axis needs one unit for a whole span. Their thresholds differ because their readers do.


def format_duration_short(seconds: float) -> str:
    """A duration as a short token for a table column ("45s", "12m", "3.5h", "2.0d")."""
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f}m"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def format_duration_words(seconds: float) -> str:
    """A duration for a sentence in an event or a log ("45 s", "12 minutes")."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} minutes"


def duration_axis_unit(span_s: float) -> tuple[str, float]:
    """The unit (name, seconds) for a time axis that spans ``span_s`` seconds."""
    if span_s < 180:
        return "s", 1.0
    if span_s < 3 * 3600:
        return "min", 60.0
    if span_s < 3 * 86400:
        return "h", 3600.0
    return "days", 86400.0


# A time limit as Slurm's --time takes it: "MM", "MM:SS", "HH:MM:SS", "D-HH", "D-HH:MM" or
# "D-HH:MM:SS" (a bare number is minutes).
_SLURM_TIME = re.compile(r"^(?:(\d+)-(\d+)(?::(\d+))?(?::(\d+))?|(\d+)(?::(\d+))?(?::(\d+))?)$")
SLURM_TIME_FORMS = '"MM", "HH:MM:SS" or "D-HH:MM:SS" as sbatch --time takes them (e.g. "30", "4:00:00", "2-00:00:00")'


def parse_time_limit(value: str | int) -> int:
    """Seconds in a time limit written as sbatch's --time takes it (an integer: minutes)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"a time limit must be positive, got {value} minutes")
        return value * 60
    match = _SLURM_TIME.match(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"not a time limit: {value!r} (expected {SLURM_TIME_FORMS})")
    days, day_hours, day_minutes, day_seconds, first, second, third = (int(g) if g else 0 for g in match.groups())
    if match.group(1) is not None:
        seconds = ((days * 24 + day_hours) * 60 + day_minutes) * 60 + day_seconds
    elif match.group(7) is not None:  # HH:MM:SS
        seconds = (first * 60 + second) * 60 + third
    else:  # MM or MM:SS
        seconds = first * 60 + second
    if seconds <= 0:
        raise ValueError(f"a time limit must be positive, got {value!r}")
    return seconds


def format_time_limit(seconds: float) -> str:
    """``seconds`` as sbatch's --time takes it, "D-HH:MM:SS", rounded up to whole minutes
    (Slurm counts time limits in minutes)."""
    minutes = max(1, -(-int(math.ceil(seconds)) // 60))
    days, minutes = divmod(minutes, 24 * 60)
    hours, minutes = divmod(minutes, 60)
    return f"{days}-{hours:02d}:{minutes:02d}:00"
