"""A fragmentation OOM under the caching allocator's emulation, end to end: the daemon reads
PyTorch's message from the script's log, the doctor answers with the allocator rung
(expandable segments, a new process), and the job then fits at the same batch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import oomguard

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parents[1] / "scripts" / "fragmenting_train.py"
MiB = 2**20
STEPS = 3


def test_a_fragmented_cache_is_answered_by_expandable_segments_and_the_job_fits_at_its_batch(tmp_path: Path, daemon_factory) -> None:
    argv = [sys.executable, str(SCRIPT), "--train_batch_size={micro_batch}", f"--max_train_steps={STEPS}"]
    job = tmp_path / "fragmenting.toml"
    job.write_text(
        f'name = "fragmenting"\ntrainer = "command"\n[command]\nargv = {json.dumps(argv)}\n'
        f"[train]\nbatch_size = 8\nmax_steps = {STEPS}\n"
    )
    # 210 MiB: the script's second step needs 202 MiB reserved with expandable segments and
    # over 240 MiB without (its cache is in 5 MiB pieces; see the script).
    daemon = daemon_factory("--emulate-device-memory", "210MiB", "--emulate-allocator", "caching,overhead=32MiB")
    oomguard("submit", str(job), state_dir=daemon.state_dir, check=True)
    record = daemon.wait_job("1", timeout=120)
    assert record["state"] == "finished", (record["result"], record["report"])
    first, second = record["attempts"]

    # PyTorch's own message, from the emulated allocator: the reserve is large.
    outcome = first["outcome"]
    assert outcome["kind"] == "oom"
    assert "Tried to allocate 12.00 MiB" in outcome["message"]
    assert "52.00 MiB is reserved by PyTorch but unallocated" in outcome["message"]
    figures = outcome["memory"]
    assert figures["reserved"] - figures["allocated"] == 52 * MiB and figures["requested"] == 12 * MiB

    # The doctor's answer: the allocator rung, nothing else; the batch is whole.
    assert second["rung"] == "allocator"
    assert "fragmentation" in second["reason"]
    assert second["plan"]["allocator"] == "expandable_segments:True"
    assert second["plan"]["micro_batch"] == 8 and second["plan"]["grad_accum"] == 1
    assert second["outcome"]["kind"] == "finished" and second["outcome"]["step"] == STEPS
    # Measured: what the expandable segment reserved at most fits the cap.
    reserved = [m["reserved_bytes"] for m in second["outcome"]["measurements"] if m["fits"]]
    assert reserved and max(reserved) <= 210 * MiB
