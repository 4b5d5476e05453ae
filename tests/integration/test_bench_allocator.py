"""bench/allocator_pairs.py --quick: the fragmentation pair is answered by the allocator rung at
its batch, the control needs no rung, both files are written; and bench/ladder.py's sweep under
the caching allocator's emulation records a reserved peak at least the exact one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A smoke run of a benchmark script: `make bench` runs it (pytest -m bench), `make test` does not.
pytestmark = [pytest.mark.slow, pytest.mark.bench]


def test_the_quick_allocator_pairs_take_the_allocator_rung_where_the_cache_fragments(tmp_path: Path) -> None:
    out = tmp_path / "results"
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "allocator_pairs.py"), "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    data = json.loads((out / "allocator_pairs.json").read_text())
    fragmenting, control = data["pairs"]
    # The bytes fit: no OOM under the exact emulation.
    assert fragmenting["exact"]["state"] == "finished" and fragmenting["exact"]["ooms"] == 0
    # The fragmented cache does not: one OOM, the allocator rung, the batch kept.
    assert fragmenting["reserved_mib"] > fragmenting["cap_mib"] >= fragmenting["reserved_expandable_mib"]
    caching = fragmenting["caching"]
    assert caching["state"] == "finished" and caching["allocator_rung"] and caching["landed_micro_batch"] == fragmenting["batch"]
    assert caching["ooms"] == 1
    # Without the rung the plain script (no {grad_accum}) has nothing left to try.
    assert fragmenting["caching_without_allocator_rung"]["state"] != "finished"
    assert control["caching"]["ooms"] == 0 and not control["caching"]["allocator_rung"]
    (row,) = data["builtin"]
    assert row["reserved_mib"] >= row["exact_peak_mib"] and row["reserved_expandable_mib"] >= row["exact_peak_mib"]
    report = (out / "allocator_pairs.md").read_text()
    assert "# Fragmentation pairs and the allocator rung" in report and "--quick" in report


def test_the_ladder_sweep_under_the_caching_emulation_records_reserved_at_least_exact() -> None:
    code = (
        "import sys; sys.path.insert(0, 'bench'); import ladder\n"
        "from oomguard.jobs.spec import load_job_file\n"
        "path = 'bench/jobs/conv32.toml'\n"
        "plan = load_job_file(path).initial_plan()\n"
        "exact = ladder.sweep_task(path, plan, 1)\n"
        "caching = ladder.sweep_task(path, plan, 1, 'caching/1024')\n"
        "assert 'reserved_peak_bytes' not in exact\n"
        "assert caching['peak_bytes'] == exact['peak_bytes'], (caching['peak_bytes'], exact['peak_bytes'])\n"
        "assert caching['reserved_peak_bytes'] >= caching['allocated_peak_bytes'] >= caching['peak_bytes']\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
