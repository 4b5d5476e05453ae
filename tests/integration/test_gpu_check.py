"""bench/gpu_check.py: its dry run on the CPU, its refusal without CUDA, and the real check on a GPU.

The dry run is the same code as the GPU check (oomguard's runner with the conditional trainer,
the doctor between attempts, the sweep and the oracle races) on a tiny UNet2DConditionModel
under emulated device memory, so that a GPU session does not spend its minutes on a bug.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"
NO_CUDA = "no CUDA GPU found: bench/gpu_check.py measures real GPU memory; run it on a machine with an NVIDIA GPU"
PLAN = re.compile(r"^mb=\d+x\d+( |$)")


def run_check(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def check_results(out: Path, stem: str, cards: int) -> dict[str, Any]:
    """Both files, one row per card in the markdown table, a plan for each card."""
    data = json.loads((out / f"{stem}.json").read_text())
    markdown = (out / f"{stem}.md").read_text()
    names = [card["card"] for card in data["cards"]]
    assert names == data["settings"]["cards"] and len(names) == cards
    for card in data["cards"]:
        assert PLAN.match(card["oomguard"]["landed_plan"]), card["oomguard"]
        assert card["oomguard"]["state"] in ("finished", "gave up", "timed out", "failed")
        assert card["oomguard"]["ooms"] == (card["oomguard"]["ooms_in_probe"] + card["oomguard"]["ooms_in_process"]
                                            + card["oomguard"]["ooms_ending_attempts"])
        rows = [line for line in markdown.splitlines() if line.startswith(f"| {card['card']} | `{card['oomguard']['landed_plan']}`")]
        assert len(rows) == 1, markdown
    assert data["machine"]["date"] in markdown and data["machine"]["torch"] in markdown
    assert "bench/gpu_check.py" in data["command"]
    return data


@pytest.mark.slow
@pytest.mark.bench  # a minute of training: `make bench` runs it, `make test` does not
@pytest.mark.timeout(300)
def test_dry_run_writes_one_row_and_a_plan_per_emulated_card(tmp_path: Path) -> None:
    result = run_check("--dry-run", "--out", str(tmp_path), timeout=240)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    data = check_results(tmp_path, "gpu-dry-run", cards=3)
    assert data["settings"]["dry_run"] and data["machine"]["gpu"] is None
    # A dry run never writes the GPU's results.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-dry-run.json", "gpu-dry-run.md"]
    # Within its budget (55 s) and a little for the interpreter and writing the files.
    assert data["total_s"] < 60
    for card in data["cards"]:
        og = card["oomguard"]
        if og["state"] == "finished":
            assert og["samples_per_s"] and og["peak_allocated_bytes"] <= card["cap_bytes"]
            assert og["peak_reserved_bytes"] is None  # no caching allocator on the emulated device


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_without_cuda_and_without_dry_run_it_exits_2_and_says_why(tmp_path: Path) -> None:
    result = run_check("--out", str(tmp_path), timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert NO_CUDA in result.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(400)
def test_real_check_on_one_emulated_card(tmp_path: Path) -> None:
    """SD 1.5's UNet on a 24 GiB card of the GPU, in a short budget (the oracle may be cut)."""
    result = run_check("--cards", "24GiB", "--budget", "200", "--out", str(tmp_path), timeout=360)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    data = check_results(tmp_path, "gpu", cards=1)
    assert data["machine"]["gpu"] == torch.cuda.get_device_name(0)
    assert data["machine"]["gpu"] in (tmp_path / "gpu.md").read_text()
