"""The reduced fault-injection set of `make faults` (bench/faults.py): one job per fault under
a real daemon while runners and the daemon are SIGKILLed, checkpoints damaged, the disk filled
and host memory squeezed under an offloading runner (both as root), and a NaN injected after
the precision rung. No job may be lost, no damaged checkpoint loaded, and every job but the
NaN and host-memory ones (whose weights have no reference) must end with the weights of the
same job trained without faults."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

# About four minutes of daemons and runners: `make faults` runs it (pytest -m bench), `make test` does not.
pytestmark = [pytest.mark.slow, pytest.mark.bench]

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import faults  # noqa: E402


def test_no_job_is_lost_and_no_damaged_checkpoint_is_loaded(tmp_path: Path) -> None:
    chosen = [
        "kill-runner", "kill-daemon", "corrupt-checkpoint", "nan-after-precision",
        *(["disk-full"] if faults.can_mount() else []),
        *(["host-memory"] if faults.host_pressure.unavailable() is None else []),
    ]
    status = faults.main(["--seeds", "1", "--faults", ",".join(chosen), "--out", str(tmp_path), "--deadline", "240"])
    summary = json.loads((tmp_path / "faults.json").read_text())["summary"]
    assert [row["fault"] for row in summary] == ["none", *chosen]
    for row in summary:
        assert (row["jobs"], row["finished"], row["lost"], row["corrupt_loaded"]) == (1, 1, 0, 0), row
        if row["fault"] != "none":
            assert row["injected"] >= 1, row
            assert row["same_weights"] == ("n/a" if row["fault"] in ("nan-after-precision", "host-memory") else "1 of 1"), row
        # Only a runner the kernel's OOM killer ended is recorded as out of host memory.
        assert row["host_oom"] == (row["injected"] if row["fault"] == "host-memory" else 0), row
    nan = next(row for row in summary if row["fault"] == "nan-after-precision")
    # Each job's loss diverged once, and the checkpoint with NaN weights was skipped on resume.
    assert (nan["diverged"], nan["damaged_skipped"]) == (1, 1), nan
    assert status == 0
    assert "| kill-runner | 1 |" in (tmp_path / "faults.md").read_text()
