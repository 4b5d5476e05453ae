"""Capacity schedules: the emulated device's size, changing at given optimizer steps.

The sizes themselves (parsing "48MiB", printing them) live in strategies/units.py. This
module must not import torch: the daemon and the CLI parse capacity schedules without paying
for (or needing) a torch import.
"""

from __future__ import annotations

from dataclasses import dataclass

from oomguard.strategies.units import GiB, KiB, MiB, TiB, parse_size

__all__ = ["CapSchedule"]

# Largest unit first; str(CapSchedule) uses the largest unit that divides a size exactly
# so that the text parses back to the same number of bytes.
_CANONICAL_UNITS: tuple[tuple[str, int], ...] = (
    ("TiB", TiB),
    ("TB", 10**12),
    ("GiB", GiB),
    ("GB", 10**9),
    ("MiB", MiB),
    ("MB", 10**6),
    ("KiB", KiB),
    ("kB", 10**3),
    ("B", 1),
)


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
