"""The checkpointing grades as Plan steps: one grade per plan, each rung going only deeper, the
planner seeing every grade once, the memory model knowing each grade's terms, the partial
grades the built-in trainers' only, and the feed-forward grade only where a model has them."""

from __future__ import annotations

from oomguard.jobs.spec.command import CommandSpec, exposed_rungs
from oomguard.strategies import planner, rungs
from oomguard.strategies.memory_model import Measurement, MemoryModel
from oomguard.strategies.plan import Plan
from oomguard.strategies.rungs import activation_offload, checkpoint_grades
from oomguard.strategies.rungs.checkpoint_grades import grade, with_grade

MiB = 2**20
BASE = Plan.initial(8)
GRADE_RUNGS = ("checkpoint_ff", "checkpoint_alternate", "checkpointing")


def test_each_grade_rung_goes_only_deeper_and_turns_the_others_off():
    ff = rungs.rung("checkpoint_ff").step(BASE)
    assert grade(ff) == "ff" and not ff.gradient_checkpointing and ff.extra == (("checkpointed_feed_forward", True),)
    alternate = rungs.rung("checkpoint_alternate").step(ff)
    assert grade(alternate) == "alternate" and alternate.extra == (("checkpointed_alternate_blocks", True),)
    blocks = rungs.rung("checkpointing").step(alternate)
    assert blocks == BASE.replace(gradient_checkpointing=True), "whole blocks is the plan field alone, as stored plans have it"
    for name in GRADE_RUNGS:
        assert rungs.rung(name).step(blocks) is None
    assert rungs.rung("checkpoint_ff").step(alternate) is None


def test_a_grade_and_back_is_the_plan_it_was():
    for name in checkpoint_grades.GRADES:
        assert with_grade(with_grade(BASE, name), "none") == BASE


def test_the_planner_sees_each_grade_once_with_and_without_offloaded_activations():
    allow = ("checkpoint_ff", "checkpoint_alternate", "checkpointing", "activation_offload")
    shapes = {(grade(p), p.extra_value(activation_offload.KNOB, False)) for p in planner.candidate_plans(BASE.replace(micro_batch=8), allow)}
    assert shapes == {(g, host) for g in checkpoint_grades.GRADES for host in (False, True)}


def test_every_grade_switches_in_process():
    assert not any(rungs.rung(name).needs_restart for name in (*GRADE_RUNGS, "activation_offload"))
    plans = planner.candidate_plans(BASE, ("checkpoint_ff", "checkpoint_alternate", "checkpointing"), restart=False)
    assert {grade(p) for p in plans} == set(checkpoint_grades.GRADES)


def test_labels_and_descriptions_name_the_grade():
    alternate = with_grade(BASE, "alternate")
    assert "ckpt=1/2" in alternate.short() and "ckpt" not in BASE.short()
    assert "ckpt=ff" in with_grade(BASE, "ff").short()
    assert with_grade(BASE, "blocks").short().endswith("ckpt")
    assert "every second block" in planner.describe_change(BASE, alternate)
    text = planner.describe_change(alternate, with_grade(BASE, "blocks"))
    assert "checkpointing every second block off (checkpointing every block)" in text and "gradient checkpointing" in text
    assert "acts=host" in activation_offload.step(BASE).short()


def test_the_memory_model_predicts_deeper_grades_lower_and_learns_a_grade_it_saw():
    measured = Measurement(plan=BASE.replace(micro_batch=4), fits=True, peak_bytes=40 * MiB, static={"parameters": 4 * MiB, "trainable": 4 * MiB, "optimizer_state": 8 * MiB})
    model = MemoryModel([measured])
    peaks = [model.predicted_peak(with_grade(BASE.replace(micro_batch=4), g)) for g in checkpoint_grades.GRADES]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4, peaks
    # A run of the alternate grade that saved less than its estimate: its own line, and the
    # factor observed (not the estimate) carried to its other micro-batches.
    alternate = with_grade(BASE, "alternate")
    ran = Measurement(plan=alternate.replace(micro_batch=4), fits=True, peak_bytes=36 * MiB, static=measured.static)
    learned = MemoryModel([measured, ran])
    assert learned.predicted_peak(alternate.replace(micro_batch=4)) == 36 * MiB
    assert learned.predicted_peak(alternate.replace(micro_batch=2)) > model.predicted_peak(alternate.replace(micro_batch=2))


def test_the_feed_forward_grade_is_only_for_models_with_feed_forward_layers():
    assert "checkpoint_ff" not in rungs.usable_by(frozenset({"full_model"}))
    assert "checkpoint_ff" in rungs.usable_by(frozenset({"full_model", "feed_forward"}))
    assert {"checkpoint_alternate", "checkpointing", "activation_offload"} <= set(rungs.usable_by(frozenset({"full_model"}), rungs.exact_names()))


def test_a_command_job_takes_whole_blocks_only():
    command = CommandSpec(argv=("train.py", "--train_batch_size={micro_batch}"), when=(("gradient_checkpointing", ("--gradient_checkpointing",)),))
    exposed = exposed_rungs(command)
    assert "checkpointing" in exposed
    assert not {"checkpoint_ff", "checkpoint_alternate", "activation_offload"} & set(exposed)
