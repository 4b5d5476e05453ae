"""A built-in job under the caching allocator's emulation lands on its first choice: the probe
measures reserved peaks and the memory model's lines carry the reserve, so the plan it starts
at fits what the allocator will reserve, not only what it allocates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.conftest import oomguard

pytestmark = pytest.mark.slow

JOB = Path(__file__).parents[2] / "bench" / "jobs" / "conv32.toml"
MiB = 2**20


def test_the_first_choice_fits_what_the_allocator_reserves(tmp_path: Path) -> None:
    # conv32 under caching/1024 (measured): at micro-batch 12 the step allocates 13.8 MiB and
    # reserves 19.0; at 1, 7.45 and 7.91. Lines of allocated bytes, or a reserve ratio taken
    # from the micro-batch-1 steps (1.06), start at 12 and run out under 17 MiB.
    result = oomguard(
        "run", str(JOB), "--workdir", str(tmp_path / "work"), "--json",
        "--emulate-device-memory", "17MiB", "--emulate-allocator", "caching/1024", timeout=600,
    )
    record = json.loads(result.stdout)
    assert record["state"] == "finished", record["result"]
    attempt, = record["attempts"]
    measurements = attempt["outcome"]["measurements"]
    assert all(m["fits"] for m in measurements), [(m["plan"], m["peak_bytes"]) for m in measurements if not m["fits"]]
    held = [m["reserved_bytes"] for m in measurements]
    assert all(h is not None for h in held) and max(h for h, m in zip(held, measurements) if m["plan"] == attempt["outcome"]["plan"]) <= 17 * MiB
    assert all(m["reserved_bytes"] >= m["peak_bytes"] for m in measurements)
