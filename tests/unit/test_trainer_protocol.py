"""A trainer is one module and one registry line: a toy trainer declared here alone (a tiny
regression model, no diffusers model, no images) is driven by the runner's loop, which is not
edited for it: the shared code builds its optimizer, accumulates its micro-batches, writes and
resumes its checkpoints and writes its final model through ``save_final``.

In this process (tests/unit starts none): ``loop.train`` is what ``python -m oomguard.jobs.run``
calls once it has read the attempt.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from oomguard.jobs import trainers
from oomguard.jobs.attempt import METRICS, AttemptConfig, Control
from oomguard.jobs.loop import train
from oomguard.jobs.trainers.base import Trainer
from oomguard.strategies.plan import Plan
from tests.jobs_helpers import tiny_job

TOY = "toy"
FEATURES = 4
FINAL_FILE = "toy.pt"

# ---- the toy trainer's module ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToyInputs:
    x: torch.Tensor
    y: torch.Tensor

    @property
    def size(self) -> int:
        return self.x.shape[0]


class ToyTrainer:
    """Regress y = x @ w on a fixed w; the batch of a step is a function of (seed, step)."""

    def __init__(self, job) -> None:
        self.job = job

    def build_model(self) -> torch.nn.Module:
        torch.manual_seed(self.job.train.seed)
        return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def zero_gradient_parameters(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        return []

    def step_inputs(self, step: int) -> ToyInputs:
        generator = torch.Generator().manual_seed(self.job.train.seed * 1000 + step)
        x = torch.randn((self.job.train.batch_size, FEATURES), generator=generator)
        return ToyInputs(x=x, y=x.sum(dim=1, keepdim=True))

    def slice_loss(self, model: torch.nn.Module, inputs: ToyInputs, start: int, stop: int, device: torch.device) -> torch.Tensor:
        prediction = model(inputs.x[start:stop].to(device))
        return F.mse_loss(prediction, inputs.y[start:stop].to(device))

    def place_frozen(self, plan, device, memory) -> None:
        pass

    def frozen_tensors(self) -> list[torch.Tensor]:
        return []

    def frozen_sizes(self) -> dict[str, int]:
        return {}

    def step_bucket(self, step: int) -> None:
        return None

    def heaviest_step(self) -> int:
        return 0

    def save_final(self, model: torch.nn.Module, directory: Path) -> None:
        directory.mkdir(parents=True)
        torch.save(model.state_dict(), directory / FINAL_FILE)


# ---- the registry line ----------------------------------------------------------------------


@pytest.fixture
def toy():
    with trainers.register(TOY, ToyTrainer):
        yield


def toy_job(max_steps: int):
    job = tiny_job("toy-job", batch_size=4, max_steps=max_steps, checkpoint_every_steps=2)
    return dataclasses.replace(job, trainer=TOY)


def run_attempt(tmp_path: Path, name: str, max_steps: int, micro_batch: int, workdir: Path | None = None):
    job = toy_job(max_steps)
    attempt_dir = tmp_path / name
    attempt_dir.mkdir()
    config = AttemptConfig(job=job, plan=Plan.initial(4, micro_batch=micro_batch), number=1, workdir=workdir or tmp_path / f"{name}-work")
    return train(config, attempt_dir, Control()), attempt_dir, config.workdir


def final_weights(workdir: Path) -> dict[str, torch.Tensor]:
    return torch.load(workdir / "final" / FINAL_FILE, weights_only=True)


def test_the_toy_trainer_satisfies_the_protocol():
    trainer: Trainer = ToyTrainer(toy_job(1))
    assert trainer.step_inputs(0).size == 4


def test_the_loop_drives_a_registered_trainer(toy, tmp_path):
    outcome, attempt_dir, workdir = run_attempt(tmp_path, "whole", max_steps=4, micro_batch=4)
    assert outcome.kind == "finished" and outcome.step == 4, outcome
    metrics = [json.loads(line) for line in (attempt_dir / METRICS).read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert (workdir / "checkpoints" / "step-000002").is_dir()
    assert set(final_weights(workdir)) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_micro_batches_and_a_resume_train_the_same_weights(toy, tmp_path):
    whole, _, whole_dir = run_attempt(tmp_path, "whole", max_steps=6, micro_batch=4)
    # Two steps in micro-batches of 1 (a checkpoint at step 2), then a second attempt in
    # micro-batches of 2 resumes from it.
    first, _, split_dir = run_attempt(tmp_path, "first", max_steps=3, micro_batch=1)
    assert first.kind == "finished" and (split_dir / "checkpoints" / "step-000002").is_dir()
    resumed, _, _ = run_attempt(tmp_path, "resumed", max_steps=6, micro_batch=2, workdir=split_dir)
    assert whole.kind == resumed.kind == "finished" and resumed.resumed_from == 2, resumed
    expected, got = final_weights(whole_dir), final_weights(split_dir)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6)


def test_an_unknown_trainer_is_refused():
    with pytest.raises(ValueError, match="unknown trainer 'toy'"):
        trainers.make_trainer(toy_job(1))


def test_a_trainer_name_is_registered_once(toy):
    with pytest.raises(ValueError, match="already"), trainers.register(TOY, ToyTrainer):
        pass
