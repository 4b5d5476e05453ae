"""A NaN after the precision rung: the runner reports the divergence, the doctor marks the rung
unsafe and goes back to full precision, and the next attempt resumes from the newest
checkpoint whose weights are finite (the NaN is injected: jobs/faults.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomguard.jobs.faults import INJECT_FAULT_ENV
from oomguard.strategies.doctor import decide
from oomguard.strategies.decision import NextPlan, PastAttempt
from oomguard.strategies.plan import Plan
from oomguard.strategies.policy import Policy
from tests.jobs_helpers import run_runner, tiny_job, write_attempt


def test_nan_weights_after_the_precision_rung_roll_back_to_the_last_finite_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = tiny_job(max_steps=8, checkpoint_every_steps=1, keep_checkpoints=3)
    full = Plan.initial(8)
    half = full.replace(mixed_precision="bf16")  # the precision rung, taken after an OOM
    workdir = tmp_path / "work"

    monkeypatch.setenv(INJECT_FAULT_ENV, "nan_under_reduced_precision@3")
    first = run_runner(write_attempt(tmp_path / "a1", job, workdir, plan=half))
    assert first.outcome.kind == "diverged", first
    assert first.outcome.step == 3 and "loss is nan" in first.outcome.message
    assert "fault injection: NaN weights after step 3 under bf16" in first.stdout

    decision = decide(first.outcome, half, [PastAttempt(half, first.outcome)], Policy(allow=("micro_batch", "precision"), initial=full))
    assert isinstance(decision, NextPlan) and decision.plan == full and decision.rung == "undo:precision"

    monkeypatch.delenv(INJECT_FAULT_ENV)
    second = run_runner(write_attempt(tmp_path / "a2", job, workdir, plan=decision.plan, number=2))
    assert "skipping checkpoint step-000003: its weights hold NaN or inf" in second.stdout, second
    assert second.outcome.kind == "finished" and second.outcome.resumed_from == 2 and second.outcome.step == 8
