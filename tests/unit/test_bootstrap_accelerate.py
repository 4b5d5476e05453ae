"""The bootstrap's corrections of what accelerate restores, as pure functions (the whole flow
runs in tests/e2e/test_script_resume.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from oomguard.jobs.command import BOOTSTRAP_DIR


@pytest.fixture(scope="module")
def bootstrap():
    sys.path.insert(0, str(BOOTSTRAP_DIR))
    try:
        import oomguard_accelerate
    finally:
        sys.path.remove(str(BOOTSTRAP_DIR))
    return oomguard_accelerate


@pytest.mark.parametrize(
    ("saved_counter", "saved_accumulation", "restored", "accumulation", "corrected"),
    [
        (5, 1, 5, 2, 10),  # 5 optimizer steps into the epoch: 10 micro-batches of the new split
        (12, 4, 12, 2, 6),
        (6, 2, 0, 2, 6),  # a rank other than 0: accelerate restored nothing (no random_states_1.pkl)
        (0, 1, 0, 4, 0),  # saved at the end of an epoch: accelerate had reset it
    ],
)
def test_the_accumulation_counter_counts_the_same_optimizer_steps_in_the_new_split(
    bootstrap, saved_counter: int, saved_accumulation: int, restored: int, accumulation: int, corrected: int
) -> None:
    accelerator = SimpleNamespace(step=restored, gradient_accumulation_steps=accumulation)
    bootstrap._correct_counter(accelerator, {"accelerate_step": saved_counter, "gradient_accumulation_steps": saved_accumulation})
    assert accelerator.step == corrected


def test_a_checkpoint_without_oomguard_json_is_read_by_its_diffusers_name_only(bootstrap, tmp_path: Path) -> None:
    assert bootstrap._step_of(tmp_path / "out" / "checkpoint-500") == 500
    assert bootstrap._step_of(str(tmp_path / "checkpoint-40") + "/") == 40
    assert bootstrap._step_of(tmp_path / "run2") is None and bootstrap._step_of(tmp_path / "checkpoint-final") is None
    assert bootstrap._read_sidecar(tmp_path) is None
