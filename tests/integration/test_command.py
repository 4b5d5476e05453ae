"""Command jobs: argv templates with the plan's knobs, checked when the job is submitted."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from oomguard.jobs.command import render
from oomguard.jobs.spec import JobSpec, load_job_file, parse_job_text
from oomguard.jobs.spec.command import CommandSpec, check, exposed_rungs
from oomguard.strategies.plan import Plan
from oomguard.strategies.errors import CommandError, JobFileError
from tests.conftest import as_root

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
"""
ARGV = ["python3", "-c", "pass", "--train_batch_size={micro_batch}", "--gradient_accumulation_steps={grad_accum}", "--mixed_precision={mixed_precision}", "--output_dir={workdir}/out"]


def job(argv=ARGV, extra: str = "", base_dir: Path | None = None, cwd: Path | None = None) -> JobSpec:
    text = JOB.format(argv=json.dumps(argv)) + extra
    if cwd is not None:
        text = text.replace("[command.when]", f"cwd = {json.dumps(str(cwd))}\n[command.when]")
    return parse_job_text(text, "job.toml", base_dir=base_dir or Path.cwd())


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
    assert JobSpec.parse(json.loads(json.dumps(spec.to_dict()))) == spec
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
        (["./missing.py"], "command.argv: program ./missing.py is a relative path, but without [command] cwd the command runs in"),
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
        job(["./train.py"], cwd=tmp_path)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    assert job(["./train.py"], cwd=tmp_path).command is not None
    assert job([sys.executable, "train.py"], cwd=tmp_path).command is not None


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


def bootstrapped(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by a Python that loads the bootstrap as a command job's processes do, with
    tmp_path/other (a sitecustomize of its own, and modules a test writes) on its path."""
    from oomguard.jobs.command import BOOTSTRAP_DIR

    other = tmp_path / "other"
    other.mkdir(exist_ok=True)
    (other / "sitecustomize.py").write_text("print('the hidden sitecustomize ran', flush=True)\n")
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OOMGUARD_")}
    environment.update(env, PYTHONPATH=os.pathsep.join([str(BOOTSTRAP_DIR), str(other)]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=environment)


def run_with_bootstrap(code: str, tmp_path: Path, **env: str) -> str:
    done = bootstrapped(code, tmp_path, **env)
    return done.stdout + done.stderr


def test_the_bootstrap_loads_nothing_until_the_script_imports_torch_and_keeps_the_hidden_sitecustomize(tmp_path: Path):
    output = run_with_bootstrap("import sys; print('torch loaded:', 'torch' in sys.modules)", tmp_path, OOMGUARD_EMULATE_DEVICE_MEMORY="8MiB")
    assert "the hidden sitecustomize ran" in output and "torch loaded: False" in output


def test_a_script_that_imports_torch_runs_on_the_emulated_device(tmp_path: Path):
    code = "import torch\ntry:\n    torch.zeros(4 * 2**20)\nexcept torch.OutOfMemoryError as error:\n    print('OOM:', str(error)[:60])\nelse:\n    print('fits')"
    assert "OOM: CUDA out of memory. Tried to allocate 16.00 MiB. GPU 0 has a" in run_with_bootstrap(code, tmp_path, OOMGUARD_EMULATE_DEVICE_MEMORY="8MiB")
    assert "fits" in run_with_bootstrap(code, tmp_path)  # no capacity: nothing emulated


def test_a_cap_schedule_moves_on_with_the_scripts_optimizer_steps_outside_the_daemon_too(tmp_path: Path):
    # `OOMGUARD_EMULATE_DEVICE_MEMORY=64MiB,8MiB@2 python train.py` run by hand: 16 MiB fit
    # before the script's second optimizer step, not after it.
    steps = (
        "import torch\nweight = torch.nn.Parameter(torch.zeros(4))\noptimizer = torch.optim.SGD([weight], lr=0.1)\n"
        "for step in (1, 2):\n    torch.zeros(4 * 2**20)\n    print('step', step, 'fits', flush=True)\n    optimizer.step()\n"
    )
    output = run_with_bootstrap(f"{steps}{TRY_16_MIB}", tmp_path, OOMGUARD_EMULATE_DEVICE_MEMORY="64MiB,8MiB@2")
    assert "step 1 fits" in output and "step 2 fits" in output and "OOM: CUDA out of memory. Tried to allocate 16.00 MiB." in output, output


TRY_16_MIB = "try:\n    torch.zeros(4 * 2**20)\nexcept torch.OutOfMemoryError as error:\n    print('OOM:', str(error)[:60])\nelse:\n    print('fits')"

# A library that asks whether torch is there before importing it, as datasets' config and
# transformers' import utilities do (USE_TORCH, importlib.util.find_spec, the version from
# the package metadata), and imports it only later, when a torch feature is used.
PROBING_LIBRARY = """import importlib.metadata
import importlib.util
import os

USE_TORCH = os.environ.get("USE_TORCH", "AUTO").upper()
TORCH_AVAILABLE = False
if USE_TORCH in ("1", "ON", "YES", "TRUE", "AUTO"):
    TORCH_AVAILABLE = importlib.util.find_spec("torch") is not None
    if TORCH_AVAILABLE:
        TORCH_VERSION = importlib.metadata.version("torch")


def with_format_torch():
    import torch

    return torch
"""


@pytest.mark.parametrize(
    "first",
    [
        "import probing_library\ntorch = probing_library.with_format_torch()",
        # The spec a probe found, loaded by hand (importlib's recipe for importing a module
        # directly, which lazy-import helpers use).
        "import importlib.util, sys\nspec = importlib.util.find_spec('torch')\ntorch = importlib.util.module_from_spec(spec)\n"
        "sys.modules['torch'] = torch\nspec.loader.exec_module(torch)",
        "import importlib.util\nimportlib.util.find_spec('torch')\nimportlib.util.find_spec('torch')\nimport torch",
    ],
    ids=["library-probes-first", "loaded-from-the-probed-spec", "probed-twice"],
)
def test_the_cap_applies_however_torch_is_first_found_and_loaded(tmp_path: Path, first: str):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "probing_library.py").write_text(PROBING_LIBRARY)
    output = run_with_bootstrap(f"{first}\n{TRY_16_MIB}", tmp_path, OOMGUARD_EMULATE_DEVICE_MEMORY="8MiB")
    assert "OOM: CUDA out of memory. Tried to allocate 16.00 MiB." in output, output


@pytest.mark.parametrize(
    ("code", "env", "says"),
    [
        (
            "import threading\nthreading.Thread(target=lambda: __import__('torch')).start()\nimport time; time.sleep(60)",
            {"OOMGUARD_EMULATE_DEVICE_MEMORY": "8MiB"},
            "torch was first imported in thread 'Thread-1 (<lambda>)', not the main thread; import torch in the main thread first",
        ),
        ("import torch\nprint('ran unguarded')", {"OOMGUARD_EMULATE_DEVICE_MEMORY": "8 parsecs"}, "ValueError: "),
    ],
    ids=["torch-imported-in-a-thread", "capacity-unreadable"],
)
def test_a_process_whose_cap_cannot_be_applied_ends_at_once_saying_why(tmp_path: Path, code: str, env: dict[str, str], says: str):
    from oomguard.jobs.script_memory import EXIT_NOT_APPLIED

    done = bootstrapped(code, tmp_path, **env)
    assert done.returncode == EXIT_NOT_APPLIED, done
    assert "RuntimeError: oomguard could not apply the emulated device memory: " in done.stderr
    assert says in done.stderr and "ran unguarded" not in done.stdout


@pytest.mark.parametrize(
    ("log", "step"),
    [
        ("Steps:  45%|####5     | 9/20 [00:03<00:04, 2.4it/s, loss=0.1]\rSteps:  50%|#####     | 10/20 [00:03<00:04]", 10),
        ("step 19 loss 0.9\nSteps: 20/20\n", 20),
        ("no progress here\n", None),
        # train_unconditional.py: an "Epoch N" bar with its logs (step=N) as the postfix
        ("Epoch 2:  40%|####      | 4/10 [00:02<00:03, ema_decay=0.9, loss=0.05, lr=0.0001, step=24]\r", 24),
        # train_text_to_image_lora.py: step_loss is not a step
        ("Steps:  30%|###       | 3/10 [00:01<00:02, lr=0.0001, step_loss=0.2]", 3),
    ],
)
def test_the_last_step_count_of_a_script_log(log, step):
    from oomguard.jobs.command import last_step_count

    assert last_step_count(log) == step


EXAMPLES = Path(__file__).parents[2] / "jobs" / "examples"


def example(name: str, scripts: Path) -> JobSpec:
    """An example job file with its scripts' folder (/srv/lab/scripts, to be edited) in ``scripts``."""
    job_file = scripts / name
    job_file.write_text((EXAMPLES / name).read_text().replace("/srv/lab/scripts", str(scripts)))
    return load_job_file(job_file)


def test_the_diffusers_example_jobs_pass_their_knobs_to_the_scripts(monkeypatch, tmp_path: Path):
    # `accelerate` is found the way `oomguard submit` finds it: on PATH; the scripts are checked
    # in the examples' [command] cwd.
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    for script in ("train_unconditional.py", "train_text_to_image_lora.py"):
        (tmp_path / script).write_text("")
    unconditional = example("diffusers_train_unconditional.toml", tmp_path)
    assert unconditional.policy().allow == ("allocator", "micro_batch")
    lora = example("diffusers_train_text_to_image_lora.toml", tmp_path)
    assert lora.policy().allow == ("allocator", "micro_batch", "checkpointing", "optimizer_8bit")
    plan = lora.initial_plan()
    assert (plan.batch_size, plan.micro_batch, plan.mixed_precision, plan.even_slices) == (8, 8, "fp16", True)
    argv, env = render(lora.command, plan.replace(micro_batch=2, gradient_checkpointing=True, optimizer="adamw8bit"), Path("/w"), 3)
    assert argv[:2] == ["accelerate", "launch"] and "train_text_to_image_lora.py" in argv
    for expected in ("--train_batch_size=2", "--gradient_accumulation_steps=4", "--mixed_precision=fp16", "--output_dir=/w/sd15-lora",
                     "--resume_from_checkpoint=latest", "--gradient_checkpointing", "--use_8bit_adam"):
        assert expected in argv
    assert env == {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    assert "--gradient_checkpointing" not in render(lora.command, plan, Path("/w"), 1)[0]


def multi_process_job(processes: int, train: str) -> JobSpec:
    text = JOB.format(argv=json.dumps([*ARGV, "--num_processes={processes}"])).replace("[command.when]", f"processes = {processes}\n[command.when]")
    return parse_job_text(text.replace("batch_size = 16\n", train), "job.toml", base_dir=Path.cwd())


def test_a_multi_process_command_splits_the_batch_over_its_processes():
    spec = multi_process_job(2, "batch_size = 16\n")
    plan = spec.initial_plan()
    assert (plan.world_size, plan.micro_batch, plan.grad_accum) == (2, 8, 1)
    argv, _ = render(spec.command, plan.replace(micro_batch=2), Path("/w"), 1)
    assert {"--train_batch_size=2", "--gradient_accumulation_steps=4", "--num_processes=2"} <= set(argv)
    assert JobSpec.parse(json.loads(json.dumps(spec.to_dict()))) == spec


@pytest.mark.parametrize(
    ("processes", "train", "expected"),
    [
        (3, "batch_size = 16\n", "train.batch_size: 16 cannot be split evenly over [command] processes = 3; make it a multiple of 3"),
        (2, "batch_size = 16\nmicro_batch = 3\n", "train.micro_batch: expected a divisor of 8 (train.batch_size / [command] processes"),
        (1, "batch_size = 16\nmicro_batch = 5\n", "one of 1, 2, 4, 8, 16; found 5"),
        (0, "batch_size = 16\n", "command.processes: expected an integer in 1..1024, found 0"),
        (1, "batch_size = 16\nlearning_rate = 1e-4\n", "train.learning_rate: a command job's script has its own; remove it here (pass it in [command] argv)"),
        (1, "batch_size = 16\nseed = 3\n", "train.seed: a command job's script has its own"),
    ],
)
def test_bad_batch_settings_of_a_command_job_are_refused(processes, train, expected):
    with pytest.raises(JobFileError) as caught:
        multi_process_job(processes, train)
    assert expected in str(caught.value)


def test_a_built_in_job_still_needs_its_learning_rate():
    text = (EXAMPLES / "quickstart.toml").read_text()
    without = "\n".join(line for line in text.splitlines() if not line.startswith("learning_rate"))
    with pytest.raises(JobFileError, match=r"train.learning_rate: required key is missing \(e.g. learning_rate = 1e-4\)"):
        parse_job_text(without, "quickstart.toml", base_dir=EXAMPLES)


# Bad paths: the command's folder and its script, checked when the job is submitted ------------------


@pytest.mark.parametrize(
    ("argv", "script"),
    [
        (["python", "train.py", "--lr=1e-4"], "train.py"),
        (["python3.11", "-u", "-W", "ignore", "-X", "dev", "scripts/train.py", "x.py"], "scripts/train.py"),
        (["/opt/venv/bin/python3", "/srv/train.py"], "/srv/train.py"),
        (["python", "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", "train.py", "--data", "d.py"], "train.py"),
        (["accelerate", "launch", "--multi_gpu", "--num_processes={processes}", "--config_file", "cfg.yaml", "train.py"], "train.py"),
        (["/home/a/.venv/bin/accelerate", "launch", "trian.py", "--train_batch_size={micro_batch}"], "trian.py"),
        (["torchrun", "--nproc_per_node=2", "train.py"], "train.py"),
        (["deepspeed", "--num_gpus", "2", "train.py", "--deepspeed", "ds.json"], "train.py"),
        (["python", "{workdir}/train.py"], "{workdir}/train.py"),
        (["python", "-c", "import train"], None),
        (["python", "-m", "mypackage.train", "x.py"], None),
        (["torchrun", "-m", "mypackage.train"], None),
        (["accelerate", "config"], None),
        (["bash", "run.py"], None),
        (["./train.py", "--lr=1"], None),  # the program itself: checked as the program
    ],
)
def test_the_script_a_command_runs_is_found_in_its_arguments(argv, script):
    from oomguard.jobs.spec.command_paths import script_argument

    assert script_argument(argv) == script


def project(tmp_path: Path) -> Path:
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "train.py").write_text("print('training')\n")
    return folder


def error_of(argv, cwd: Path | None, base_dir: Path | None = None) -> str:
    with pytest.raises(JobFileError) as caught:
        job(argv, cwd=cwd, base_dir=base_dir)
    return str(caught.value)


@pytest.mark.parametrize(
    "argv",
    [
        [sys.executable, "trian.py", "--train_batch_size={micro_batch}", "--gradient_accumulation_steps={grad_accum}"],
        ["accelerate", "launch", "--num_processes=1", "trian.py", "--train_batch_size={micro_batch}"],
    ],
    ids=["python", "accelerate-launch"],
)
def test_a_mistyped_script_is_refused_naming_it_and_the_fix(tmp_path: Path, argv, monkeypatch):
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # accelerate, as submit finds it
    folder = project(tmp_path)
    message = error_of(argv, cwd=folder)
    assert message.startswith("job.toml: command.argv: script trian.py not found: ")
    assert f"{folder / 'trian.py'} does not exist" in message and "did you mean 'train.py'?" in message
    assert "relative to [command] cwd" in message


def test_a_script_given_by_its_full_path_or_through_a_placeholder(tmp_path: Path):
    folder = project(tmp_path)
    assert job([sys.executable, str(folder / "train.py")]).command is not None
    assert "script " + str(folder / "nope.py") in error_of([sys.executable, str(folder / "nope.py")], cwd=None)
    assert job([sys.executable, "{workdir}/train.py"]).command is not None  # known only when an attempt starts
    (folder / "data.py").mkdir()
    assert "is a folder, not a script file" in error_of([sys.executable, "data.py"], cwd=folder)


def test_a_relative_script_without_a_cwd_is_refused_with_the_cwd_that_holds_it(tmp_path: Path):
    folder = project(tmp_path)
    message = error_of([sys.executable, "train.py"], cwd=None, base_dir=folder)
    assert "script train.py is a relative path, but without [command] cwd the command runs in the job's workdir" in message
    assert f'set [command] cwd = "{folder}"' in message
    # A workdir of the job file's own is where the command runs without a cwd.
    in_workdir = f"workdir = {json.dumps(str(folder))}\n" + JOB.format(argv=json.dumps([sys.executable, "train.py"]))
    assert parse_job_text(in_workdir, "job.toml", base_dir=tmp_path).command is not None
    with pytest.raises(JobFileError, match=rf"script trian.py not found: .* \(relative to the job's workdir, {folder}\)"):
        parse_job_text(in_workdir.replace("train.py", "trian.py"), "job.toml", base_dir=tmp_path)


@pytest.mark.parametrize("kind", ["missing", "a-file"])
def test_a_cwd_that_is_not_a_folder_is_refused_naming_it(tmp_path: Path, kind):
    cwd = tmp_path / "projcet"
    if kind == "a-file":
        cwd.write_text("")
    message = error_of([sys.executable, "-c", "pass"], cwd=cwd)
    expected = f"folder {cwd} does not exist" if kind == "missing" else f"{cwd} is not a folder"
    assert message.startswith(f"job.toml: command.cwd: {expected}") and "set cwd to the folder" in message


@as_root
def test_the_system_daemon_looks_at_the_paths_of_its_own_users_jobs_only(tmp_path: Path, accounts):
    """Run as root, the daemon does not look at another user's paths: queueing or refusing their
    file would tell them whether a path exists that they may not see (tmp_path is root's, 0700).
    `oomguard submit` checked them as that user; the daemon checks those of its own user's jobs."""
    from oomguard.daemon.paths import StateDir
    from oomguard.daemon.spool import Arrival, Rejection, Spool

    state = StateDir(tmp_path / "state").create()
    spool = Spool(state.inbox, state.accepted, state.rejected)
    text = JOB.format(argv=json.dumps([sys.executable, str(tmp_path / "private" / "nope.py")]))
    alice = accounts["alice"]
    for name in ("root.toml", "alice.toml"):
        (state.inbox / name).write_text(text)
    os.chown(state.inbox / "alice.toml", alice.uid, alice.gid)
    theirs = spool.take(state.inbox.resolve() / "alice.toml")
    assert isinstance(theirs, Arrival) and theirs.owner.uid == alice.uid
    own = spool.take(state.inbox.resolve() / "root.toml")
    assert isinstance(own, Rejection) and "nope.py not found" in own.error
