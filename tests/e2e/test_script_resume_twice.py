"""The script of test_script_resume.py (like diffusers' train_unconditional.py, unchanged) under a
cap that drops twice: in the first attempt and again in the relaunch, at the job's optimizer
steps; each relaunch resumes from the newest checkpoint and the run ends where the
uninterrupted one ends. A file of its own so that it runs beside the other cases."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomguard.daemon.supervisor import COMMAND_SPLIT_KEEPS
from tests.e2e.conftest import oomguard
from tests.e2e.test_script_resume import DONE, Case, job_file, uninterrupted

pytestmark = pytest.mark.slow


def test_a_cap_that_drops_again_in_the_relaunch_is_met_at_the_jobs_step_and_recovered(tmp_path: Path, daemon_factory) -> None:
    # Two drops of the emulated device: after the job's 7th optimizer step (the first attempt,
    # 128 samples a micro-batch, meets it) and after its 13th, which only the relaunch (64 a
    # micro-batch, resumed from step 5) reaches; a smaller split fits the second. A schedule
    # that started again with each attempt would give the relaunch 64 MiB up to step 12.
    case = Case(("--checkpointing_steps=5",), 128, 18, "64MiB,420KiB@7,300KiB@13", 7, 5)
    daemon = daemon_factory("--emulate-device-memory", case.cap)
    oomguard("submit", str(job_file(tmp_path, case, tmp_path)), state_dir=daemon.state_dir, check=True)
    record = daemon.wait_job("1", timeout=300)
    assert record["state"] == "finished", (record["result"], record["report"])
    plans = [(a["plan"]["micro_batch"], a["outcome"]["kind"], a["outcome"]["step"], a["outcome"]["resumed_from"]) for a in record["attempts"]]
    assert plans[:2] == [(128, "oom", 7, None), (64, "oom", 13, 5)]
    assert len(plans) == 3 and plans[2][0] < 64 and plans[2][1:] == ("finished", 18, 10)
    # Each relaunch resumed from the script's newest checkpoint and ended where a run without
    # oomguard ends: 768 samples, 128 a step: 6 optimizer steps an epoch, 3 epochs (measured with
    # this script: its step peaks at 462 KiB with 128 samples a micro-batch, 339 KiB with 64).
    log = (Path(record["attempts"][-1]["directory"]) / "output.log").read_text()
    assert "Resuming from checkpoint checkpoint-10" in log
    assert "oomguard: the script sized its learning-rate schedule as cosine(" in log
    samples = case.steps * case.batch_size
    assert DONE.findall(log)[-1] == uninterrupted(tmp_path, case, tmp_path) == f"done: steps={case.steps} samples={samples} final_lr=0.000000000e+00"
    assert f"end state as planned: {case.steps}/{case.steps} optimizer steps, {samples} samples, final learning rate 0 as scheduled" in record["result"]
    assert COMMAND_SPLIT_KEEPS in record["result"]
