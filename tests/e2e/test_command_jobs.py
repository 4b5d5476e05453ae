"""Command jobs end to end: a script that behaves like diffusers' examples, unchanged, under
the daemon with an emulated cap that drops mid-run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from oomguard.daemon import processes
from oomguard.daemon.shim import EXIT_STATUS
from tests.e2e.conftest import oomguard

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parents[1] / "scripts" / "diffusers_like_train.py"
STEPS = 20


def diffusers_like_job(folder: Path, name: str, *arguments: str, extra: str = "") -> Path:
    """A job file for SCRIPT: its batch of 1024 in {grad_accum} micro-batches, STEPS optimizer
    steps, a checkpoint every 5, resumed from the latest; ``extra`` lines end [command]."""
    argv = [
        sys.executable, str(SCRIPT), *arguments, "--gradient_accumulation_steps={grad_accum}", f"--max_train_steps={STEPS}",
        "--checkpointing_steps=5", "--output_dir={workdir}/out", "--resume_from_checkpoint=latest",
    ]
    job = folder / f"{name}.toml"
    job.write_text(
        f'name = "{name}"\ntrainer = "command"\n[command]\nargv = {json.dumps(argv)}\n{extra}\n'
        f"[train]\nbatch_size = 1024\nmax_steps = {STEPS}\n"
    )
    return job


def test_a_diffusers_like_script_ooms_is_relaunched_smaller_resumes_and_finishes_every_step(tmp_path: Path, daemon_factory) -> None:
    job = diffusers_like_job(
        tmp_path, "diffusers-like", "--train_batch_size={micro_batch}", "--mixed_precision={mixed_precision}",
        extra='[command.when]\ngradient_checkpointing = ["--gradient_checkpointing"]',
    )
    # 64 MiB for the first 7 optimizer steps of each process, then 6 MiB: the full batch of
    # 1024 needs more than that, half of it fits (measured with this script).
    daemon = daemon_factory("--emulate-device-memory", "64MiB,6MiB@7")
    oomguard("submit", str(job), state_dir=daemon.state_dir, check=True)
    record = daemon.wait_job("1", timeout=300)
    assert record["state"] == "finished", (record["result"], record["report"])
    first, *_, last = record["attempts"]
    assert first["plan"]["micro_batch"] == 1024 and first["outcome"]["kind"] == "oom"
    assert first["outcome"]["step"] == 7  # read from the script's progress line: the cap dropped after step 7
    assert last["outcome"]["kind"] == "finished" and last["outcome"]["step"] == STEPS
    assert last["plan"]["micro_batch"] < 1024 and last["plan"]["micro_batch"] * (1024 // last["plan"]["micro_batch"]) == 1024
    logs = oomguard("logs", "1", state_dir=daemon.state_dir, check=True).stdout
    assert "torch.OutOfMemoryError: CUDA out of memory" in logs
    assert "Resuming from checkpoint checkpoint-5" in logs
    assert logs.rstrip().endswith(f"Steps: {STEPS}/{STEPS}")

    # The same script without oomguard, uninterrupted: the same number of optimizer steps.
    straight = subprocess.run(
        [sys.executable, str(SCRIPT), "--train_batch_size=1024", f"--max_train_steps={STEPS}", f"--output_dir={tmp_path / 'straight'}"],
        capture_output=True, text=True, timeout=120,
    )
    assert straight.returncode == 0 and straight.stdout.rstrip().endswith(f"Steps: {STEPS}/{STEPS}")


def test_a_two_process_accelerate_job_is_torn_down_when_one_rank_runs_out_and_relaunched_with_the_same_plan_on_both(
    tmp_path: Path, daemon_factory
) -> None:
    # `accelerate launch --multi_gpu --num_processes 2` starts torchrun's two ranks (gloo on
    # the CPU: the script's Accelerator(cpu=True)); accelerate 1.x's `launch --cpu` starts a
    # single process unless it is given an MPI hostfile. Only the main process keeps EMA
    # weights, so only rank 0 runs out of memory; rank 1 then waits in its gradient all-reduce.
    accelerate = Path(sys.executable).parent / "accelerate"
    steps = 12
    job = tmp_path / "ranks.toml"
    job.write_text(
        f"""name = "two-ranks"
trainer = "command"
[command]
argv = ["{accelerate}", "launch", "--multi_gpu", "--num_processes={{processes}}", "--num_machines=1", "--mixed_precision=no",
        "--dynamo_backend=no", "{SCRIPT}", "--train_batch_size={{micro_batch}}", "--gradient_accumulation_steps={{grad_accum}}",
        "--max_train_steps={steps}", "--checkpointing_steps=3", "--output_dir={{workdir}}/out", "--resume_from_checkpoint=latest", "--use_ema"]
processes = 2
[train]
batch_size = 1024
max_steps = {steps}
"""
    )
    # Measured with this script: at 512 samples per rank rank 0 peaks at 5.8 MiB and rank 1 at
    # 5.4 MiB; at 256 rank 0 peaks at 4.8 MiB. 5.6 MiB after the 4th optimizer step.
    daemon = daemon_factory("--emulate-device-memory", "64MiB,5.6MiB@4")
    oomguard("submit", str(job), state_dir=daemon.state_dir, check=True)
    record = daemon.wait_job("1", timeout=300)
    assert record["state"] == "finished", (record["result"], record["report"])
    first, second = record["attempts"]
    assert (first["plan"]["micro_batch"], first["plan"]["world_size"]) == (512, 2)
    assert first["outcome"]["kind"] == "oom" and first["outcome"]["step"] == 4  # the cap dropped after step 4
    assert "CUDA out of memory" in first["outcome"]["message"]

    exit_status = json.loads((Path(first["directory"]) / EXIT_STATUS).read_text())
    failed = exit_status["failed_process"]
    assert failed["rank"] == "0" and failed["out_of_memory"] is True
    assert exit_status["ended_at"] - failed["at"] < 10.0, exit_status
    assert processes.marked_with(first["directory"]) == set()

    assert (second["plan"]["micro_batch"], second["plan"]["grad_accum"], second["plan"]["world_size"]) == (256, 2, 2)
    assert second["outcome"]["kind"] == "finished" and second["outcome"]["step"] == steps
    relaunched = (Path(second["directory"]) / "output.log").read_text()
    for rank in (0, 1):
        assert f"rank {rank}: train_batch_size=256 gradient_accumulation_steps=2 num_processes=2" in relaunched
    assert "Resuming from checkpoint checkpoint-3" in relaunched
    assert relaunched.rstrip().endswith(f"Steps: {steps}/{steps}")


def test_a_script_that_ignores_its_micro_batch_is_stopped_after_two_attempts_with_the_placeholder_named(tmp_path: Path, daemon_factory) -> None:
    # The job passes the plan's micro-batch in an environment variable the script never reads:
    # it trains 1024 samples a micro-batch whatever the plan says. The cap drops at the job's
    # step 7; the relaunch, resumed from step 5, meets it again at step 7 with the same batch.
    job = diffusers_like_job(tmp_path, "ignores-its-batch", "--train_batch_size=1024", extra='env = { TRAIN_BATCH = "{micro_batch}" }')
    daemon = daemon_factory("--emulate-device-memory", "64MiB,6MiB@7")
    oomguard("submit", str(job), state_dir=daemon.state_dir, check=True)
    record = daemon.wait_job("1", timeout=300)
    assert record["state"] == "failed", (record["result"], record["report"])
    assert len(record["attempts"]) == 2, [a["plan"] for a in record["attempts"]]
    first, second = record["attempts"]
    assert first["outcome"]["kind"] == second["outcome"]["kind"] == "oom"
    assert first["outcome"]["step"] == second["outcome"]["step"] == 7  # the drop follows the job's step, not the attempt's
    assert second["plan"]["micro_batch"] < first["plan"]["micro_batch"]
    assert "the script probably does not honour {micro_batch}, which the job passes as 'TRAIN_BATCH={micro_batch}'" in record["result"]
    assert "allow" not in record["report"]  # no rung is suggested for a script that ignores them
    shown = oomguard("show", "1", state_dir=daemon.state_dir, check=True).stdout
    assert "does not honour {micro_batch}" in shown and "TRAIN_BATCH={micro_batch}" in shown


def test_a_command_job_without_cwd_runs_in_the_folder_it_was_submitted_from(tmp_path: Path, daemon_factory) -> None:
    # As sbatch and pueue do: `python train.py` from the folder that holds train.py just works.
    project, jobs = tmp_path / "project", tmp_path / "job-files"
    project.mkdir()
    jobs.mkdir()
    (project / "train.py").write_text("import os\nprint('ran in', os.getcwd())\n")
    job = jobs / "here.toml"
    job.write_text(f"""name = "here"\ntrainer = "command"\n[command]\nargv = ["{sys.executable}", "train.py"]\n[train]\nbatch_size = 1\nmax_steps = 1\n""")
    daemon = daemon_factory()
    oomguard("submit", str(job), state_dir=daemon.state_dir, check=True, cwd=project)
    record = daemon.wait_job("1", timeout=120)
    assert record["spec"]["command"]["cwd"] == str(project)
    assert f"ran in {project}" in oomguard("logs", "1", state_dir=daemon.state_dir, check=True).stdout
    assert f"  runs in: {project}" in oomguard("show", "1", state_dir=daemon.state_dir, check=True).stdout
    # Submitted from elsewhere, the relative script is not there: refused at once, with the fix.
    refused = oomguard("submit", str(job), state_dir=daemon.state_dir, cwd=jobs)
    assert refused.returncode != 0 and f"script train.py not found: {jobs / 'train.py'} does not exist" in refused.stderr, refused.stderr
