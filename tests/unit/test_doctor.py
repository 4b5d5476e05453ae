import dataclasses
import json
import time

import pytest

from oomguard.strategies.doctor import decide, describe_oom, report
from oomguard.strategies.decision import GiveUp, NextPlan, PastAttempt, Retry, Wait
from oomguard.strategies.memory_model import Measurement
from oomguard.strategies.oom_judge import is_fragmentation
from oomguard.strategies.outcome import (
    EXIT_CRASHED,
    EXIT_DIVERGED,
    EXIT_FINISHED,
    EXIT_INTERRUPTED,
    EXIT_OOM,
    EXIT_USAGE,
    MemoryFigures,
    Outcome,
    exception_line,
)
from oomguard.strategies.plan import EXPANDABLE_SEGMENTS, Plan
from oomguard.strategies.rungs.checkpoint_grades import with_grade
from oomguard.strategies.policy import Policy
from oomguard.strategies.rungs import exact_names, names, usable_by
from oomguard.strategies.units import format_bytes

# The rungs a job of the unconditional trainer can take (the frozen-part rungs are a
# text-to-image job's: JobSpec.features).
UNCONDITIONAL = frozenset({"full_model"})
RUNG_NAMES, EXACT_RUNG_NAMES = usable_by(UNCONDITIONAL), usable_by(UNCONDITIONAL, exact_names())

MiB = 2**20
KiB = 1024
START = Plan.initial(16)


def oom(step=5, phase="backward", requested=64 * MiB, allocated=900 * MiB, reserved=None, breakdown=None, total=1024 * MiB):
    """An OOM; ``reserved`` defaults to a little above ``allocated`` (no fragmentation)."""
    reserved = allocated + 2 * MiB if reserved is None else reserved
    memory = MemoryFigures(requested=requested, allocated=allocated, reserved=reserved, free=0, total=total, breakdown=breakdown or {})
    return Outcome(kind="oom", step=step, phase=phase, memory=memory, message="CUDA out of memory.")


def fragmented(**kwargs):
    return oom(requested=64 * MiB, allocated=700 * MiB, reserved=900 * MiB, **kwargs)


def crash(message="RuntimeError: boom", kind="crashed", step=3):
    return Outcome(kind=kind, step=step, message=message, traceback_tail="Traceback ...\n" + message)


def run_ladder(outcome_for, plan=START, policy=Policy(), limit=50):
    """Let every attempt end with ``outcome_for(plan)`` and follow the doctor until it stops
    taking rungs. Returns the history and every decision."""
    history, decisions = [], []
    for _ in range(limit):
        outcome = outcome_for(plan)
        history.append(PastAttempt(plan, outcome))
        decision = decide(outcome, plan, history, policy)
        decisions.append(decision)
        if not isinstance(decision, NextPlan):
            return history, decisions
        plan = decision.plan
    raise AssertionError("the doctor did not stop")


# Diagnosis ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("memory", "expected"),
    [
        (None, False),
        (MemoryFigures(), False),
        (MemoryFigures(requested=None, allocated=1, reserved=100), False),
        (MemoryFigures(requested=10, allocated=None, reserved=100), False),
        (MemoryFigures(requested=10, allocated=100, reserved=None), False),
        # unallocated (reserved - allocated) compared with the request
        (MemoryFigures(requested=10, allocated=100, reserved=109), False),
        (MemoryFigures(requested=10, allocated=100, reserved=110), True),
        (MemoryFigures(requested=10, allocated=100, reserved=500), True),
        (MemoryFigures(requested=10, allocated=100, reserved=100), False),
        # nothing unallocated is never fragmentation, even for an empty request
        (MemoryFigures(requested=0, allocated=100, reserved=100), False),
        (MemoryFigures(requested=0, allocated=100, reserved=101), True),
        (MemoryFigures(requested=64 * MiB, allocated=700 * MiB, reserved=900 * MiB), True),
        (MemoryFigures(requested=512 * MiB, allocated=700 * MiB, reserved=900 * MiB), False),
        # the allocator retried during the attempt: half the request unallocated is enough
        (MemoryFigures(requested=300 * MiB, allocated=700 * MiB, reserved=900 * MiB, alloc_retries=3), True),
        (MemoryFigures(requested=300 * MiB, allocated=700 * MiB, reserved=900 * MiB, alloc_retries=0), False),
        (MemoryFigures(requested=512 * MiB, allocated=700 * MiB, reserved=900 * MiB, alloc_retries=3), False),
        (MemoryFigures(requested=300 * MiB, allocated=700 * MiB, reserved=700 * MiB, alloc_retries=9), False),
    ],
)
def test_is_fragmentation(memory, expected):
    assert is_fragmentation(memory) is expected


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [
        (Outcome(kind="oom", step=7, phase="backward"), "out of memory in backward at step 7"),
        (Outcome(kind="oom", step=0), "out of memory at step 0"),
        (
            oom(step=12, phase="forward", requested=64 * MiB, allocated=900 * MiB, total=1024 * MiB),
            "out of memory in forward at step 12: tried to allocate 64.0 MiB with 900.0 MiB of 1.00 GiB in use",
        ),
        (
            oom(step=3, phase="optimizer", breakdown={"parameters": 100 * MiB, "optimizer_state": 200 * MiB, "activations": 50 * MiB}),
            "out of memory in optimizer at step 3: tried to allocate 64.0 MiB with 900.0 MiB of 1.00 GiB in use;"
            " largest consumer: optimizer_state (200.0 MiB)",
        ),
        (
            Outcome(kind="oom", step=1, phase="data", memory=MemoryFigures(breakdown={"activations": 3 * MiB // 2})),
            "out of memory in data at step 1: tried to allocate ? with ? of ? in use; largest consumer: activations (1.5 MiB)",
        ),
    ],
)
def test_describe_oom(outcome, expected):
    text = describe_oom(outcome)
    assert text == expected
    assert "  " not in text


@pytest.mark.parametrize(("n", "expected"), [(None, "?"), (0, "0.0 KiB"), (96 * 1024, "96.0 KiB"), (MiB, "1.0 MiB"), (1536 * 1024, "1.5 MiB"), (1023 * MiB, "1023.0 MiB"), (24 * 1024 * MiB, "24.00 GiB")])
def test_format_bytes(n, expected):
    assert format_bytes(n) == expected


# Taking rungs ---------------------------------------------------------------------------------


def test_fragmentation_takes_the_allocator_rung_first():
    outcome = fragmented()
    decision = decide(outcome, START, [PastAttempt(START, outcome)], Policy())
    assert isinstance(decision, NextPlan)
    assert decision.rung == "allocator"
    assert decision.plan == START.replace(allocator=EXPANDABLE_SEGMENTS)
    assert "fragmentation" in decision.reason
    assert "200.0 MiB reserved but unallocated" in decision.reason
    assert "expandable segments" in decision.reason


def test_fragmentation_by_the_retries_says_so_and_an_ooms_own_flush_is_no_evidence():
    """Half the request unallocated counts when the allocator flushed its cache to fit earlier
    requests. c10 counts the flush of a malloc that then ran out as a retry too, so every OOM
    is one: only retries beyond the OOMs (num_alloc_retries - num_ooms) are evidence."""
    from oomguard.jobs.memory_cap import retries_that_fitted

    assert retries_that_fitted({"num_alloc_retries": 1, "num_ooms": 1}) == 0
    assert retries_that_fitted({"num_alloc_retries": 5, "num_ooms": 2}) == 3
    assert retries_that_fitted({}) is None
    half = MemoryFigures(requested=192 * KiB, allocated=900 * MiB, reserved=900 * MiB + 150 * KiB, free=0, total=1024 * MiB)
    assert not is_fragmentation(dataclasses.replace(half, alloc_retries=0))
    outcome = Outcome(kind="oom", step=5, phase="forward", memory=dataclasses.replace(half, alloc_retries=3), message="CUDA out of memory.")
    decision = decide(outcome, START, [PastAttempt(START, outcome)], Policy())
    assert isinstance(decision, NextPlan) and decision.rung == "allocator"
    assert "150.0 KiB reserved but unallocated is at least half the request, and the allocator flushed its cache 3 time(s)" in decision.reason
    assert "at least the request" not in decision.reason


@pytest.mark.parametrize(
    ("plan", "allow", "rung", "expected"),
    [
        # allocator not allowed: the next rung
        (START, ("micro_batch", "checkpointing"), "micro_batch", START.replace(micro_batch=8)),
        # allocator already set: the next rung
        (START.replace(allocator=EXPANDABLE_SEGMENTS), EXACT_RUNG_NAMES, "micro_batch", START.replace(allocator=EXPANDABLE_SEGMENTS, micro_batch=8)),
        (START, ("allocator",), "allocator", START.replace(allocator=EXPANDABLE_SEGMENTS)),
        (START, ("checkpointing", "allocator"), "allocator", START.replace(allocator=EXPANDABLE_SEGMENTS)),
    ],
)
def test_fragmentation_respects_the_policy_and_the_plan(plan, allow, rung, expected):
    outcome = fragmented()
    decision = decide(outcome, plan, [PastAttempt(plan, outcome)], Policy(allow=allow))
    assert isinstance(decision, NextPlan)
    assert (decision.rung, decision.plan) == (rung, expected)


@pytest.mark.parametrize(
    ("plan", "allow", "rung", "expected"),
    [
        (START, EXACT_RUNG_NAMES, "micro_batch", START.replace(micro_batch=8)),
        # without fragmentation the allocator is not the cure, even when allowed
        (START, ("allocator", "micro_batch"), "micro_batch", START.replace(micro_batch=8)),
        # The cheapest checkpointing grade a UNet2DModel job has (no feed-forward layers) first.
        (START.replace(micro_batch=1), EXACT_RUNG_NAMES, "checkpoint_alternate", with_grade(START.replace(micro_batch=1), "alternate")),
        (START, ("checkpointing",), "checkpointing", START.replace(gradient_checkpointing=True)),
        (START, ("allocator", "checkpointing"), "checkpointing", START.replace(gradient_checkpointing=True)),
        (Plan(batch_size=10, micro_batch=5), EXACT_RUNG_NAMES, "micro_batch", Plan(batch_size=10, micro_batch=3)),
        (
            START.replace(allocator=EXPANDABLE_SEGMENTS, micro_batch=2),
            EXACT_RUNG_NAMES,
            "micro_batch",
            START.replace(allocator=EXPANDABLE_SEGMENTS, micro_batch=1),
        ),
    ],
)
def test_plain_oom_takes_the_cheapest_allowed_rung(plan, allow, rung, expected):
    outcome = oom(breakdown={"activations": 500 * MiB, "parameters": 10 * MiB})
    decision = decide(outcome, plan, [PastAttempt(plan, outcome)], Policy(allow=allow))
    assert isinstance(decision, NextPlan)
    assert (decision.rung, decision.plan) == (rung, expected)
    assert decision.reason.startswith(describe_oom(outcome) + " -> ")
    assert "largest consumer: activations" in decision.reason


def test_the_whole_ladder_then_give_up_with_a_report():
    history, decisions = run_ladder(lambda plan: oom(step=4))
    assert [d.rung for d in decisions[:-1]] == ["micro_batch"] * 4 + ["checkpoint_alternate", "checkpointing", "attention", "activation_offload", "offload"]
    assert [p.plan.short() for p in history] == [
        "mb=16x1", "mb=8x2", "mb=4x4", "mb=2x8", "mb=1x16", "mb=1x16 ckpt=1/2", "mb=1x16 ckpt", "mb=1x16 ckpt attn=sliced",
        "mb=1x16 ckpt attn=sliced acts=host", "mb=1x16 ckpt attn=sliced acts=host offload=optimizer",
    ]
    give_up = decisions[-1]
    assert isinstance(give_up, GiveUp)
    assert "no allowed rung is left" in give_up.reason
    lines = give_up.report.splitlines()
    assert lines[0] == "Attempts:"
    for number, past in enumerate(history, start=1):
        assert f"  {number}. [{past.plan.short()}] oom at step 4 (out of memory in backward at step 4" in lines[number]
    assert len({p.plan for p in history}) == len(history), "no plan is run twice"


def test_fragmentation_every_time_walks_allocator_then_the_rest():
    history, decisions = run_ladder(lambda plan: fragmented())
    assert [d.rung for d in decisions[:-1]] == ["allocator"] + ["micro_batch"] * 4 + ["checkpoint_alternate", "checkpointing", "attention", "activation_offload", "offload"]
    assert all(p.plan.allocator == EXPANDABLE_SEGMENTS for p in history[1:])
    assert isinstance(decisions[-1], GiveUp)


@pytest.mark.parametrize(
    ("allow", "rungs"),
    [
        ((), []),
        (("micro_batch",), ["micro_batch"] * 4),
        (("checkpointing",), ["checkpointing"]),
        (("allocator",), []),
        (("attention", "offload", "precision", "lora"), ["attention", "offload", "precision", "lora"]),
        (("lora", "checkpointing", "precision"), ["checkpointing", "precision", "lora"]),
        (("base_quantization",), []),  # only under LoRA
        (("lora", "base_quantization"), ["lora", "base_quantization", "base_quantization"]),
    ],
)
def test_rungs_not_allowed_are_skipped(allow, rungs):
    history, decisions = run_ladder(lambda plan: oom(), policy=Policy(allow=allow))
    assert [d.rung for d in decisions[:-1]] == rungs
    assert isinstance(decisions[-1], GiveUp)
    for decision in decisions[:-1]:
        assert decision.rung in allow


@pytest.mark.parametrize(
    ("plan", "failed_before", "expected"),
    [
        # 8 ran out earlier (e.g. before the doctor stepped back up): straight to 4
        (START, [START.replace(micro_batch=8)], START.replace(micro_batch=4)),
        (START, [START.replace(micro_batch=8), START.replace(micro_batch=4)], START.replace(micro_batch=2)),
        # micro_batch has nothing left that did not fail: the next rung
        (
            START.replace(micro_batch=2),
            [START.replace(micro_batch=1)],
            with_grade(START.replace(micro_batch=2), "alternate"),
        ),
    ],
)
def test_a_plan_that_ran_out_of_memory_is_never_proposed_again(plan, failed_before, expected):
    history = [PastAttempt(p, oom()) for p in failed_before]
    outcome = oom()
    history.append(PastAttempt(plan, outcome))
    decision = decide(outcome, plan, history, Policy())
    assert isinstance(decision, NextPlan)
    assert decision.plan == expected


def test_a_plan_that_only_crashed_may_be_proposed_again():
    crashed_plan = START.replace(micro_batch=8)
    history = [PastAttempt(crashed_plan, crash()), PastAttempt(START, oom())]
    decision = decide(history[-1].outcome, START, history, Policy())
    assert isinstance(decision, NextPlan) and decision.plan == crashed_plan


def test_fragmentation_skips_an_allocator_plan_that_already_failed():
    with_allocator = START.replace(allocator=EXPANDABLE_SEGMENTS)
    history = [PastAttempt(with_allocator, oom()), PastAttempt(START, fragmented())]
    decision = decide(fragmented(), START, history, Policy())
    assert isinstance(decision, NextPlan)
    assert (decision.rung, decision.plan) == ("micro_batch", START.replace(micro_batch=8))


@pytest.mark.parametrize("seed", range(8))
def test_never_proposes_a_plan_that_ran_out_of_memory(seed):
    """Whatever mix of outcomes came before, the proposed plan is new among the OOMed ones."""
    import random

    rng = random.Random(seed)
    plan = START
    history = []
    for _ in range(11):
        outcome = fragmented() if rng.random() < 0.3 else oom()
        history.append(PastAttempt(plan, outcome))
        decision = decide(outcome, plan, history, Policy(max_attempts=100))
        if not isinstance(decision, NextPlan):
            assert isinstance(decision, GiveUp)
            break
        assert decision.plan not in {p.plan for p in history if p.outcome.kind == "oom"}
        # sometimes start over from a bigger plan, as stepping back up would
        plan = decision.plan if rng.random() < 0.7 else decision.plan.replace(micro_batch=16)


# Crashes, interruptions, divergence, limits ---------------------------------------------------


@pytest.mark.parametrize("kind", ["crashed", "host_oom"])
@pytest.mark.parametrize("crash_retries", [0, 1, 2, 3])
def test_crash_retries_are_bounded(kind, crash_retries):
    policy = Policy(crash_retries=crash_retries)
    history, decisions = [], []
    for step in range(crash_retries + 3):
        outcome = crash(kind=kind, step=step)  # each at another step: a passing trouble, not a bug that repeats
        history.append(PastAttempt(START, outcome))
        decisions.append(decide(outcome, START, history, policy))
        if isinstance(decisions[-1], GiveUp):
            break
    assert [type(d) for d in decisions] == [Retry] * crash_retries + [GiveUp]
    for number, decision in enumerate(decisions[:-1], start=1):
        assert f"retry {number} of {crash_retries}" in decision.reason
        assert "RuntimeError: boom" in decision.reason
    ended = "crashed" if kind == "crashed" else "ran out of host memory"
    assert f"the attempt {ended} {crash_retries + 1} times in a row" in decisions[-1].reason
    assert decisions[-1].report.startswith("Attempts:")


def test_default_crash_retries_are_retry_retry_give_up():
    history, decisions = [], []
    for step in range(3):
        history.append(PastAttempt(START, crash(step=step)))
        decisions.append(decide(history[-1].outcome, START, history, Policy()))
    assert [type(d) for d in decisions] == [Retry, Retry, GiveUp]


@pytest.mark.parametrize(
    "between",
    [
        pytest.param(lambda: PastAttempt(START, Outcome(kind="interrupted", step=3)), id="interruption"),
        pytest.param(lambda: PastAttempt(START.replace(micro_batch=8), crash()), id="other-plan"),
        pytest.param(lambda: PastAttempt(START, oom()), id="oom"),
    ],
)
def test_the_crash_streak_resets(between):
    history = [PastAttempt(START, crash()), PastAttempt(START, crash()), between(), PastAttempt(START, crash())]
    decision = decide(history[-1].outcome, START, history, Policy())
    assert isinstance(decision, Retry)
    assert "retry 1 of 2" in decision.reason


def test_crash_without_a_message():
    outcome = crash(message="  ")
    decision = decide(outcome, START, [PastAttempt(START, outcome)], Policy())
    assert isinstance(decision, Retry)
    assert "(no message)" in decision.reason


@pytest.mark.parametrize("times", [1, 5, 20])
def test_interrupted_is_retried(times):
    history = []
    for _ in range(times):
        outcome = Outcome(kind="interrupted", step=10, message="stopped on request")
        history.append(PastAttempt(START, outcome))
        decision = decide(outcome, START, history, Policy(max_attempts=100))
        assert isinstance(decision, Retry)
        assert "interrupted" in decision.reason


def test_diverged_under_the_jobs_own_numerics_gives_up():
    outcome = Outcome(kind="diverged", step=42, phase="forward", message="loss is nan at step 42")
    decision = decide(outcome, START, [PastAttempt(START, outcome)], Policy())
    assert isinstance(decision, GiveUp)
    assert decision.reason == (
        "the loss diverged at step 42 under [mb=16x1] (loss is nan at step 42); the job's own settings diverge: look at its learning rate and data"
    )
    assert "1. [mb=16x1] diverged at step 42 (loss is nan at step 42)" in decision.report


DIVERGED = Outcome(kind="diverged", step=12, phase="forward", message="loss is nan at step 12")
WITH_PRECISION = Policy(allow=("micro_batch", "precision", "optimizer_8bit"), initial=START)


def test_a_divergence_after_the_precision_rung_marks_it_unsafe_and_goes_back_to_full_precision():
    # An exact plan that never ran out of memory: back to it.
    bf16 = START.replace(mixed_precision="bf16")
    history = [PastAttempt(bf16, DIVERGED)]
    decision = decide(DIVERGED, bf16, history, WITH_PRECISION)
    assert isinstance(decision, NextPlan) and decision.plan == START and decision.rung == "undo:precision"
    assert decision.reason.startswith("the loss diverged at step 12 under [mb=16x1 bf16] (loss is nan at step 12); precision marked unsafe")
    assert decision.reason.endswith("-> back to [mb=16x1], from the newest checkpoint whose weights are finite")


def test_after_a_divergence_the_unsafe_rung_is_never_taken_again():
    # The job ran out of memory at mb=1 in fp32, took precision, diverged: the ladder goes on
    # from that OOM without precision (the 8-bit optimizer), and a later OOM never offers it.
    tight = START.replace(micro_batch=1)
    bf16 = tight.replace(mixed_precision="bf16")
    history = [PastAttempt(tight, oom(total=1024 * MiB)), PastAttempt(bf16, DIVERGED)]
    decision = decide(DIVERGED, bf16, history, WITH_PRECISION)
    assert isinstance(decision, NextPlan) and decision.plan.mixed_precision == "no" and decision.plan.optimizer == "adamw8bit"
    assert "precision marked unsafe for this job" in decision.reason and "8-bit" in decision.reason
    history.append(PastAttempt(decision.plan, oom(total=1024 * MiB)))
    later = decide(history[-1].outcome, decision.plan, history, WITH_PRECISION)
    assert not (isinstance(later, NextPlan) and later.plan.mixed_precision != "no")
    if isinstance(later, GiveUp):
        assert "precision" not in later.reason.split("would, with")[-1]


@pytest.mark.parametrize("kind", ["finished", "cancelled"])
def test_no_decision_after_a_normal_end(kind):
    with pytest.raises(ValueError, match=kind):
        decide(Outcome(kind=kind), START, [PastAttempt(START, Outcome(kind=kind))], Policy())


@pytest.mark.parametrize(
    "outcome",
    [oom(), fragmented(), crash(), Outcome(kind="diverged")],
    ids=lambda o: o.kind,
)
@pytest.mark.parametrize("max_attempts", [1, 3])
def test_max_attempts_bounds_everything(outcome, max_attempts):
    history = [PastAttempt(START, oom())] * (max_attempts - 1) + [PastAttempt(START, outcome)]
    decision = decide(outcome, START, history, Policy(max_attempts=max_attempts))
    assert isinstance(decision, GiveUp)
    assert f"{max_attempts} attempts made, the job's limit (ladder.max_attempts) is {max_attempts}" == decision.reason
    assert len(decision.report.splitlines()) >= 1 + max_attempts


def test_max_attempts_ends_a_long_ladder():
    history, decisions = run_ladder(lambda plan: oom(), policy=Policy(max_attempts=3))
    assert len(history) == 3
    assert [type(d) for d in decisions] == [NextPlan, NextPlan, GiveUp]
    assert "ladder.max_attempts" in decisions[-1].reason


# The report -------------------------------------------------------------------------------


def test_report_suggests_the_ladder_allow_line_with_rungs_that_could_help():
    history, decisions = run_ladder(lambda plan: oom(), policy=Policy(allow=("micro_batch",)))
    text = decisions[-1].report
    assert "Rungs this job does not allow: allocator, checkpoint_alternate, checkpointing, attention, activation_offload, fused_backward, offload, precision," in text
    suggestion = [line for line in text.splitlines() if "[ladder]" in line]
    assert len(suggestion) == 1
    allow = json.loads(suggestion[0].split("allow = ", 1)[1])
    assert allow[0] == "micro_batch"
    assert "checkpointing" in allow and "lora" in allow


def test_report_when_every_rung_was_allowed():
    history, decisions = run_ladder(lambda plan: oom(), policy=Policy(allow=RUNG_NAMES))
    text = decisions[-1].report
    assert "does not allow" not in text and "[ladder]" not in text
    assert "not available" not in text


def test_report_lists_every_kind_of_attempt():
    history = [
        PastAttempt(START, oom(step=2)),
        PastAttempt(START.replace(micro_batch=8), crash(message="Traceback\nValueError: first\nRuntimeError: last line", step=3)),
        PastAttempt(START.replace(micro_batch=8), Outcome(kind="interrupted", step=9)),
        PastAttempt(START.replace(micro_batch=8), Outcome(kind="crashed", step=9, message=" \n ")),
        PastAttempt(START.replace(micro_batch=8), Outcome(kind="host_oom", step=11, message="killed by the kernel")),
    ]
    lines = report(history, Policy()).splitlines()
    assert lines[1].startswith("  1. [mb=16x1] oom at step 2 (out of memory in backward at step 2: ")
    assert lines[2] == "  2. [mb=8x2] crashed at step 3 (RuntimeError: last line)"
    assert lines[3] == "  3. [mb=8x2] interrupted at step 9"
    assert lines[4] == "  4. [mb=8x2] crashed at step 9"
    assert lines[5] == "  5. [mb=8x2] host_oom at step 11 (killed by the kernel)"


# Outcome ----------------------------------------------------------------------------------

OUTCOMES = [
    Outcome(kind="finished", step=100),
    Outcome(kind="interrupted", step=7, resumed_from=5, exit_code=EXIT_INTERRUPTED),
    crash(),
    oom(breakdown={"activations": 3 * MiB, "parameters": MiB}),
    Outcome(kind="oom", step=1, phase="checkpoint", memory=MemoryFigures(requested=10)),
    Outcome(kind="diverged", step=3, phase="forward", message="loss is inf", exit_code=EXIT_DIVERGED, resumed_from=0),
]


@pytest.mark.parametrize("outcome", OUTCOMES, ids=lambda o: o.kind)
def test_outcome_round_trip(outcome):
    assert Outcome.from_dict(outcome.to_dict()) == outcome
    # ... through JSON, as outcome.json and the store keep it
    assert Outcome.from_dict(json.loads(json.dumps(outcome.to_dict()))) == outcome


def test_outcome_memory_round_trips_as_memory_figures():
    outcome = Outcome.from_dict(json.loads(json.dumps(oom(breakdown={"activations": 3}).to_dict())))
    assert isinstance(outcome.memory, MemoryFigures)
    assert outcome.memory.dominant_consumer() == "activations"
    assert outcome.memory.reserved_unallocated == 2 * MiB


@pytest.mark.parametrize(
    ("returncode", "kind", "words"),
    [
        (-9, "crashed", "killed by SIGKILL"),
        (-15, "crashed", "killed by SIGTERM"),
        (-11, "crashed", "killed by SIGSEGV"),
        (-6, "crashed", "killed by SIGABRT"),
        (-200, "crashed", "killed by 200"),
        (EXIT_FINISHED, "finished", "exited with code 0"),
        (EXIT_CRASHED, "crashed", "exited with code 1"),
        (EXIT_USAGE, "crashed", "exited with code 2"),
        (EXIT_OOM, "oom", "exited with code 3"),
        (EXIT_DIVERGED, "diverged", "exited with code 4"),
        (EXIT_INTERRUPTED, "interrupted", "exited with code 75"),
        (137, "crashed", "exited with code 137"),
    ],
)
def test_outcome_from_exit_status(returncode, kind, words):
    outcome = Outcome.from_exit_status(returncode)
    assert outcome.kind == kind
    assert outcome.exit_code == returncode
    assert words in outcome.message
    assert Outcome.from_dict(outcome.to_dict()) == outcome


@pytest.mark.parametrize(
    ("breakdown", "dominant"),
    [({}, None), ({"activations": 1}, "activations"), ({"parameters": 5, "activations": 4, "optimizer_state": 6}, "optimizer_state")],
)
def test_dominant_consumer(breakdown, dominant):
    assert MemoryFigures(breakdown=breakdown).dominant_consumer() == dominant


def test_outcome_from_dict_ignores_keys_it_does_not_know():
    data = oom(breakdown={"activations": 3}).to_dict()
    data["written_by_a_newer_runner"] = 1
    data["memory"]["num_alloc_retries"] = 4
    assert Outcome.from_dict(data) == oom(breakdown={"activations": 3})


def test_an_oom_before_training_does_not_shrink_activations():
    """The model itself did not fit: smaller micro-batches or checkpointing cannot help;
    moving the optimizer state off the device can."""
    outcome = oom(step=0, phase="setup")
    decision = decide(outcome, START, [PastAttempt(START, outcome)], Policy())
    assert isinstance(decision, NextPlan) and decision.rung == "offload"
    assert "do not fit before training starts" in decision.reason
    decision = decide(outcome, START, [PastAttempt(START, outcome)], Policy(allow=("micro_batch", "checkpointing", "attention")))
    assert isinstance(decision, GiveUp)


def test_a_fragmented_oom_in_setup_still_takes_the_allocator():
    outcome = fragmented(step=0, phase="setup")
    decision = decide(outcome, START, [PastAttempt(START, outcome)], Policy())
    assert isinstance(decision, NextPlan) and decision.rung == "allocator"


@pytest.mark.parametrize(
    ("dominant", "allow", "rung"),
    [
        ("activations", EXACT_RUNG_NAMES, "micro_batch"),
        ("optimizer_state", EXACT_RUNG_NAMES, "offload"),
        # exact rungs first: the 8-bit optimizer only once no exact rung is left
        ("optimizer_state", ("micro_batch", "optimizer_8bit"), "micro_batch"),
        ("optimizer_state", ("precision", "optimizer_8bit", "lora"), "optimizer_8bit"),
        ("parameters", ("precision", "optimizer_8bit", "lora", "base_quantization"), "lora"),
        ("gradients", ("precision", "lora"), "lora"),
    ],
)
def test_without_numbers_the_rungs_for_the_dominant_consumer_come_first(dominant, allow, rung):
    breakdown = {"activations": 10 * MiB, "optimizer_state": 10 * MiB, "parameters": 10 * MiB, "gradients": 10 * MiB, dominant: 500 * MiB}
    outcome = oom(breakdown=breakdown)
    decision = decide(outcome, START, [PastAttempt(START, outcome)], Policy(allow=allow))
    assert isinstance(decision, NextPlan) and decision.rung == rung, decision
    assert f"largest consumer: {dominant}" in decision.reason


def test_interruptions_do_not_use_up_attempts():
    history = [PastAttempt(START, Outcome(kind="interrupted"))] * 5
    decision = decide(Outcome(kind="interrupted"), START, history, Policy(max_attempts=2))
    assert isinstance(decision, Retry)


# Contention: a neighbour grew while the job did not -------------------------------------


def steady(plan: Plan, peak: int) -> Measurement:
    return Measurement(plan=plan, fits=True, peak_bytes=peak, capacity=64 * MiB, samples_per_s=10.0)


def neighbour_oom(before: int, at_oom: int, allocated: int, requested: int, capacity: int, peak: int | None = 30 * MiB) -> Outcome:
    memory = MemoryFigures(
        requested=requested, allocated=allocated, reserved=allocated, free=capacity - allocated, total=capacity,
        others_before=before, others_at_oom=at_oom,
    )
    measurements = (steady(START, peak),) if peak is not None else ()
    return Outcome(kind="oom", step=7, phase="forward", memory=memory, measurements=measurements)


def test_a_neighbours_spike_means_wait_and_the_same_plan():
    outcome = neighbour_oom(before=0, at_oom=40 * MiB, allocated=20 * MiB, requested=8 * MiB, capacity=24 * MiB)
    decision = decide(outcome, START, [PastAttempt(START, outcome)], Policy())
    assert isinstance(decision, Wait)
    assert decision.free_bytes == int(30 * MiB * 1.03)  # the plan's steady peak with the margin of a plan that ran
    assert "contention" in decision.reason and "no rung" in decision.reason


def test_growth_of_our_own_is_not_contention():
    # Others grew a little, but the job asked for far more than it ever used: an ordinary OOM.
    outcome = neighbour_oom(before=0, at_oom=2 * MiB, allocated=60 * MiB, requested=20 * MiB, capacity=62 * MiB)
    assert not isinstance(decide(outcome, START, [PastAttempt(START, outcome)], Policy()), Wait)


def test_noise_is_not_contention():
    outcome = neighbour_oom(before=10 * MiB, at_oom=10 * MiB + 1000, allocated=50 * MiB, requested=8 * MiB, capacity=54 * MiB)
    assert not isinstance(decide(outcome, START, [PastAttempt(START, outcome)], Policy()), Wait)


def test_contention_without_a_steady_peak_uses_the_room_before():
    # The first step of an attempt: no steady peak yet, but what it needed fitted before the neighbour grew.
    outcome = neighbour_oom(before=0, at_oom=30 * MiB, allocated=20 * MiB, requested=10 * MiB, capacity=34 * MiB, peak=None)
    assert isinstance(decide(outcome, START, [PastAttempt(START, outcome)], Policy()), Wait)


def test_contention_neither_uses_up_attempts_nor_bans_the_plan():
    spike = neighbour_oom(before=0, at_oom=40 * MiB, allocated=20 * MiB, requested=8 * MiB, capacity=24 * MiB)
    history = [PastAttempt(START, spike)] * 5
    assert isinstance(decide(spike, START, history, Policy(max_attempts=3)), Wait)
    # A later ordinary OOM of a smaller plan may go back to START: the neighbour's OOM did not ban it.
    smaller = START.replace(micro_batch=8)
    ordinary = oom()
    decision = decide(ordinary, smaller, [*history, PastAttempt(smaller, ordinary)], Policy(initial=START))
    assert isinstance(decision, NextPlan) and decision.plan != smaller


def test_contention_is_bounded():
    spike = neighbour_oom(before=0, at_oom=40 * MiB, allocated=20 * MiB, requested=8 * MiB, capacity=24 * MiB)
    history = [PastAttempt(START, spike)] * 21
    decision = decide(spike, START, history, Policy(max_waits=20))
    assert isinstance(decision, GiveUp) and "21 times in a row" in decision.reason


def test_a_job_at_the_edge_waits_for_the_room_it_had_not_more():
    # Its steady peak is 63 MiB of a 64 MiB card: 3 % more than that is more than the card; it
    # waits for the 64 MiB it had before the neighbour came.
    outcome = neighbour_oom(before=0, at_oom=40 * MiB, allocated=20 * MiB, requested=4 * MiB, capacity=24 * MiB, peak=63 * MiB)
    decision = decide(outcome, START, [PastAttempt(START, outcome)], Policy())
    assert isinstance(decision, Wait) and decision.free_bytes == 64 * MiB


def test_when_nothing_fits_without_the_unsafe_rung_the_job_ends_without_suggesting_it():
    tight = START.replace(micro_batch=1)
    bf16 = tight.replace(mixed_precision="bf16")
    history = [PastAttempt(tight, oom(total=1024 * MiB)), PastAttempt(bf16, DIVERGED)]
    decision = decide(DIVERGED, bf16, history, Policy(allow=("micro_batch", "precision"), initial=START))
    assert isinstance(decision, GiveUp)
    assert decision.reason.startswith("the loss diverged at step 12 under [mb=1x16 bf16]") and "precision marked unsafe" in decision.reason
    assert "Rungs marked unsafe for this job (its loss diverged under them): precision." in decision.report
    suggestion = decision.reason.split("would, with")[-1] + decision.report.split("[ladder] allow = [")[-1]
    assert '"precision"' not in suggestion and "precision (not allowed)" not in suggestion


def test_crash_retries_back_off_so_that_a_passing_trouble_does_not_use_them_all():
    history, waits = [], []
    for step in range(4):
        history.append(PastAttempt(START, crash(step=step)))
        decision = decide(history[-1].outcome, START, history, Policy(crash_retries=4))
        assert isinstance(decision, Retry)
        waits.append(decision.after_seconds)
    assert waits == [5.0, 15.0, 45.0, 135.0]
    assert decision.reason.endswith("retry 4 of 4 with the same plan in 135 s")
    interrupted = Outcome(kind="interrupted", step=3, message="stopped")
    assert decide(interrupted, START, [PastAttempt(START, interrupted)], Policy()).after_seconds == 0.0


def test_a_decision_at_the_largest_batch_with_every_rung_allowed_takes_about_a_second():
    # The planner weighs each shape at ~2*sqrt(batch) micro-batch sizes, not at all of them:
    # at 4096 that was 10**5 plans and minutes of the daemon's loop; it is 1.2 s on 2 cores.
    start = Plan.initial(4096)
    static = {"parameters": 50 * MiB, "trainable": 50 * MiB, "optimizer_state": 100 * MiB}
    measured = tuple(
        Measurement(plan=start.replace(micro_batch=size), fits=True, peak_bytes=peak, capacity=1024 * MiB, samples_per_s=10.0, static=static)
        for size, peak in ((1024, 300 * MiB), (512, 250 * MiB))
    )
    outcome = dataclasses.replace(oom(), measurements=measured)
    began = time.perf_counter()
    decision = decide(outcome, start, [PastAttempt(start, outcome)], Policy(allow=tuple(RUNG_NAMES), initial=start))
    assert time.perf_counter() - began < 15
    assert isinstance(decision, NextPlan) and decision.plan.micro_batch == 2048


# What an attempt died of: its exception line --------------------------------------------------

MISSING_CSV = "FileNotFoundError: [Errno 2] No such file or directory: 'x.csv'"
TRACEBACK = f"""Traceback (most recent call last):
  File "/home/alice/train.py", line 3, in <module>
    data = open("x.csv")
           ^^^^^^^^^^^^^
{MISSING_CSV}
"""
CANNOT_OPEN = "/usr/bin/python3: can't open file '/home/alice/project/trian.py': [Errno 2] No such file or directory"


@pytest.mark.parametrize(
    ("text", "line"),
    [
        pytest.param(TRACEBACK, MISSING_CSV, id="traceback"),
        pytest.param("epoch 1\n" + TRACEBACK + "wandb: Synced 3 files\n\n", MISSING_CSV, id="noise-after-it"),
        pytest.param(
            "Traceback (most recent call last):\n  File \"t.py\", line 1\nValueError: first\n\nDuring handling of the above exception, "
            "another exception occurred:\n\nTraceback (most recent call last):\n  File \"t.py\", line 4\nRuntimeError: second\n",
            "RuntimeError: second", id="chained-the-last",
        ),
        pytest.param("Traceback (most recent call last):\n  File \"t.py\", line 1\nValueError: one line\nand another\n", "ValueError: one line", id="two-line-message"),
        pytest.param("Traceback (most recent call last):\n  File \"t.py\", line 1\nmypackage.Unusual: its name says no Error\n", "mypackage.Unusual: its name says no Error", id="any-name-after-a-traceback"),
        pytest.param(CANNOT_OPEN + "\n", CANNOT_OPEN, id="python-cannot-open-the-script"),
        pytest.param(
            "usage: train.py [-h] [--lr LR]\ntrain.py: error: unrecognized arguments: --train_batch_sise=4\n",
            "train.py: error: unrecognized arguments: --train_batch_sise=4", id="argparse-refuses-the-arguments",
        ),
        pytest.param(
            # accelerate launch re-reports its child's failure: the child's line is the cause.
            CANNOT_OPEN + "\nTraceback (most recent call last):\n  File \"/v/bin/accelerate\", line 8, in <module>\n    sys.exit(main())\n"
            "subprocess.CalledProcessError: Command '['/usr/bin/python3', 'trian.py']' returned non-zero exit status 2.\n",
            CANNOT_OPEN, id="under-accelerate-launch",
        ),
        pytest.param(
            "[rank0]: Traceback (most recent call last):\n[rank0]:   File \"t.py\", line 9\n[rank0]: KeyError: 'label'\n"
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n============\nt.py FAILED\n",
            "KeyError: 'label'", id="under-torchrun",
        ),
        pytest.param("KeyError: 'a'", "KeyError: 'a'", id="a-runner-message"),
        pytest.param("UserWarning: this is only a warning\nthe runner exited with code 1 without writing outcome.json", None, id="no-error"),
        pytest.param("", None, id="empty"),
    ],
)
def test_exception_line(text, line):
    assert exception_line(text) == line


def test_a_crash_is_summed_up_by_its_exception_line_and_anything_else_by_its_message():
    command = Outcome(kind="crashed", message="the runner exited with code 1 without writing outcome.json", traceback_tail="step 1\n" + TRACEBACK)
    assert command.summary == MISSING_CSV
    runner = Outcome(kind="crashed", message=MISSING_CSV, traceback_tail=TRACEBACK)
    assert runner.summary == MISSING_CSV
    killed = Outcome.from_exit_status(-9)
    assert killed.summary == "the runner was killed by SIGKILL before it could report"
    diverged = Outcome(kind="diverged", message="loss is nan at step 3\nmore")
    assert diverged.summary == "loss is nan at step 3"
    assert Outcome(kind="crashed", message=" \n ").summary == ""


# A crash that repeats itself is the script's, not the machine's ---------------------------------


def test_the_same_crash_twice_at_the_same_step_ends_the_job_with_the_error_and_what_to_do():
    history, decisions = [], []
    for _ in range(2):
        history.append(PastAttempt(START, crash(message=MISSING_CSV, step=0)))
        decisions.append(decide(history[-1].outcome, START, history, Policy(crash_retries=5)))
    assert [type(d) for d in decisions] == [Retry, GiveUp]
    give_up = decisions[-1]
    assert MISSING_CSV in give_up.reason and "twice in a row at step 0" in give_up.reason
    assert give_up.next_step.startswith("fix the script and resubmit")
    assert "allow" not in give_up.report and "[ladder]" not in give_up.report


@pytest.mark.parametrize(
    "second",
    [
        pytest.param(crash(message=MISSING_CSV, step=4), id="another-step"),
        pytest.param(crash(message="KeyError: 'label'", step=0), id="another-error"),
        pytest.param(crash(message=MISSING_CSV, step=0, kind="host_oom"), id="host-memory"),
        # A machine's trouble (a full disk) may pass: it keeps its backed-off retries.
        pytest.param(crash(message="OSError: [Errno 28] No space left on device", step=0), id="full-disk"),
    ],
)
def test_a_crash_that_is_not_the_same_again_is_retried(second):
    first = crash(message=second.message if "Errno 28" in second.message else MISSING_CSV, step=0)
    history = [PastAttempt(START, first), PastAttempt(START, second)]
    assert isinstance(decide(second, START, history, Policy()), Retry)


def test_the_same_crash_under_another_plan_is_retried():
    history = [PastAttempt(START.replace(micro_batch=8), crash(step=0)), PastAttempt(START, crash(step=0))]
    assert isinstance(decide(history[-1].outcome, START, history, Policy()), Retry)


def test_crashes_without_an_exception_line_use_their_retries():
    history, decisions = [], []
    for _ in range(3):
        history.append(PastAttempt(START, Outcome.from_exit_status(-9)))
        decisions.append(decide(history[-1].outcome, START, history, Policy()))
    assert [type(d) for d in decisions] == [Retry, Retry, GiveUp]


# Ladder advice is for jobs that ran out of memory -------------------------------------------------


LADDER_ADVICE = ("Rungs this job does not allow", "[ladder] allow", "allow the rungs")


def advice_in(decision: GiveUp) -> list[str]:
    text = "\n".join((decision.reason, decision.report, decision.next_step))
    return [words for words in LADDER_ADVICE if words in text]


@pytest.mark.parametrize(
    ("last", "advised"),
    [
        pytest.param(oom(), True, id="oom"),
        pytest.param(Outcome(kind="host_oom", step=3, message="the kernel's OOM killer ended a process"), True, id="host_oom"),
        pytest.param(crash(), False, id="crashed"),
        pytest.param(DIVERGED, False, id="diverged"),
    ],
)
def test_ladder_advice_only_when_the_job_ran_out_of_memory(last, advised):
    history = [PastAttempt(START, oom())] * 2 + [PastAttempt(START, last)]
    decision = decide(last, START, history, Policy(allow=("micro_batch",), max_attempts=3))
    assert isinstance(decision, GiveUp)
    assert bool(advice_in(decision)) == advised, (decision.report, decision.next_step)


def test_a_crash_that_used_its_retries_gives_no_ladder_advice():
    history, decision = [], None
    for step in range(3):
        history.append(PastAttempt(START, crash(step=step)))
        decision = decide(history[-1].outcome, START, history, Policy(allow=("micro_batch",)))
    assert isinstance(decision, GiveUp) and advice_in(decision) == []
    assert decision.next_step.startswith("fix the script and resubmit")


# A command job whose script takes its micro-batch from this argument.
TAKES_BATCH = Policy(micro_batch_argument="--train_batch_size={micro_batch}")


def two_ooms(requested_then, requested_now, policy=TAKES_BATCH, measured=()):
    """The first plan ran out of memory, the doctor halved its micro-batch, and that ran out too."""
    first = decide(oom(requested=requested_then, phase=None), START, [PastAttempt(START, oom(requested=requested_then, phase=None))], policy)
    assert isinstance(first, NextPlan) and first.plan.micro_batch < START.micro_batch
    now = dataclasses.replace(oom(requested=requested_now, phase=None), measurements=tuple(measured))
    history = [PastAttempt(START, oom(requested=requested_then, phase=None)), PastAttempt(first.plan, now)]
    return first.plan, decide(now, first.plan, history, policy)


def test_the_same_allocation_failing_at_half_the_micro_batch_stops_a_command_job_and_names_the_argument():
    _, decision = two_ooms(64 * MiB, 64 * MiB)
    assert isinstance(decision, GiveUp)
    assert "the same 64.0 MiB allocation failed with 8 samples as with 16" in decision.reason
    assert "does not honour {micro_batch}, which the job passes as '--train_batch_size={micro_batch}'" in decision.reason
    assert "--train_batch_size={micro_batch}" in decision.next_step
    assert "allow" not in decision.report  # no rung is suggested: none would be judged on the batch it claims


def test_a_smaller_failed_allocation_after_halving_is_the_script_following_its_plan():
    plan, decision = two_ooms(64 * MiB, 32 * MiB)
    assert isinstance(decision, NextPlan) and decision.plan.micro_batch < plan.micro_batch


def test_the_built_in_trainer_is_never_suspected_of_ignoring_its_micro_batch():
    _, decision = two_ooms(64 * MiB, 64 * MiB, policy=Policy())
    assert isinstance(decision, NextPlan)


def test_a_step_peak_that_did_not_move_with_half_the_micro_batch_stops_a_command_job():
    half = START.replace(micro_batch=8)
    steady = [Measurement(plan=START, fits=True, peak_bytes=800 * MiB), Measurement(plan=half, fits=True, peak_bytes=790 * MiB)]
    before = dataclasses.replace(oom(requested=64 * MiB, phase=None), measurements=(steady[0],))
    now = dataclasses.replace(oom(requested=48 * MiB, phase=None), measurements=(steady[1],))
    decision = decide(now, half, [PastAttempt(START, before), PastAttempt(half, now)], TAKES_BATCH)
    assert isinstance(decision, GiveUp) and "a step took 790.0 MiB with 8 samples and 800.0 MiB with 16" in decision.reason
    moved = dataclasses.replace(now, measurements=(dataclasses.replace(steady[1], peak_bytes=500 * MiB),))
    assert isinstance(decide(moved, half, [PastAttempt(START, before), PastAttempt(half, moved)], TAKES_BATCH), NextPlan)


def test_a_plan_that_may_fit_only_without_the_full_margin_is_tried_before_giving_up():
    # Peaks 125 and 105 MiB at micro-batches 4 and 2: 85 + 10 per sample. Micro-batch 1, at 95
    # MiB of 100, misses the 8 % margin of a fitted line but not the 3 % of a plan that ran.
    start = Plan.initial(4)
    static = {"parameters": 20 * MiB, "trainable": 20 * MiB, "optimizer_state": 40 * MiB}
    measured = tuple(
        Measurement(plan=start.replace(micro_batch=size), fits=True, peak_bytes=peak * MiB, capacity=200 * MiB, samples_per_s=10.0, static=static)
        for size, peak in ((4, 125), (2, 105))
    )
    outcome = dataclasses.replace(oom(total=100 * MiB, allocated=90 * MiB, requested=20 * MiB), measurements=measured)
    decision = decide(outcome, start, [PastAttempt(start, outcome)], Policy(allow=("micro_batch",), initial=start))
    assert isinstance(decision, NextPlan) and decision.plan.micro_batch == 1
    assert "the closest plan to fitting" in decision.reason
    # It fails at most once: then the job gives up.
    history = [PastAttempt(start, outcome), PastAttempt(decision.plan, outcome)]
    assert isinstance(decide(outcome, decision.plan, history, Policy(allow=("micro_batch",), initial=start)), GiveUp)


def test_plans_the_probe_saw_run_out_in_setup_are_no_numbers_for_the_others():
    """The probe measured four plans, each out of memory while it was being built (the frozen
    parts and the model do not fit): no static bytes, so the model knows nothing of a plan
    that takes the frozen parts off the device. The doctor walks on to such a rung (it
    gave up with "no plan fits, even with every rung" before)."""
    start = Plan.initial(8)
    t2i = frozenset({"frozen_parts", "full_model", "fixed_crops"})
    policy = Policy(allow=usable_by(t2i, exact_names()), usable=usable_by(t2i), initial=start)
    probed = [start.replace(micro_batch=1), start.replace(micro_batch=1, gradient_checkpointing=True), start.replace(micro_batch=1, attention="sliced")]
    setup = oom(step=0, phase="setup", requested=2048, allocated=920 * 1024, reserved=920 * 1024, total=921 * 1024, breakdown={"frozen": 700 * 1024, "activations": 220 * 1024})
    measured = tuple(Measurement(plan=p, fits=False, peak_bytes=922 * 1024, capacity=921 * 1024) for p in probed)
    outcome = dataclasses.replace(setup, measurements=measured)
    decision = decide(outcome, start, [PastAttempt(start, outcome)], policy)
    assert isinstance(decision, NextPlan), decision
    assert decision.rung == "cache_text" and "do not fit before training starts" in decision.reason
