"""Command jobs: argv templates with the plan's knobs, checked when the job is submitted."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from oomguard.jobs.command import CommandError, CommandSpec, check, exposed_rungs, render
from oomguard.jobs.spec import JobFileError, JobSpec, parse_job_text
from oomguard.strategies.plan import Plan

JOB = """\
name = "script"
trainer = "command"
[command]
argv = {argv}
[command.when]
gradient_checkpointing = ["--gradient_checkpointing"]
optimizer_8bit = "--use_8bit_adam"
[train]
batch_size = 16
max_steps = 10
learning_rate = 1e-4
"""
ARGV = ["python3", "-c", "pass", "--train_batch_size={micro_batch}", "--gradient_accumulation_steps={grad_accum}", "--mixed_precision={mixed_precision}", "--output_dir={workdir}/out"]


def job(argv=ARGV, extra: str = "", base_dir: Path | None = None) -> JobSpec:
    return parse_job_text(JOB.format(argv=json.dumps(argv)) + extra, "job.toml", base_dir=base_dir or Path.cwd())


def test_the_plan_fills_whole_arguments_and_adds_arguments_for_knobs_that_are_on():
    spec = job()
    assert spec.command is not None and spec.data is None and spec.model is None
    plan = Plan.initial(16).replace(micro_batch=4, gradient_checkpointing=True)
    argv, env = render(spec.command, plan, Path("/work dir/7"), 2)
    assert argv == [
        "python3", "-c", "pass", "--train_batch_size=4", "--gradient_accumulation_steps=4", "--mixed_precision=no",
        "--output_dir=/work dir/7/out", "--gradient_checkpointing",
    ]
    assert env == {}
    argv, _ = render(spec.command, Plan.initial(16).replace(optimizer="adamw8bit", mixed_precision="bf16"), Path("/w"), 1)
    assert argv[-1] == "--use_8bit_adam" and "--mixed_precision=bf16" in argv and "--gradient_checkpointing" not in argv


def test_only_the_knobs_a_script_exposes_are_rungs():
    assert job().policy().allow == ("allocator", "micro_batch", "checkpointing")
    spec = job(extra='[ladder]\nallow = ["micro_batch", "precision", "optimizer_8bit", "lora"]\n')
    assert spec.policy().allow == ("micro_batch", "precision", "optimizer_8bit")
    bare = CommandSpec(argv=("python3", "train.py"))
    assert exposed_rungs(bare) == ("allocator",)
    # micro_batch needs both halves: the micro-batch and the accumulation that keeps the batch.
    assert "micro_batch" not in exposed_rungs(CommandSpec(argv=("x", "--bs={micro_batch}")))


def test_a_job_round_trips_through_the_store():
    spec = job(extra='[command.env]\nHF_HUB_OFFLINE = "1"\nOUT = "{workdir}/x"\n')
    assert JobSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    _, env = render(spec.command, Plan.initial(16), Path("/w"), 1)
    assert env == {"HF_HUB_OFFLINE": "1", "OUT": "/w/x"}


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ("python3 train.py --train_batch_size={micro_batch}", 'command.argv: expected a list of arguments, found a string: oomguard never runs a shell; write it as a list, e.g. ["python3", "train.py", "--train_batch_size={micro_batch}"]'),
        ([], "command.argv: expected a non-empty list of non-empty strings"),
        (["python3", "--bs={batch}"], "command.argv: unknown placeholder {batch} (known: {micro_batch}, {grad_accum}, {batch_size}"),
        (["python3", "--bs={micro_batch"], "command.argv: argument '--bs={micro_batch' is not a valid template"),
        (["no-such-program-here", "x"], "command.argv: program 'no-such-program-here' not found on PATH; give its full path, or install it"),
        (["./missing.py"], "command.argv: program ./missing.py not found"),
        (["{workdir}/train.py"], "the program itself ('{workdir}/train.py') cannot be a placeholder"),
    ],
)
def test_bad_commands_are_refused_at_submit_time(argv, expected):
    with pytest.raises(JobFileError) as caught:
        job(argv)
    assert expected in str(caught.value)


def test_a_script_that_is_not_executable_is_refused_with_the_fix(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    script.chmod(0o644)
    with pytest.raises(JobFileError, match=r'is not executable \(chmod \+x it, or start it with its interpreter'):
        job(["./train.py"], base_dir=tmp_path)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    assert job(["./train.py"], base_dir=tmp_path).command is not None
    assert job([sys.executable, "train.py"], base_dir=tmp_path).command is not None


def test_command_tables_belong_to_command_jobs():
    with pytest.raises(JobFileError, match=r"a command job reads its own data and builds its own model: remove \[data\]"):
        job(extra='[data]\nsource = "synthetic:4"\nresolution = 8\n')
    with pytest.raises(JobFileError, match=r"unknown key \(expected one of: attention_slicing, gradient_checkpointing, lora"):
        parse_job_text(JOB.format(argv=json.dumps(ARGV)).replace("gradient_checkpointing =", "gradient_ckpt ="), "job.toml", base_dir=Path.cwd())
    with pytest.raises(JobFileError, match=r"command.env.1BAD: not an environment variable name"):
        job(extra='[command.env]\n1BAD = "x"\n')


def test_check_names_the_known_placeholders():
    with pytest.raises(CommandError, match=r"unknown placeholder \{nope\}"):
        check(CommandSpec(argv=("x", "{nope}")))


def run_with_bootstrap(code: str, tmp_path: Path, **env: str) -> str:
    import os
    import subprocess

    from oomguard.jobs.command import BOOTSTRAP_DIR

    other = tmp_path / "other"
    other.mkdir(exist_ok=True)
    (other / "sitecustomize.py").write_text("print('the hidden sitecustomize ran', flush=True)\n")
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OOMGUARD_")}
    environment.update(env, PYTHONPATH=os.pathsep.join([str(BOOTSTRAP_DIR), str(other)]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=environment)
    return done.stdout + done.stderr


def test_the_bootstrap_loads_nothing_until_the_script_imports_torch_and_keeps_the_hidden_sitecustomize(tmp_path: Path):
    output = run_with_bootstrap("import sys; print('torch loaded:', 'torch' in sys.modules)", tmp_path, OOMGUARD_EMULATE_DEVICE_MEMORY="8MiB")
    assert "the hidden sitecustomize ran" in output and "torch loaded: False" in output


def test_a_script_that_imports_torch_runs_on_the_emulated_device(tmp_path: Path):
    code = "import torch\ntry:\n    torch.zeros(4 * 2**20)\nexcept torch.OutOfMemoryError as error:\n    print('OOM:', str(error)[:60])\nelse:\n    print('fits')"
    assert "OOM: CUDA out of memory. Tried to allocate 16.00 MiB. GPU 0 has a" in run_with_bootstrap(code, tmp_path, OOMGUARD_EMULATE_DEVICE_MEMORY="8MiB")
    assert "fits" in run_with_bootstrap(code, tmp_path)  # no capacity: nothing emulated


@pytest.mark.parametrize(
    ("log", "step"),
    [
        ("Steps:  45%|####5     | 9/20 [00:03<00:04, 2.4it/s, loss=0.1]\rSteps:  50%|#####     | 10/20 [00:03<00:04]", 10),
        ("step 19 loss 0.9\nSteps: 20/20\n", 20),
        ("no progress here\n", None),
    ],
)
def test_the_last_step_count_of_a_script_log(log, step):
    from oomguard.jobs.command import last_step_count

    assert last_step_count(log) == step
