"""Which allocator the emulated device models: ``AllocatorEmulation``, parsed from
--emulate-allocator / $OOMGUARD_EMULATE_ALLOCATOR.

- ``exact`` (the default; None in a DeviceSpec): the device counts the live bytes of tensors,
  no more. Every test that does not name an allocator uses it.
- ``caching``: the device also runs a model of PyTorch's CUDA caching allocator
  (jobs/caching_allocator.py): requests rounded, carved from cached segments, memory
  *reserved* beyond what is allocated, fragmentation, ``empty_cache``, expandable segments
  (read from $PYTORCH_ALLOC_CONF / $PYTORCH_CUDA_ALLOC_CONF as torch reads them, so the
  allocator rung acts on it), and a fixed non-PyTorch overhead per process (the CUDA context
  and library workspaces) that the capacity must hold too. An OOM comes when the reserved
  memory and the overhead would pass the capacity, with PyTorch's message for that case.
- ``caching/N``: the same with every size of the allocator (blocks, segments, pages) and the
  default overhead divided by N (a power of two). The tests' and benchmarks' models are about a
  thousandth of a real one and their emulated cards have MiB where cards have GiB:
  ``caching/1024`` gives rounding and segments the weight they have on a real card.
- ``,overhead=SIZE`` sets the overhead (``caching,overhead=0``, ``caching/1024,overhead=300KiB``).

No torch here: the daemon and the CLI parse it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from oomguard.jobs.caching_allocator import AllocatorSizes
from oomguard.jobs.sizes import parse_size
from oomguard.strategies.units import MiB

EMULATE_ALLOCATOR_ENV = "OOMGUARD_EMULATE_ALLOCATOR"

# A process's device memory outside PyTorch's allocator on a real card: the CUDA context
# (300-500 MiB with CUDA 12's lazy module loading, depending on the card and driver) and the
# cuBLAS/cuDNN workspaces (tens of MiB). 512 MiB is the round figure above both; the
# per-card figure is what bench/gpu_check.py measures (--cases allocator).
DEFAULT_OVERHEAD = 512 * MiB

# The allocator settings torch reads when CUDA initialises (strategies/rungs/allocator.py sets
# exactly one of them for the allocator rung).
ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")

_FORM = "expected exact, caching, caching/N (N a power of two) or either with ,overhead=SIZE, e.g. caching/1024,overhead=300KiB"


@dataclass(frozen=True)
class AllocatorEmulation:
    """The caching allocator's emulation: sizes divided by ``divisor``; ``overhead`` bytes of
    non-PyTorch memory per process (None: the default, divided by ``divisor`` too)."""

    divisor: int = 1
    overhead: int | None = None

    def __post_init__(self) -> None:
        if self.divisor < 1 or self.divisor & (self.divisor - 1):
            raise ValueError(f"the allocator's divisor must be a power of two, got {self.divisor} ({_FORM})")
        if self.overhead is not None and self.overhead < 0:
            raise ValueError(f"the overhead cannot be negative, got {self.overhead} bytes")

    @property
    def sizes(self) -> AllocatorSizes:
        return AllocatorSizes().scaled(self.divisor)

    @property
    def overhead_bytes(self) -> int:
        return self.overhead if self.overhead is not None else DEFAULT_OVERHEAD // self.divisor

    @classmethod
    def parse(cls, text: str) -> AllocatorEmulation | None:
        """``exact`` -> None; ``caching[/N][,overhead=SIZE]`` -> an AllocatorEmulation.
        ValueError, naming the form, for anything else."""
        head, *options = [part.strip() for part in text.strip().split(",")]
        if head == "exact" and not options:
            return None
        name, slash, divisor_text = head.partition("/")
        if name != "caching":
            raise ValueError(f"not an allocator emulation: {text!r} ({_FORM})")
        divisor = 1
        if slash:
            if not (divisor_text.isascii() and divisor_text.isdigit()):
                raise ValueError(f"not a divisor: {divisor_text!r} in {text!r} ({_FORM})")
            divisor = int(divisor_text)
        overhead: int | None = None
        for option in options:
            key, equals, value = option.partition("=")
            if key.strip() != "overhead" or not equals:
                raise ValueError(f"unknown allocator option {option!r} in {text!r} ({_FORM})")
            value = value.strip()
            overhead = 0 if value in ("0", "0B") else parse_size(value)
        return cls(divisor, overhead)

    def __str__(self) -> str:
        text = "caching" if self.divisor == 1 else f"caching/{self.divisor}"
        return text if self.overhead is None else f"{text},overhead={self.overhead}B"


def expandable_segments(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the allocator settings in ``env`` turn expandable segments on (the last
    ``expandable_segments:`` option wins, as in c10's config parser)."""
    enabled = False
    for name in reversed(ALLOC_CONF_VARIABLES):  # the new name is read over the old one
        for option in env.get(name, "").split(","):
            key, _, value = option.strip().partition(":")
            if key.strip() == "expandable_segments":
                enabled = value.strip() == "True"
    return enabled
