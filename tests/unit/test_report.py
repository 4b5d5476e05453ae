"""`oomguard report`: the series loaded from the store and the attempt directories, and the PNG."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from oomguard.daemon.report import load_report
from oomguard.daemon.report_data import ReportData
from oomguard.daemon.report_plot import draw_report
from oomguard.daemon.store import Store
from oomguard.strategies.memory_model import Measurement
from oomguard.strategies.outcome import MemoryFigures, Outcome
from oomguard.strategies.plan import Plan
from oomguard.strategies.errors import ReportError

T0 = 1_700_000_000.0
MiB = 2**20
WIDE = Plan(batch_size=8, micro_batch=8)  # "mb=8x1"
HALF = Plan(batch_size=8, micro_batch=4)  # "mb=4x2"
CKPT = HALF.replace(gradient_checkpointing=True)  # "mb=4x2 ckpt"


@pytest.fixture
def store(tmp_path: Path) -> Store:
    store = Store(tmp_path / "oomguard.db")
    yield store
    store.close()


def add_job(store: Store, tmp_path: Path, **fields: Any) -> int:
    job_id = store.add_job(
        name="faces", owner="alice", spec={"name": "faces"}, priority=0, workdir=str(tmp_path / "work"),
        plan=WIDE.to_dict(), spool_file=None, jobs_root=tmp_path / "jobs",
    )
    if fields:
        store.update_job(job_id, **fields)
    return job_id


def step_line(step: int, at: float, plan: Plan, peak_mib: float, rate: float, cap_mib: float | None = 48) -> str:
    return json.dumps({
        "step": step, "max_steps": 12, "loss": 0.5, "samples_per_s": rate, "peak_bytes": int(peak_mib * MiB),
        "capacity_bytes": int(cap_mib * MiB) if cap_mib is not None else None, "plan": plan.short(), "time": at,
    }) + "\n"


def add_attempt(store: Store, job_id: int, tmp_path: Path, number: int, plan: Plan, started: float, *, lines: list[str] = (),
                outcome: Outcome | None = None, ended: float | None = None, outcome_file: bool = True, tail: str = "") -> Path:
    directory = tmp_path / "work" / "attempts" / f"{number:03d}"
    directory.mkdir(parents=True)
    if lines or tail:
        (directory / "metrics.jsonl").write_text("".join(lines) + tail)
    if outcome is not None and outcome_file:
        (directory / "outcome.json").write_text(json.dumps(outcome.to_dict()))
    fields: dict[str, Any] = {"job_id": job_id, "number": number, "plan": json.dumps(plan.to_dict()), "directory": str(directory), "pid": 4000 + number, "started_at": started}
    if ended is not None:
        fields.update(ended_at=ended, outcome_kind=outcome.kind if outcome else "crashed", outcome=json.dumps(outcome.to_dict()) if outcome else None)
    store.add_attempt(**fields)
    return directory


def add_event(store: Store, job_id: int, at: float, kind: str, message: str) -> None:
    store.db["events"].insert({"job_id": job_id, "at": at, "kind": kind, "message": message})


def load(store: Store, job_id: int) -> ReportData:
    return load_report(store.job(job_id), store.attempts(job_id), store.events(job_id))


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", header[16:24])


def oom_then_finish(store: Store, tmp_path: Path) -> int:
    """Attempt 1 runs mb=8x1, recovers in its process to mb=4x2 at step 6 and then runs out of
    memory in the optimizer at step 9; the daemon takes the checkpointing rung; attempt 2
    resumes from step 5 under mb=4x2 ckpt and finishes."""
    job_id = add_job(store, tmp_path, state="finished", result="finished 12 steps; final model in /work/final")
    lines = [step_line(s, T0 + s, WIDE, 30 + s, 10.0 + s) for s in range(1, 7)]
    lines += [step_line(s, T0 + s + 0.5, HALF, 40, 8.0) for s in range(7, 10)]
    recovery = {"step": 6, "from": WIDE.to_dict(), "to": HALF.to_dict(), "reason": "in-process -> [mb=4x2] peak ~40 MiB of 48 MiB"}
    first = Outcome(
        kind="oom", step=9, phase="optimizer",
        memory=MemoryFigures(requested=6 * MiB, allocated=45 * MiB, reserved=46 * MiB, total=48 * MiB, free=2 * MiB),
        plan=HALF,
        measurements=(
            Measurement(plan=WIDE, fits=False, peak_bytes=52 * MiB, capacity=48 * MiB, step=6),
            Measurement(plan=HALF, fits=False, peak_bytes=51 * MiB, capacity=48 * MiB, step=9),
            Measurement(plan=WIDE, fits=True, peak_bytes=36 * MiB, capacity=48 * MiB, samples_per_s=14.0),
        ),
        recoveries=(recovery,),
    )
    add_attempt(store, job_id, tmp_path, 1, WIDE, T0, lines=lines, outcome=first, ended=T0 + 10)
    add_event(store, job_id, T0, "started", "attempt 1 started with plan [mb=8x1], resuming from step 0 (no checkpoint yet)")
    add_event(store, job_id, T0 + 6.6, "escalated", "at step 6, in the runner: [mb=8x1] -> [mb=4x2]: in-process -> [mb=4x2]")
    add_event(store, job_id, T0 + 10.1, "attempt-ended", "attempt 1 (started at step 0) ended: oom at step 9 in optimizer")
    add_event(store, job_id, T0 + 10.2, "escalated", "rung checkpointing: activations dominate (30 of 45 MiB)")
    second = [step_line(s, T0 + 12 + s, CKPT, 33, r) for s, r in zip(range(6, 13), (5.0, 6.0, 6.5, 7.0, 6.0, 6.2, 6.4))]
    add_attempt(store, job_id, tmp_path, 2, CKPT, T0 + 12, lines=second, outcome=Outcome(kind="finished", step=12, resumed_from=5), ended=T0 + 26)
    add_event(store, job_id, T0 + 26.1, "finished", "finished 12 steps")
    return job_id


def test_an_oom_then_a_finish_loads_every_series_and_marker(store: Store, tmp_path: Path) -> None:
    data = load(store, oom_then_finish(store, tmp_path))
    assert data.title == "job 1 'faces'  ·  alice  ·  finished"
    assert data.origin == T0
    one, two = data.attempts
    assert (len(one.points), len(two.points)) == (9, 7)
    assert one.plans == ("mb=8x1", "mb=4x2") and two.plans == ("mb=4x2 ckpt",)
    assert one.label == "attempt 1 [mb=8x1 -> mb=4x2] oom" and two.label == "attempt 2 [mb=4x2 ckpt] finished"
    assert data.notes == ()
    # The in-process OOM at the time of step 6, and the attempt's own at its end, both at the cap.
    assert [(o.attempt, o.kind, o.step, o.time, o.bytes) for o in data.ooms] == [
        (1, "in-process", 6, T0 + 6, 48 * MiB),
        (1, "ended", 9, T0 + 10, 48 * MiB),
    ]
    assert data.ooms[1].label == "OOM @9 optimizer, +6.0 MiB"
    # The runner's rung once (its event duplicates outcome.json), the daemon's at its event.
    assert [(r.source, r.attempt, r.time, r.label) for r in data.rungs] == [
        ("runner", 1, T0 + 6, "in-process -> [mb=4x2]"),
        ("daemon", 1, T0 + 10.2, "rung checkpointing -> [mb=4x2 ckpt]"),
    ]
    assert [(r.plan, r.median_samples_per_s, r.steps, r.attempts) for r in data.rates] == [
        ("mb=8x1", 13.5, 6, (1,)),
        ("mb=4x2", 8.0, 3, (1,)),
        ("mb=4x2 ckpt", 6.2, 7, (2,)),
    ]


def test_the_png_is_written_at_the_promised_size(store: Store, tmp_path: Path) -> None:
    data = load(store, oom_then_finish(store, tmp_path))
    out = draw_report(data, tmp_path / "out" / "report.png")
    assert out == tmp_path / "out" / "report.png"
    assert png_size(out) == (1400, 900)
    assert [p.name for p in out.parent.iterdir()] == ["report.png"]  # no temporary left behind


def test_an_attempt_without_metrics_is_named_in_the_figure(store: Store, tmp_path: Path) -> None:
    job_id = oom_then_finish(store, tmp_path)
    store.update_job(job_id, state="failed")
    crash = Outcome(kind="crashed", step=12, message="ImportError", exit_code=1)
    add_attempt(store, job_id, tmp_path, 3, CKPT, T0 + 30, outcome=crash, ended=T0 + 31)
    data = load(store, job_id)
    assert data.attempts[2].points == ()
    assert data.notes == ("attempt 3: no metrics: it ended (crashed (step 12)) before its first step", "attempt 3 crashed: ImportError")
    assert png_size(draw_report(data, tmp_path / "r.png")) == (1400, 900)


def test_a_truncated_last_line_is_skipped_and_counted(store: Store, tmp_path: Path) -> None:
    job_id = add_job(store, tmp_path, state="running")
    lines = [step_line(s, T0 + s, WIDE, 20, 9.0) for s in range(1, 4)]
    add_attempt(store, job_id, tmp_path, 1, WIDE, T0, lines=lines, tail=step_line(4, T0 + 4, WIDE, 20, 9.0)[:37])
    data = load(store, job_id)
    (attempt,) = data.attempts
    assert [p.step for p in attempt.points] == [1, 2, 3]
    assert attempt.skipped_lines == 1 and attempt.ended_at is None and attempt.end == T0 + 3
    assert attempt.label == "attempt 1 [mb=8x1] running"
    assert data.notes == ("attempt 1: 1 unreadable metrics line skipped",)
    assert png_size(draw_report(data, tmp_path / "r.png")) == (1400, 900)


def test_a_running_attempt_uses_its_heartbeat_and_events_fill_what_no_file_holds(store: Store, tmp_path: Path) -> None:
    job_id = add_job(store, tmp_path, state="running")
    lines = [step_line(s, T0 + s, WIDE, 40, 9.0) for s in range(1, 4)] + [step_line(s, T0 + s, HALF, 30, 7.0) for s in range(4, 6)]
    directory = add_attempt(store, job_id, tmp_path, 1, WIDE, T0, lines=lines)
    recovery = {"step": 3, "from": WIDE.to_dict(), "to": HALF.to_dict(), "reason": "in-process -> [mb=4x2]"}
    (directory / "heartbeat.json").write_text(json.dumps({"step": 5, "recoveries": [recovery]}))
    add_event(store, job_id, T0 + 3.2, "escalated", "at step 3, in the runner: [mb=8x1] -> [mb=4x2]: in-process -> [mb=4x2]")
    # A second recovery the daemon reported, but the heartbeat (rewritten once a second) not yet.
    add_event(store, job_id, T0 + 5.5, "escalated", "at step 5, in the runner: [mb=4x2] -> [mb=2x4]: in-process -> [mb=2x4]")
    data = load(store, job_id)
    assert [(r.source, r.time, r.label) for r in data.rungs] == [
        ("runner", T0 + 3, "in-process -> [mb=4x2]"),
        ("runner", T0 + 5.5, "in-process -> [mb=2x4]"),
    ]
    # Without measurements, each in-process rung stands for an OOM at the cap.
    assert [(o.kind, o.step, o.bytes) for o in data.ooms] == [("in-process", 3, 48 * MiB)]
    assert png_size(draw_report(data, tmp_path / "r.png")) == (1400, 900)


def test_probe_ooms_sit_at_the_attempts_start(store: Store, tmp_path: Path) -> None:
    job_id = add_job(store, tmp_path, state="running")
    probe = {"step": 0, "from": WIDE.to_dict(), "to": HALF.to_dict(), "reason": "probe: start at [mb=4x2]"}
    outcome = Outcome(
        kind="finished", step=2, plan=HALF,
        measurements=(Measurement(plan=WIDE, fits=False, peak_bytes=60 * MiB, capacity=48 * MiB, step=0),
                      Measurement(plan=HALF, fits=True, peak_bytes=30 * MiB, capacity=48 * MiB, step=0)),
        recoveries=(probe,),
    )
    lines = [step_line(s, T0 + 5 + s, HALF, 30, 7.0) for s in (1, 2)]
    add_attempt(store, job_id, tmp_path, 1, WIDE, T0, lines=lines, outcome=outcome, ended=T0 + 8)
    data = load(store, job_id)
    assert [(o.kind, o.time, o.bytes, o.label) for o in data.ooms] == [("probe", T0, 48 * MiB, "probe OOM @0 [mb=8x1] wanted 60.0 MiB")]
    assert [(r.source, r.time, r.label) for r in data.rungs] == [("runner", T0, "probe -> [mb=4x2]")]


def test_only_attempts_without_any_metrics_still_draw(store: Store, tmp_path: Path) -> None:
    job_id = add_job(store, tmp_path, state="running")
    add_attempt(store, job_id, tmp_path, 1, WIDE, T0)
    data = load(store, job_id)
    assert data.notes == ("attempt 1: no metrics yet: it has not finished a step",)
    assert data.rates == () and data.ooms == ()
    assert png_size(draw_report(data, tmp_path / "r.png")) == (1400, 900)


def test_a_job_without_attempts_has_nothing_to_draw(store: Store, tmp_path: Path) -> None:
    job_id = add_job(store, tmp_path)
    with pytest.raises(ReportError, match=r"job 1 \(faces\) has no attempts yet \(it is queued\).*`oomguard report 1` again"):
        load(store, job_id)

