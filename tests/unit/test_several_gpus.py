"""Jobs on several GPUs, without a process: the sharding rungs (one level at a time, only with 2
or more processes, never with the optimizers and adapters they cannot carry), their bytes per
rank, resources.gpus ranges, the doctor widening after an OOM and narrowing back, a command
job's {gpus} and sharding keys, and how the ranks' ends become the attempt's outcome."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomguard.jobs.command import render
from oomguard.jobs.ranks import RankEnd, attempt_outcome, rank_outcome_path
from oomguard.jobs.spec import parse_job_text
from oomguard.strategies import rungs
from oomguard.strategies.decision import NextPlan, PastAttempt
from oomguard.strategies.doctor import decide, narrowed
from oomguard.strategies.errors import JobFileError
from oomguard.strategies.memory_model import Measurement
from oomguard.strategies.outcome import MemoryFigures, Outcome
from oomguard.strategies.plan import Plan
from oomguard.strategies.policy import Policy
from oomguard.strategies.rungs import sharding
from oomguard.strategies.static_bytes import static_bytes
from tests.jobs_helpers import TINY_JOB

MiB = 2**20
SHARDING = ("shard_optimizer", "shard_params", "shard_offload")


def rung(name: str) -> rungs.Rung:
    found = rungs.rung(name)
    assert found is not None
    return found


# The rungs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SHARDING)
def test_a_sharding_rung_needs_two_processes_and_turns_the_other_levels_off(name: str) -> None:
    assert rung(name).step(Plan.initial(8)) is None
    two = Plan.initial(8, world_size=2)
    taken = rung(name).step(two)
    assert taken is not None and rungs.sharded(taken) and rungs.conflict(taken) is None
    assert [other for other in SHARDING if rung(other).is_on(taken)] == [name]
    assert rung(name).step(taken) is None  # nothing more to give


def test_deeper_levels_replace_shallower_ones_and_never_go_back() -> None:
    optimizer = rung("shard_optimizer").step(Plan.initial(8, world_size=2))
    assert optimizer is not None
    params = rung("shard_params").step(optimizer)
    assert params is not None and sharding.level(params) == "params" and not rung("shard_optimizer").is_on(params)
    assert rung("shard_optimizer").step(params) is None
    assert "replaced by sharding the parameters" in rung("shard_optimizer").describe(optimizer, params)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"offload": "optimizer"}, "host-offloaded optimizer"),
        ({"optimizer": "adamw8bit"}, "adamw8bit optimizer"),
        ({"lora_rank": 16}, "LoRA"),
    ],
)
def test_sharding_does_not_combine_with_what_it_cannot_carry(change: dict, words: str) -> None:
    sharded = rung("shard_params").step(Plan.initial(8, world_size=2))
    assert sharded is not None
    mixed = sharded.replace(**change)
    assert words in (rungs.conflict(mixed) or "")
    # Nor does the planner offer such a plan, nor a rung step into one.
    assert rung("shard_params").step(Plan.initial(8, world_size=2).replace(**change)) is None


def test_bytes_per_rank_of_each_level() -> None:
    full = 100.0
    plain = static_bytes(Plan.initial(8, world_size=2), full)
    assert (plain.parameters, plain.gradients, plain.optimizer_state) == (100, 100, 200)
    levels = {name: static_bytes(rung(name).step(Plan.initial(8, world_size=2)), full) for name in SHARDING}  # type: ignore[arg-type]
    # shard_optimizer: the whole model gathered for a step beside its half, and the unit being
    # gathered; half the gradients and state.
    unit = 100 * sharding.UNIT_SHARE
    assert (levels["shard_optimizer"].parameters, levels["shard_optimizer"].gradients, levels["shard_optimizer"].optimizer_state) == (150 + unit, 50, 100)
    assert levels["shard_params"].parameters == 50 + 2 * unit
    assert levels["shard_offload"].optimizer_state == 0 and levels["shard_offload"].parameters == 50 + 2 * unit
    totals = [plain.total, *(levels[name].total for name in SHARDING)]
    assert totals == sorted(totals, reverse=True)


# resources.gpus --------------------------------------------------------------------------------


def job(resources: str, extra: str = "") -> object:
    text = TINY_JOB.format(name="t", batch_size=8, max_steps=4, checkpoint_every_steps=2, keep_checkpoints=2) + extra
    return parse_job_text(text + f"[resources]\n{resources}\n", "<t.toml>", base_dir=Path.cwd())


def test_a_range_of_gpus_starts_on_the_least_and_may_widen_to_the_most() -> None:
    spec = job('gpus = "1-4"')
    assert (spec.resources.gpus, spec.resources.widest, spec.initial_plan().world_size) == (1, 4, 1)  # type: ignore[attr-defined]
    two = job("gpus = 2")
    assert two.initial_plan().world_size == 2 and "shard_params" in two.policy().allow  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("resources", "words"),
    [
        ('gpus = "4-1"', 'a range such as "1-4"'),
        ('gpus = "0-2"', 'a range such as "1-4"'),
        ("gpus = 3", "cannot be split evenly over 3 GPUs"),
    ],
)
def test_a_bad_number_of_gpus_is_refused_with_the_fix(resources: str, words: str) -> None:
    with pytest.raises(JobFileError, match="resources.gpus") as error:
        job(resources)
    assert words in str(error.value)


def test_a_job_with_an_average_of_its_weights_is_not_sharded() -> None:
    assert "shard_params" in job("gpus = 2").policy().allow  # type: ignore[attr-defined]
    text = TINY_JOB.format(name="t", batch_size=8, max_steps=4, checkpoint_every_steps=2, keep_checkpoints=2).replace("seed = 0", "seed = 0\nema = true")
    ema = parse_job_text(text + "[resources]\ngpus = 2\n", "<t.toml>", base_dir=Path.cwd())
    assert not any(name in ema.policy().allow for name in SHARDING)


# Widening and narrowing --------------------------------------------------------------------------


def oom(total: int) -> Outcome:
    memory = MemoryFigures(requested=MiB, allocated=total, reserved=total, free=0, total=total, breakdown={})
    return Outcome(kind="oom", step=0, phase="forward", memory=memory, message="CUDA out of memory.")


def state_dominated(plan: Plan) -> list[Measurement]:
    """What a run of ``plan`` on one GPU measured: 10 MiB of weights, gradients and AdamW state
    (2.5 MiB of parameters), 1 MiB of activations per 4 samples."""
    static = {"parameters": int(2.5 * MiB), "trainable": int(2.5 * MiB), "optimizer_state": 5 * MiB, "frozen": 0}
    return [Measurement(plan=plan, fits=False, peak_bytes=9 * MiB, capacity=9 * MiB, static=static, step=0)]


def test_with_gpus_free_the_doctor_widens_instead_of_stepping_down() -> None:
    start = Plan.initial(8)
    outcome = Outcome(**{**oom(9 * MiB).__dict__, "measurements": tuple(state_dominated(start))})
    history = [PastAttempt(start, outcome)]
    exact = ("micro_batch", "checkpointing", *SHARDING)
    alone = decide(outcome, start, history, Policy(allow=exact, initial=start))
    assert not isinstance(alone, NextPlan) or alone.plan.world_size == 1
    widened = decide(outcome, start, history, Policy(allow=exact, initial=start, widest=2))
    assert isinstance(widened, NextPlan) and widened.plan.world_size == 2 and widened.rung.startswith("widen+"), widened
    assert rungs.sharded(widened.plan)
    # Back onto one GPU: only a plan that fits there (here host offload).
    assert narrowed(widened.plan, history, Policy(allow=exact, initial=start), 1, 9 * MiB) is None
    back = narrowed(widened.plan, history, Policy(allow=(*exact, "offload"), initial=start), 1, 9 * MiB)
    assert back is not None and back.plan.world_size == 1 and back.plan.offload == "optimizer" and back.rung.startswith("narrow")


# Command jobs --------------------------------------------------------------------------------------


def test_a_command_job_gets_gpus_and_its_sharding_arguments() -> None:
    from oomguard.jobs.spec.command import CommandSpec

    command = CommandSpec(
        argv=("torchrun", "--nproc_per_node", "{gpus}", "train.py", "--batch={micro_batch}"),
        when=(("shard_params", ("--fsdp", "full_shard")),), processes=2,
    )
    plan = Plan.initial(8, world_size=2, even_slices=True)
    sharded = rung("shard_params").step(plan)
    assert sharded is not None
    assert render(command, plan, Path("/w"), 1, gpus=2)[0] == ["torchrun", "--nproc_per_node", "2", "train.py", "--batch=4"]
    assert render(command, sharded, Path("/w"), 1, gpus=2)[0][-2:] == ["--fsdp", "full_shard"]


# The ranks' ends ---------------------------------------------------------------------------------


def write(attempt: Path, rank: int, kind: str, message: str = "") -> None:
    path = rank_outcome_path(attempt, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"kind": kind, "message": message, "exit_code": 0}))


def test_ranks_that_agree_end_with_rank_0s_outcome(tmp_path: Path) -> None:
    write(tmp_path, 0, "finished", "rank 0")
    write(tmp_path, 1, "finished", "rank 1")
    ends = [RankEnd(1, 0, 1.0, torn_down=False), RankEnd(0, 0, 1.1, torn_down=False)]
    assert attempt_outcome(tmp_path, ends)["message"] == "rank 0"


def test_the_rank_that_ended_the_attempt_decides_not_the_collective_that_failed_after_it(tmp_path: Path) -> None:
    write(tmp_path, 1, "oom", "CUDA out of memory on rank 1")
    write(tmp_path, 0, "crashed", "RuntimeError: Connection closed by peer")
    # Seen in the same poll: the OOM is what ended it, the crash its consequence.
    outcome = attempt_outcome(tmp_path, [RankEnd(0, 1, 2.0, torn_down=False), RankEnd(1, 3, 2.0, torn_down=False)])
    assert outcome["kind"] == "oom" and outcome["message"].startswith("CUDA out of memory on rank 1 (rank 1 ended it; rank 0 then ended: crashed)")


def test_a_rank_that_died_without_an_outcome_is_a_crash_and_the_others_were_stopped(tmp_path: Path) -> None:
    outcome = attempt_outcome(tmp_path, [RankEnd(1, -9, 1.0, torn_down=False), RankEnd(0, -9, 6.0, torn_down=True)])
    assert outcome["kind"] == "crashed" and "rank 1 of 2 was killed by signal 9 without an outcome" in outcome["message"]
    assert "rank 0 stopped 5 s after the first end" in outcome["message"]


def test_on_several_processes_a_one_size_line_is_read_optimistically_for_the_probe() -> None:
    """A shape measured at one micro-batch: its slope rests on rough terms. On several processes
    the probe's question "could a larger micro-batch fit?" reads the excess as fixed cost (under
    sharding a larger micro-batch measured lower); on one process it stays a slope."""
    from oomguard.strategies.memory_model import MemoryModel

    # 2 MiB of weights, gradients and AdamW state; 2.6 MiB more at micro-batch 1.
    static = {"parameters": MiB // 2, "trainable": MiB // 2, "optimizer_state": MiB, "frozen": 0}
    for width, could in ((2, True), (1, False)):
        shape = Plan.initial(8, world_size=width, micro_batch=1)
        model = MemoryModel([Measurement(plan=shape, fits=True, peak_bytes=int(4.6 * MiB), capacity=5 * MiB, samples_per_s=20.0, static=static)])
        larger = shape.replace(micro_batch=8 // width)
        assert model.fits(larger, 5 * MiB) is False
        assert model.fits(larger, 5 * MiB, optimistic=True) is could, width
