"""The reduced fault-injection set of `make faults` (bench/faults.py): two jobs per fault under
a real daemon while runners and the daemon are SIGKILLed and checkpoints damaged. No job may
be lost, no damaged checkpoint loaded, and every job must end with the weights of the same
job trained without faults."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import faults  # noqa: E402


def test_no_job_is_lost_and_no_damaged_checkpoint_is_loaded(tmp_path: Path) -> None:
    chosen = ["kill-runner", "kill-daemon", "corrupt-checkpoint", *(["disk-full"] if faults.can_mount() else [])]
    status = faults.main(["--seeds", "2", "--faults", ",".join(chosen), "--out", str(tmp_path), "--deadline", "240"])
    summary = json.loads((tmp_path / "faults.json").read_text())["summary"]
    assert [row["fault"] for row in summary] == ["none", *chosen]
    for row in summary:
        assert (row["jobs"], row["finished"], row["lost"], row["corrupt_loaded"]) == (2, 2, 0, 0), row
        if row["fault"] != "none":
            assert row["injected"] >= 1 and row["same_weights"] == "2 of 2", row
    assert status == 0
    assert "| kill-runner | 2 |" in (tmp_path / "faults.md").read_text()
