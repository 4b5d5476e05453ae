"""bench/speed.py --quick: it runs every part at tiny sizes, writes speed.md and speed.json with
every section, and leaves no process and no scratch folder behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A smoke run of a benchmark script: `make bench` runs it (pytest -m bench), `make test` does not.
pytestmark = [pytest.mark.slow, pytest.mark.bench]

SECTIONS = (
    "# Speed benchmark",
    "## Summary",
    "## Recovery latency",
    "### In the process",
    "### With a restart",
    "## Supervisor overhead",
    "## Queue scale",
    "## Method",
)


def _processes_naming(text: str) -> list[int]:
    found = []
    for pid_dir in Path("/proc").iterdir():
        if pid_dir.name.isdigit():
            try:
                if text.encode() in (pid_dir / "cmdline").read_bytes() or text.encode() in (pid_dir / "environ").read_bytes():
                    found.append(int(pid_dir.name))
            except OSError:
                continue
    return found


def test_the_quick_speed_benchmark_writes_both_files_with_every_section_and_cleans_up(tmp_path: Path) -> None:
    out = tmp_path / "results"
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "speed.py"), "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"

    report = (out / "speed.md").read_text()
    for section in SECTIONS:
        assert f"\n{section}\n" in f"\n{report}", f"speed.md has no {section!r} section"
    assert ".venv/bin/python bench/speed.py --quick --out" in report  # the command to rerun

    data = json.loads((out / "speed.json").read_text())
    assert data["settings"]["quick"] is True
    assert {"machine", "command", "in_process", "restart", "overhead", "queue"} <= data.keys()
    recovered = data["in_process"]["runs"][0]
    assert recovered["from_plan"] != recovered["to_plan"] and recovered["total_s"] > 0
    restarted = data["restart"]["runs"][0]
    assert restarted["from_plan"] != restarted["to_plan"] and restarted["oom_to_next_step_s"] > 0
    assert all(data["overhead"]["steps"][arm] > 0 for arm in "ABC") and data["overhead"]["ratio"] > 0 and data["overhead"]["control_ratio"] > 0
    queue = data["queue"]
    assert queue["jobs"] == 100 and queue["inbox"]["jobs_per_s"] > 0 and queue["store_bytes_total"] > 0
    assert queue["status"]["n"] >= 1 and queue["status_all"]["n"] >= 1 and queue["show"]["n"] >= 1

    # Every daemon, shim, runner and neighbour it started is gone, and so is its scratch folder.
    assert data["stray_processes_killed"] == 0
    assert _processes_naming(data["scratch"]) == []
    assert not Path(data["scratch"]).exists()
