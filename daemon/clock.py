"""The daemon's clock, injected so that tests drive time instead of sleeping through it."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float:
        """Seconds since the epoch: what the store records."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back: for waits and deadlines within one daemon."""
        ...


class SystemClock:
    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()
