"""What a command job's script reported through the bootstrap, read back by the daemon."""

from __future__ import annotations

import json
from pathlib import Path

from oomguard.jobs.attempt import HEARTBEAT, METRICS
from oomguard.jobs.script_report import ScriptReport, read_script_report
from oomguard.strategies.plan import Plan

PLAN = Plan.initial(128, even_slices=True)


def step(number: int, peak: int, resident: int = 100, rate: float | None = 50.0) -> dict:
    return {"step": number, "max_steps": 18, "peak_bytes": peak, "resident_bytes": resident, "capacity_bytes": 1000, "samples_per_s": rate, "samples": number * 128}


def write(folder: Path, steps: list[dict], heartbeat: dict | None = None, tail: str = "") -> Path:
    (folder / METRICS).write_text("".join(json.dumps(s) + "\n" for s in steps) + tail)
    if heartbeat is not None:
        (folder / HEARTBEAT).write_text(json.dumps(heartbeat))
    return folder


def test_the_steps_of_a_resumed_script_give_its_step_and_a_steady_measurement(tmp_path: Path) -> None:
    # The first step of a process also creates optimizer state and times the start-up: left out.
    steps = [step(6, peak=900, rate=None), step(7, peak=500, resident=120), step(8, peak=510, rate=70.0)]
    report = read_script_report(write(tmp_path, steps, {"step": 8, "resumed_from": 5}, tail='{"step": 9, "peak'), PLAN)
    assert (report.step, report.resumed_from, report.steps_in_process, report.samples) == (8, 5, 3, 8 * 128)
    measured = report.measurement
    assert measured is not None and measured.fits and measured.plan == PLAN
    assert (measured.peak_bytes, measured.static, measured.samples_per_s, measured.capacity) == (510, {"resident": 120}, 60.0, 1000)


def test_a_script_that_reported_nothing_or_died_at_its_first_step(tmp_path: Path) -> None:
    assert read_script_report(tmp_path, PLAN) == ScriptReport()
    report = read_script_report(write(tmp_path, [step(1, peak=900)], {"resumed_from": None}), PLAN)
    assert report.step == 1 and report.measurement is None
    resumed_only = read_script_report(write(tmp_path, [], {"step": 5, "resumed_from": 5}), PLAN)
    assert resumed_only.step == 5 and resumed_only.resumed_from == 5


def test_the_end_state_says_plainly_whether_the_job_reached_its_target(tmp_path: Path) -> None:
    reached = ScriptReport(step=18, samples=2304, final_lr=0.0, expected_final_lr=0.0).end_state(18)
    assert reached.differences == []
    assert reached.describe() == "end state as planned: 18/18 optimizer steps, 2304 samples, final learning rate 0 as scheduled"
    late = ScriptReport(step=19, samples=2432, final_lr=9.4e-4, expected_final_lr=0.0).end_state(18)
    assert late.describe() == (
        "the end state differs from the target: it ended at optimizer step 19, not at the job's 18 ([train] max_steps); "
        "its final learning rate is 0.00094, where its first attempt's schedule ends at 0"
    )
    unseen = ScriptReport(step=18).end_state(18)
    assert unseen.differences == [] and "final learning rate not checked" in unseen.describe()
