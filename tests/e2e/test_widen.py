"""Widening: a built-in job with resources.gpus = "1-2" whose model state does not fit one
emulated GPU, on a daemon with two free: its first attempt runs out of memory on one, and the
doctor goes on on two with a sharding rung (an exact plan) instead of stepping down to an
approximate one (tests/e2e/test_sharding_lands.py holds such a plan's weights to the same job's
on big GPUs). A widened job gives a GPU back to a job that waits for one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomguard.strategies import rungs
from oomguard.strategies.plan import Plan
from tests.e2e.conftest import oomguard, wait_for
from tests.e2e.test_step_up_restart import WIDE
from tests.jobs_helpers import TINY_JOB

pytestmark = pytest.mark.slow

ALLOW = '["micro_batch", "checkpointing", "shard_optimizer", "shard_params", "shard_offload"]'


def job_file(folder: Path, name: str, gpus: str) -> Path:
    text = TINY_JOB.format(name=name, batch_size=8, max_steps=8, checkpoint_every_steps=2, keep_checkpoints=2)
    for tiny, wide in WIDE.items():
        text = text.replace(tiny, wide)
    text = text.replace("seed = 0", "seed = 0\nmicro_batch = 2")
    path = folder / f"{name}.toml"
    path.write_text(text + f"[ladder]\nallow = {ALLOW}\n[resources]\ngpus = {gpus}\n")
    return path


def test_a_job_that_does_not_fit_one_gpu_widens_onto_a_free_one_and_finishes(tmp_path: Path, daemon_factory) -> None:
    daemon = daemon_factory("--emulate-gpus", "2x9MiB", "--gpu-sample-seconds", "0.2")
    oomguard("submit", str(job_file(tmp_path, "widens", '"1-2"')), state_dir=daemon.state_dir, check=True)
    record = daemon.wait_job("1", timeout=300)
    assert record["state"] == "finished", (record["result"], record["events"])
    first, *_, last = record["attempts"]
    assert first["outcome"]["kind"] == "oom" and first["gpus"] == "0"
    assert last["outcome"]["kind"] == "finished" and last["gpus"] == "0,1"
    landed = Plan.from_dict(last["outcome"]["plan"])
    assert landed.world_size == 2
    on = [r.name for r in rungs.ladder() if r.is_on(landed)]
    assert all(rungs.rung(name).exact for name in on) and any(name.startswith("shard_") for name in on), on
    (widened,) = [e for e in record["events"] if e["kind"] == "escalated"]
    assert widened["message"].startswith("rung widen+"), widened
    # Each step trained once (the first attempt ran out before its first step ended).
    steps = [json.loads(line)["step"] for line in (Path(last["directory"]) / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))


def test_a_widened_job_gives_a_gpu_back_to_a_job_waiting_for_one_without_losing_a_step(tmp_path: Path, daemon_factory) -> None:
    """Widened onto both GPUs (no probe: its first attempt runs out of memory on one, and sharding
    on two is faster than offloading on one), the job gives one back when another job is
    submitted: it checkpoints and stops, and goes on on one GPU with a plan that fits there
    (host offload, exact), from that checkpoint. Both jobs finish; no step of the first is
    trained twice or skipped."""
    # 10.2 MiB: the plain plan (about 10.6 MiB) runs out on one GPU; sharding the optimizer on
    # two (8.2 MiB predicted, the sharding terms' units counted) fits with the margins and is
    # faster than offloading half the layers on one.
    daemon = daemon_factory("--emulate-gpus", "2x10444KiB", "--gpu-sample-seconds", "0.2")
    text = TINY_JOB.format(name="wide", batch_size=8, max_steps=30, checkpoint_every_steps=5, keep_checkpoints=2)
    for tiny, wide in WIDE.items():
        text = text.replace(tiny, wide)
    widened = tmp_path / "wide.toml"
    widened.write_text(text + '[ladder]\nprobe = false\n[resources]\ngpus = "1-2"\n')
    oomguard("submit", str(widened), state_dir=daemon.state_dir, check=True)
    wait_for(lambda: any(a["gpus"] == "0,1" and a["outcome"] is None for a in daemon.show("1")["attempts"]), 120, "job 1 to widen")
    wait_for(lambda: ((daemon.show("1").get("heartbeat") or {}).get("step") or 0) >= 7, 120, "job 1 to train on both GPUs")
    other = tmp_path / "other.toml"
    other.write_text(TINY_JOB.format(name="other", batch_size=8, max_steps=10, checkpoint_every_steps=5, keep_checkpoints=2))
    oomguard("submit", str(other), state_dir=daemon.state_dir, check=True)
    first, second = daemon.wait_job("1", timeout=400), daemon.wait_job("2", timeout=300)
    assert first["state"] == "finished" and second["state"] == "finished", (first["result"], second["result"])
    kinds = [e["kind"] for e in first["events"]]
    assert "narrowing" in kinds, kinds
    ends = [(a["gpus"], a["outcome"]["kind"]) for a in first["attempts"]]
    assert ends[0] == ("0", "oom") and ends[1] == ("0,1", "interrupted") and ends[-1][1] == "finished" and "," not in ends[-1][0], ends
    # Stopped where it stood, after a checkpoint of that step, and resumed from it.
    stopped_at = first["attempts"][1]["outcome"]["step"]
    assert stopped_at >= 7 and first["attempts"][2]["resumed_from"] == stopped_at
    narrowed = Plan.from_dict(first["attempts"][-1]["outcome"]["plan"])
    assert narrowed.world_size == 1 and all(rungs.rung(r.name).exact for r in rungs.ladder() if r.is_on(narrowed))
    # Every step trained exactly once across the attempts.
    steps = [
        json.loads(line)["step"] for attempt in first["attempts"]
        for line in (Path(attempt["directory"]) / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == list(range(1, 31)), steps
