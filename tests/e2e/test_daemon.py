"""The daemon end to end: a job submitted with the CLI under an emulated cap runs out of
memory, steps down the ladder and finishes; the daemon can be stopped and started again
without losing anything."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import TINY_CAP, oomguard, tiny_job, wait_for
from tests.jobs_helpers import TINY_JOB

pytestmark = pytest.mark.slow


def test_submitted_job_recovers_from_oom_in_process_and_finishes(tmp_path: Path, daemon_factory) -> None:
    # The cap drops from 64 MiB to 3500 KiB at step 5: the probe starts the job at the full
    # micro-batch, and the runner itself steps down when the drop comes.
    daemon = daemon_factory("--emulate-device-memory", TINY_CAP)
    submitted = oomguard("submit", str(tiny_job(tmp_path)), state_dir=daemon.state_dir, check=True)
    assert "job 1 (tiny) queued" in submitted.stdout

    record = daemon.wait_job("1")

    assert record["state"] == "finished", record["result"]
    (attempt,) = record["attempts"]
    assert attempt["plan"]["micro_batch"] == 8
    outcome = attempt["outcome"]
    assert outcome["kind"] == "finished" and outcome["step"] == 12
    (recovery,) = outcome["recoveries"]
    assert recovery["step"] == 5 and recovery["from"]["micro_batch"] == 8
    # Smaller activations: a smaller micro-batch, or checkpointing (whichever the memory
    # model expects to run faster).
    assert recovery["to"]["micro_batch"] < 8 or recovery["to"]["gradient_checkpointing"]
    assert outcome["plan"]["micro_batch"] == recovery["to"]["micro_batch"]
    assert [m["fits"] for m in outcome["measurements"]].count(False) == 1
    escalations = [e["message"] for e in record["events"] if e["kind"] == "escalated"]
    assert any("at step 5, in the runner: [mb=8x1] -> [mb=" in text for text in escalations), escalations
    assert (Path(record["workdir"]) / "final" / "config.json").exists()
    status = oomguard("status", state_dir=daemon.state_dir, check=True).stdout
    assert "tiny" in status and "finished" in status
    logs = oomguard("logs", "1", state_dir=daemon.state_dir, check=True).stdout
    assert "probe: start at [mb=8x1]" in logs and "out of memory in" in logs and "at step 5; in-process" in logs
    shown = oomguard("show", "1", state_dir=daemon.state_dir, check=True).stdout
    assert "    step 5, in the runner: [mb=8x1] -> [" in shown
    assert "    measured [mb=1x8]: peak " in shown and "out of memory (needed more than" in shown


def test_an_oom_only_a_new_process_can_fix_ends_the_attempt_and_the_next_one_resumes(tmp_path: Path, daemon_factory) -> None:
    # A wide, low-resolution UNet: parameters, gradients and AdamW state (~10 MiB) dwarf the
    # activations, so no micro-batch fits once the device shrinks to 8 MiB at step 5; moving
    # the optimizer state to the host does, and that needs a new process.
    text = TINY_JOB.format(name="wide", batch_size=2, max_steps=8, checkpoint_every_steps=4, keep_checkpoints=2)
    text = text.replace("[8, 16]", "[32, 64]").replace("norm_num_groups = 4", "norm_num_groups = 8").replace("resolution = 16", "resolution = 8")
    job = tmp_path / "wide.toml"
    job.write_text(text + '\n[ladder]\nallow = ["micro_batch", "offload"]\n')
    daemon = daemon_factory("--emulate-device-memory", "64MiB,8MiB@5")
    oomguard("submit", str(job), state_dir=daemon.state_dir, check=True)

    record = daemon.wait_job("wide")

    assert record["state"] == "finished", record["result"]
    first, second = record["attempts"]
    assert first["outcome"]["kind"] == "oom" and first["outcome"]["step"] == 5
    assert first["outcome"]["recoveries"] == []  # nothing the running process could switch to
    assert "offload" in second["rung"] and "predicted peak" in second["reason"]
    assert second["plan"]["offload"] == "optimizer"
    assert second["outcome"]["resumed_from"] == 5
    assert second["outcome"]["kind"] == "finished" and second["outcome"]["step"] == 8


def test_stopping_and_restarting_the_daemon_loses_nothing(tmp_path: Path, daemon_factory) -> None:
    state_dir = tmp_path / "state"
    daemon = daemon_factory("--stop-jobs", state_dir=state_dir)
    oomguard("submit", str(tiny_job(tmp_path, max_steps=40)), state_dir=state_dir, check=True)
    wait_for(lambda: (daemon.show("1").get("heartbeat") or {}).get("step", 0) >= 2, 90, "training to start")

    assert daemon.stop() == 0
    stopped = daemon.show("1")
    assert stopped["state"] == "queued"
    interrupted = stopped["attempts"][0]["outcome"]
    assert interrupted["kind"] == "interrupted"
    stopped_at = interrupted["step"]
    assert (Path(stopped["workdir"]) / "checkpoints" / f"step-{stopped_at:06d}").is_dir()

    restarted = daemon_factory(state_dir=state_dir)
    record = restarted.wait_job("1")
    assert record["state"] == "finished"
    assert [a["number"] for a in record["attempts"]] == [1, 2]
    assert record["attempts"][1]["outcome"]["resumed_from"] == stopped_at
    assert record["attempts"][1]["outcome"]["step"] == 40
    kinds = [e["kind"] for e in record["events"]]
    assert kinds.count("queued") == 1 and "requeued" in kinds and kinds[-1] == "finished"


def test_sigterm_leaves_the_attempt_running_and_the_next_daemon_adopts_it(tmp_path: Path, daemon_factory) -> None:
    state_dir = tmp_path / "state"
    daemon = daemon_factory(state_dir=state_dir)
    oomguard("submit", str(tiny_job(tmp_path, max_steps=60)), state_dir=state_dir, check=True)
    wait_for(lambda: (daemon.show("1").get("heartbeat") or {}).get("step", 0) >= 2, 90, "training to start")
    runner_pid = daemon.show("1")["attempts"][0]["pid"]

    assert daemon.stop(timeout=10) == 0  # at once: nothing to wait for
    assert "leaving running attempts running" in daemon.output()
    Path(f"/proc/{runner_pid}").stat()  # the runner goes on without a daemon
    assert daemon.show("1")["state"] == "running"

    restarted = daemon_factory(state_dir=state_dir)
    record = restarted.wait_job("1")
    assert record["state"] == "finished"
    (attempt,) = record["attempts"]  # adopted: nothing ran twice
    assert attempt["outcome"]["kind"] == "finished" and attempt["outcome"]["resumed_from"] is None


def test_a_rung_the_runner_takes_is_an_event_while_it_runs_and_cancel_stops_the_job(tmp_path: Path, daemon_factory) -> None:
    # One long job for both (a runner start is most of an e2e test's time): the cap drops at
    # step 3, the runner steps down by itself, and the escalation is an event while the attempt
    # still runs; then the job is cancelled.
    daemon = daemon_factory("--emulate-device-memory", "64MiB,3500KiB@3")
    oomguard("submit", str(tiny_job(tmp_path, max_steps=400)), state_dir=daemon.state_dir, check=True)

    def escalated_while_running():
        record = daemon.show("1")
        running = record["state"] == "running" and record["attempts"] and record["attempts"][-1]["outcome"] is None
        return running and [e for e in record["events"] if e["kind"] == "escalated"]

    (event,) = wait_for(escalated_while_running, 90, "an escalation event while the attempt runs")
    assert event["message"].startswith("at step 3, in the runner: [mb=8x1] -> [")

    cancelled = oomguard("cancel", "tiny", state_dir=daemon.state_dir, check=True)
    assert "cancel requested for job 1" in cancelled.stdout
    record = daemon.wait_job("1")
    assert record["state"] == "cancelled"
    assert record["attempts"][0]["outcome"]["kind"] == "interrupted"
    # Reported once: not again when the attempt ended.
    assert [e["kind"] for e in record["events"]].count("escalated") == 1
    again = oomguard("cancel", "1", state_dir=daemon.state_dir)
    assert again.returncode == 1 and "already ended" in again.stderr
    missing = oomguard("show", "nope", state_dir=daemon.state_dir)
    assert missing.returncode == 3 and "no job 'nope'" in missing.stderr


def test_a_killed_daemon_adopts_the_attempt_it_left_running(tmp_path: Path, daemon_factory) -> None:
    state_dir = tmp_path / "state"
    daemon = daemon_factory(state_dir=state_dir)
    oomguard("submit", str(tiny_job(tmp_path, max_steps=60)), state_dir=state_dir, check=True)
    wait_for(lambda: (daemon.show("1").get("heartbeat") or {}).get("step", 0) >= 2, 90, "training to start")

    daemon.process.kill()  # SIGKILL: no chance to stop the runner, which has its own session
    daemon.process.wait()
    restarted = daemon_factory(state_dir=state_dir)
    record = restarted.wait_job("1")

    assert record["state"] == "finished"
    # The same attempt carried on: nothing was run twice.
    assert len(record["attempts"]) == 1
    assert record["attempts"][0]["outcome"]["kind"] == "finished"
    assert record["attempts"][0]["outcome"]["resumed_from"] is None


# A stand-in for a training script that only fits at 4 samples per micro-batch: above that it
# dies the way PyTorch does, with a CUDA OOM message on stderr and exit status 1. As in a real
# script, what it holds and the allocation that fails grow with its micro-batch (6 GiB of
# weights and optimizer state, 0.35 GiB of activations a sample, failing midway through).
FITS_AT_4 = """\
import argparse, sys
parser = argparse.ArgumentParser()
parser.add_argument("--train_batch_size", type=int)
parser.add_argument("--gradient_accumulation_steps", type=int)
parser.add_argument("--gradient_checkpointing", action="store_true")
args = parser.parse_args()
print(f"args: mb={args.train_batch_size} accum={args.gradient_accumulation_steps} ckpt={args.gradient_checkpointing}", flush=True)
if args.train_batch_size > 4:
    in_use = 6.0 + 0.35 * args.train_batch_size / 4
    request = 0.35 * args.train_batch_size / 2
    sys.stderr.write(
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {request:.2f} GiB. GPU 0 has a total capacity of 8.00 GiB "
        f"of which {8 - in_use:.2f} GiB is free. Including non-PyTorch memory, this process has {in_use:.2f} GiB memory in use. Of "
        f"the allocated memory {in_use - 0.1:.2f} GiB is allocated by PyTorch, and 0.10 GiB is reserved by PyTorch but unallocated.\\n"
    )
    sys.exit(1)
print("training finished: 10 steps", flush=True)
"""


def test_a_command_job_is_relaunched_with_a_smaller_micro_batch_until_it_fits(tmp_path: Path, daemon_factory) -> None:
    script = tmp_path / "train.py"
    script.write_text(FITS_AT_4)
    job = tmp_path / "script.toml"
    job.write_text(
        f"""name = "script"
trainer = "command"
[command]
argv = ["{sys.executable}", "train.py", "--train_batch_size={{micro_batch}}", "--gradient_accumulation_steps={{grad_accum}}"]
cwd = "{tmp_path}"
[command.when]
gradient_checkpointing = ["--gradient_checkpointing"]
[train]
batch_size = 16
max_steps = 10
"""
    )
    daemon = daemon_factory()
    oomguard("submit", str(job), state_dir=daemon.state_dir, check=True)
    record = daemon.wait_job("1", timeout=120)
    assert record["state"] == "finished", (record["result"], record["report"])
    attempts = record["attempts"]
    assert [a["outcome"]["kind"] for a in attempts][:-1] == ["oom"] * (len(attempts) - 1)
    assert attempts[-1]["outcome"]["kind"] == "finished"
    last = attempts[-1]["plan"]
    assert last["micro_batch"] <= 4 and 16 % last["micro_batch"] == 0
    logs = oomguard("logs", "1", state_dir=daemon.state_dir, check=True).stdout
    assert f"args: mb={last['micro_batch']} accum={16 // last['micro_batch']}" in logs
    assert "training finished: 10 steps" in logs
    # The first OOM was read from the log: the doctor saw PyTorch's figures.
    assert attempts[0]["outcome"]["memory"]["total"] == 8 * 2**30


# A plain PyTorch script that knows nothing of oomguard: its batch size is an argument.
TORCH_SCRIPT = """\
import argparse, torch
parser = argparse.ArgumentParser()
parser.add_argument("--train_batch_size", type=int)
parser.add_argument("--gradient_accumulation_steps", type=int)
args = parser.parse_args()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
optimizer = torch.optim.AdamW(model.parameters())
for step in range(4):
    for _ in range(args.gradient_accumulation_steps):
        loss = model(torch.randn(args.train_batch_size, 256)).pow(2).mean() / args.gradient_accumulation_steps
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(f"finished {step + 1} steps at micro-batch {args.train_batch_size}", flush=True)
"""


def test_a_torch_script_runs_out_of_emulated_memory_unchanged_and_is_relaunched(tmp_path: Path, daemon_factory) -> None:
    (tmp_path / "train.py").write_text(TORCH_SCRIPT)
    job = tmp_path / "torch-script.toml"
    job.write_text(
        f"""name = "torch-script"
trainer = "command"
[command]
argv = ["{sys.executable}", "train.py", "--train_batch_size={{micro_batch}}", "--gradient_accumulation_steps={{grad_accum}}"]
cwd = "{tmp_path}"
[train]
batch_size = 2048
max_steps = 4
"""
    )
    # 16 MiB: the whole batch of 2048 runs out (its activations alone are about 12 MiB) and the
    # plan the doctor picks from the OOM's figures fits; one relaunch, as in use.
    daemon = daemon_factory("--emulate-device-memory", "16MiB")
    oomguard("submit", str(job), state_dir=daemon.state_dir, check=True)
    record = daemon.wait_job("1", timeout=180)
    assert record["state"] == "finished", (record["result"], record["report"])
    first, *_, last = record["attempts"]
    assert first["outcome"]["kind"] == "oom" and first["outcome"]["memory"]["total"] == 16 * 2**20
    assert last["outcome"]["kind"] == "finished"
    assert last["plan"]["micro_batch"] < 2048 and last["plan"]["micro_batch"] * (2048 // last["plan"]["micro_batch"]) == 2048
    logs = oomguard("logs", "1", state_dir=daemon.state_dir, check=True).stdout
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate" in logs
    assert f"finished 4 steps at micro-batch {last['plan']['micro_batch']}" in logs


def test_a_job_queued_behind_a_running_one_says_so_in_status(tmp_path: Path, daemon_factory) -> None:
    marker = tmp_path / "started"
    for name in ("first", "second"):
        (tmp_path / f"{name}.toml").write_text(
            f'name = "{name}"\ntrainer = "command"\n[command]\n'
            f'argv = ["{sys.executable}", "-c", "import pathlib, time; pathlib.Path(\\"{marker}\\").touch(); time.sleep(30)"]\n'
            "[train]\nbatch_size = 1\nmax_steps = 1\n"
        )
    daemon = daemon_factory()  # no GPUs: one job at a time
    for name in ("first", "second"):
        oomguard("submit", str(tmp_path / f"{name}.toml"), state_dir=daemon.state_dir, check=True)
    wait_for(marker.exists, 60, "the first job to start")
    second = wait_for(lambda: (record := daemon.show("2"))["waiting"] and record, 30, "the second job's note")
    assert second["state"] == "queued" and second["waiting"].startswith("queued behind running job(s) 1 (without GPUs the daemon runs one at a time")
    oomguard("cancel", "1", state_dir=daemon.state_dir, check=True)
