"""Memory sizes as people write them ("48MiB", "2GB") and as PyTorch prints them.

This module must not import torch: the daemon and the CLI parse sizes and
capacity schedules without paying for (or needing) a torch import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation

__all__ = ["CapSchedule", "format_size", "parse_size"]

KiB = 1024
MiB = 1024**2
GiB = 1024**3

# Keys are lower case because units are matched case-insensitively. Decimal units
# are powers of ten, binary units powers of 1024, as in IEC 80000-13.
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
    "tib": 1024**4,
}

# Largest unit first; str(CapSchedule) uses the largest unit that divides a size exactly
# so that the text parses back to the same number of bytes.
_CANONICAL_UNITS: tuple[tuple[str, int], ...] = (
    ("TiB", 1024**4),
    ("TB", 10**12),
    ("GiB", GiB),
    ("GB", 10**9),
    ("MiB", MiB),
    ("MB", 10**6),
    ("KiB", KiB),
    ("kB", 10**3),
    ("B", 1),
)

_SIZE_RE = re.compile(r"\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*([A-Za-z]*)\s*", re.ASCII)
_EXPECTED = "expected a number and a unit such as 48MiB, 1.5GiB or 2GB"


def parse_size(text: str) -> int:
    """Return the number of bytes in ``text``, e.g. ``"48MiB"`` -> 50331648.

    Units are case-insensitive: B, KB/MB/GB/TB (powers of 1000) and KiB/MiB/GiB/TiB
    (powers of 1024); a bare number is bytes. Fractions are rounded to whole bytes.
    Sizes must be positive.
    """
    match = _SIZE_RE.fullmatch(text)
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


def format_size(n: int) -> str:
    """Format ``n`` bytes exactly as c10's CUDA caching allocator does in OOM messages.

    Mirrors ``format_size`` in c10/cuda/CUDACachingAllocator.cpp: up to and including
    1024 bytes prints "N bytes", then KiB up to 1 MiB, MiB up to 1 GiB, else GiB, with two
    decimals. The thresholds are inclusive (``<=``), so 1024 is "1024 bytes" and 1 MiB is
    "1024.00 KiB", just like PyTorch.
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


def _canonical_size(n: int) -> str:
    for name, unit in _CANONICAL_UNITS:
        if n % unit == 0:
            return f"{n // unit}{name}"
    raise AssertionError("unreachable: every size is a whole number of bytes")


@dataclass(frozen=True)
class CapSchedule:
    """Emulated device capacity as a function of the optimizer step.

    ``entries`` holds ``(from_step, bytes)`` pairs with strictly increasing steps: from
    ``from_step`` on (inclusive) the capacity is ``bytes``, until the next entry. Before
    the first entry there is no cap. A drop in capacity emulates another process taking
    memory at that step, which lets tests force an OOM after the first checkpoint.
    """

    entries: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not self.entries:
            raise ValueError("a capacity schedule needs at least one entry")
        previous: int | None = None
        for step, nbytes in self.entries:
            if step < 0:
                raise ValueError(f"capacity schedule step must be >= 0, got {step}")
            if nbytes <= 0:
                raise ValueError(f"capacity must be positive, got {nbytes} bytes at step {step}")
            if previous is not None and step <= previous:
                raise ValueError(
                    f"capacity schedule steps must be strictly increasing, got step {step} "
                    f"after step {previous}"
                )
            previous = step

    @classmethod
    def parse(cls, text: str) -> CapSchedule:
        """Parse ``"48MiB"``, ``"64MiB,40MiB@15"`` or ``"40MiB@15"``.

        ``SIZE@STEP`` means "from optimizer step STEP on, the capacity is SIZE". Only the
        first entry may leave out ``@STEP``, which then means step 0.
        """
        form = "expected SIZE or SIZE@STEP entries separated by commas, e.g. 64MiB,40MiB@15"
        parts = text.split(",")
        entries: list[tuple[int, int]] = []
        for index, part in enumerate(parts):
            size_text, at, step_text = part.partition("@")
            if not size_text.strip():
                raise ValueError(f"not a capacity schedule: {text!r} ({form})")
            if not at:
                if index > 0:
                    raise ValueError(
                        f"capacity schedule entry {part.strip()!r} in {text!r} needs a step: only "
                        f"the first entry may leave out @STEP ({form})"
                    )
                step = 0
            else:
                step_text = step_text.strip()
                if not (step_text.isascii() and step_text.isdigit()):
                    raise ValueError(
                        f"not a step: {step_text!r} in capacity schedule {text!r} "
                        f"(expected a whole number >= 0 after '@')"
                    )
                step = int(step_text)
            entries.append((step, parse_size(size_text)))
        return cls(tuple(entries))

    def limit_at(self, step: int) -> int | None:
        """The capacity in bytes at optimizer step ``step``, or None when uncapped."""
        limit: int | None = None
        for from_step, nbytes in self.entries:
            if from_step > step:
                break
            limit = nbytes
        return limit

    def __str__(self) -> str:
        return ",".join(
            _canonical_size(nbytes) + ("" if step == 0 and i == 0 else f"@{step}")
            for i, (step, nbytes) in enumerate(self.entries)
        )


# The environment variable that sets the emulated device capacity (a CapSchedule text) for
# the daemon, `oomguard run` and the runner, like their --emulate-device-memory option.
EMULATE_DEVICE_MEMORY_ENV = "OOMGUARD_EMULATE_DEVICE_MEMORY"
