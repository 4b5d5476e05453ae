"""torchao's quantized AdamW (jobs/optimizers.py): the 4-bit optimizer of the optimizer_4bit
rung, and the 8-bit one the optimizer_8bit rung takes where bitsandbytes does not import. Both
write and read torch AdamW's checkpoint format, so a run crosses either rung both ways."""

from __future__ import annotations

import copy

import pytest
import torch

from oomguard.jobs import checkpoints
from oomguard.jobs.optimizers import build_optimizer, device_state_tensors, load_portable_state_dict, portable_state_dict
from oomguard.jobs.quantized_optimizers import adamw8bit_class, torchao_adamw_class
from oomguard.strategies.outcome import EXIT_FINISHED, EXIT_OOM
from oomguard.strategies.plan import Plan
from tests.integration.test_adapters import tiny_unet
from tests.integration.test_optimizers import LR, WEIGHT_DECAY, NoDevice, loss_of, mlp, train, weights
from tests.jobs_helpers import load_final, run_runner, tiny_job, write_attempt

PLAIN = Plan.initial(2)
FOUR_BIT = PLAIN.replace(optimizer="adamw4bit")
EIGHT_BIT = PLAIN.replace(optimizer="adamw8bit")
OFFLOAD = PLAIN.replace(offload="optimizer")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def state_bytes(optimizer) -> int:
    return sum(t.untyped_storage().nbytes() for t in device_state_tensors(optimizer))


def assert_moments_close(state, saved, share):
    """Every moment of ``state`` within ``share`` of its tensor's largest value in ``saved``."""
    assert state["state"].keys() == saved["state"].keys()
    for index, moments in saved["state"].items():
        assert state["state"][index].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert state["state"][index]["step"].item() == moments["step"].item()
        for key in ("exp_avg", "exp_avg_sq"):
            got = state["state"][index][key]
            assert (got.dtype, got.shape) == (torch.float32, moments[key].shape)
            torch.testing.assert_close(got, moments[key], atol=share * moments[key].abs().max().item(), rtol=0)


def test_4bit_trains_a_unet_and_its_state_is_an_eighth_of_adamws():
    model = tiny_unet()
    optimizer = build_optimizer(FOUR_BIT, model, LR, WEIGHT_DECAY, NoDevice())
    initial = loss_of(model, 0).item()
    for _ in range(8):
        train(model, optimizer, 1)  # the same batch each time: its loss must fall
    assert loss_of(model, 0).item() < 0.8 * initial
    sizes = {}
    for plan in (PLAIN, EIGHT_BIT, FOUR_BIT):
        model = mlp()  # 64x100 weights: quantized by both libraries
        optimizer = build_optimizer(plan, model, LR, WEIGHT_DECAY, NoDevice())
        train(model, optimizer, 1)
        sizes[plan.optimizer] = state_bytes(optimizer)
    # codes (half a byte a value), a scale per 128 and a code map; the biases keep fp32 moments
    assert sizes["adamw4bit"] < 0.16 * sizes["adamw"] and sizes["adamw4bit"] < 0.6 * sizes["adamw8bit"]


def test_4bit_reads_the_learning_rate_a_scheduler_sets():
    model = mlp()
    optimizer = build_optimizer(FOUR_BIT, model, LR, WEIGHT_DECAY, NoDevice())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.0)
    before = weights(model)
    train(model, optimizer, 2, scheduler=scheduler)
    assert all(torch.equal(before[name], value) for name, value in weights(model).items())
    assert optimizer.param_groups[0]["lr"] == 0.0 and isinstance(optimizer.param_groups[0]["lr"], float)


def test_4bit_resumes_exactly_from_its_state_dict():
    plan = FOUR_BIT
    model = mlp()
    optimizer = build_optimizer(plan, model, LR, WEIGHT_DECAY, NoDevice())
    train(model, optimizer, 3)
    saved_model, saved_state = copy.deepcopy(model), copy.deepcopy(optimizer.state_dict())
    assert set(saved_state["torchao_adamw4bit_codes"]) == {0, 2}  # the weight matrices
    resumed = build_optimizer(plan, saved_model, LR, WEIGHT_DECAY, NoDevice())
    resumed.load_state_dict(saved_state)
    train(model, optimizer, 3, start=3)
    train(saved_model, resumed, 3, start=3)
    for name, value in weights(model).items():
        assert torch.equal(value, weights(saved_model)[name]), name


@pytest.mark.parametrize(
    ("first", "then"), [(PLAIN, FOUR_BIT), (FOUR_BIT, PLAIN), (EIGHT_BIT, FOUR_BIT), (FOUR_BIT, EIGHT_BIT), (OFFLOAD, FOUR_BIT), (FOUR_BIT, OFFLOAD)]
)
def test_a_checkpoint_crosses_the_4bit_rung_both_ways(first, then):
    model = mlp()
    optimizer = build_optimizer(first, model, LR, WEIGHT_DECAY, NoDevice())
    train(model, optimizer, 3)
    saved = portable_state_dict(optimizer)  # what a checkpoint keeps (jobs/train_state.py)
    continued = build_optimizer(then, model, LR, WEIGHT_DECAY, NoDevice())
    load_portable_state_dict(continued, copy.deepcopy(saved))
    if then.optimizer != "adamw":
        # quantized again on load: the two weight matrices' moments are codes
        assert [t.dtype for t in device_state_tensors(continued)].count(torch.uint8) == 4
    state = portable_state_dict(continued)
    assert state["param_groups"] == saved["param_groups"]
    # 4-bit block-wise codes: within a quarter of each tensor's largest moment (the second
    # moment's code map is linear in sixteenths of each block's largest value)
    assert_moments_close(state, saved, 0.25 if "adamw4bit" in (first.optimizer, then.optimizer) else 0.02)
    before = loss_of(model, 0).item()
    for _ in range(5):
        train(model, continued, 1)
    assert loss_of(model, 0).item() < before


def test_torchaos_8bit_writes_the_state_bitsandbytes_writes():
    made = {}
    for name, cls in (("bitsandbytes", adamw8bit_class()), ("torchao", torchao_adamw_class(8))):
        model = mlp()
        optimizer = cls(list(model.parameters()), lr=LR, weight_decay=WEIGHT_DECAY)
        train(model, optimizer, 3)
        made[name] = (model, optimizer, optimizer.state_dict())
    bnb, ao = made["bitsandbytes"][2], made["torchao"][2]
    assert bnb["param_groups"] == ao["param_groups"]
    assert set(ao) == {"state", "param_groups", "torchao_adamw8bit_codes"} and set(ao["torchao_adamw8bit_codes"]) == {0, 2}
    for index in bnb["state"]:
        for key, value in bnb["state"][index].items():
            assert (ao["state"][index][key].dtype, ao["state"][index][key].shape) == (value.dtype, value.shape), (index, key)
    # Either library's checkpoint resumes under the other (moments requantized: the codes of
    # one are not the other's).
    for source, target in (("bitsandbytes", "torchao"), ("torchao", "bitsandbytes")):
        model, optimizer, saved = made[target]
        optimizer.load_state_dict(copy.deepcopy(made[source][2]))
        assert_moments_close(optimizer.state_dict(), made[source][2], 0.02)


def test_the_8bit_rung_takes_torchaos_where_bitsandbytes_does_not_import(monkeypatch):
    from oomguard.jobs import quantized_optimizers as optimizers

    def missing() -> type:
        raise ImportError("No module named 'bitsandbytes'")

    monkeypatch.setattr(optimizers, "adamw8bit_class", missing)
    optimizers._bitsandbytes_adamw8bit_class.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=r"bitsandbytes did not import \(ImportError: No module named 'bitsandbytes'\): 8-bit AdamW uses torchao's"):
            optimizer = build_optimizer(EIGHT_BIT, mlp(), LR, WEIGHT_DECAY, NoDevice())
    finally:
        optimizers._bitsandbytes_adamw8bit_class.cache_clear()  # the next caller finds bitsandbytes again
    assert isinstance(optimizer, torchao_adamw_class(8))


def test_torchaos_state_is_counted_by_its_codes():
    model = mlp()
    optimizer = build_optimizer(FOUR_BIT, model, LR, WEIGHT_DECAY, NoDevice())
    train(model, optimizer, 1)
    tensors = device_state_tensors(optimizer)
    # weights: codes, scale and code map of each moment; biases: two fp32 moments; step: a scalar on the host
    assert [t.dtype for t in tensors].count(torch.uint8) == 4
    assert len(tensors) == 2 * 2 * 3 + 2 * 2 + 4


@pytest.mark.long  # 5 s: two runners
def test_the_runner_resumes_an_adamw_checkpoint_under_4bit_and_finishes(tmp_path):
    """The real runner, under the emulated device: an AdamW attempt runs out of memory at step
    3 (checkpoint), the next resumes it under the 4-bit plan and trains to the end."""
    job = tiny_job("four-bit", batch_size=4, max_steps=6, checkpoint_every_steps=2)
    start = Plan.initial(4)
    workdir = tmp_path / "work"
    first = run_runner(write_attempt(tmp_path / "attempt-1", job, workdir, cap="4GiB,1KiB@3", recover_in_process=False))
    assert first.returncode == EXIT_OOM, first
    assert checkpoints.verify(workdir / "checkpoints" / "step-000003").step == 3
    plan = start.replace(optimizer="adamw4bit")
    second = run_runner(write_attempt(tmp_path / "attempt-2", job, workdir, plan=plan, number=2, cap="4GiB"))
    assert second.returncode == EXIT_FINISHED, second
    assert second.outcome.resumed_from == 3 and second.outcome.step == 6
    assert [m["plan"] for m in second.metrics] == [plan.short()] * 3
    assert "starting fresh optimizer state" not in second.stdout + second.stderr
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in second.metrics)
    assert all(bool(torch.isfinite(t).all()) for t in load_final(workdir).values())


@pytest.mark.long  # 7 s: a process that imports diffusers
def test_the_gpu_checks_offload_case_runs_ours_and_says_why_torchaos_waits_for_a_gpu(tmp_path):
    """bench/gpu_check.py --cases offload, dry run: oomguard's offloaded optimizer timed on the
    CPU, torchao's CPUOffloadOptimizer skipped with its reason (it asserts CUDA or XPU)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
    done = subprocess.run([sys.executable, str(script), "--dry-run", "--cases", "offload", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu-dry-run-offload.json").read_text())["results"]
    assert rows[0]["optimizer"].startswith("oomguard") and rows[0]["step_s"] > 0
    assert rows[1]["optimizer"].startswith("torchao") and "CUDA" in rows[1]["skipped"]
    assert "| torchao CPUOffloadOptimizer | skipped" in (tmp_path / "gpu-dry-run-offload.md").read_text()
