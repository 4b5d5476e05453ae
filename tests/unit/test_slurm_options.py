"""What an attempt asks sbatch for, the batch script that runs it, and Slurm's answers read."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from oomguard.daemon.config import SlurmConfig
from oomguard.daemon.launch import LaunchRequest, Resources
from oomguard.daemon.launch.slurm_text import batch_script, parse_fields, sbatch_options, scheduler_end, submit_environment
from oomguard.daemon.users import Account
from oomguard.strategies.errors import LaunchFailed


def request(tmp_path: Path, resources: Resources = Resources(), **changes) -> LaunchRequest:
    values = dict(
        attempt_dir=tmp_path / "wd" / "attempts" / "001", argv=("python", "-m", "oomguard.jobs.run", str(tmp_path / "wd" / "attempts" / "001")),
        env={"PATH": "/usr/bin"}, owner=Account.from_uid(os.getuid()), workdir=tmp_path / "wd", cwd=None, stdin=b'{\n  "number": 1\n}',
        gpus=None, resources=resources, label="oomguard-3-1",
    )
    values.update(changes)
    return LaunchRequest(**values)


def test_the_job_files_resources_win_over_the_configs_defaults(tmp_path: Path) -> None:
    config = SlurmConfig(partition="gpu", account="lab", qos="high", time_limit=3600, signal_seconds=300, host_memory=2**30, cpus=4, gpu_type="a100",
                         extra_options=("--exclusive",))
    options = sbatch_options(request(tmp_path, Resources(gpus=2, host_memory=3 * 2**30, cpus=8, time_limit=7200, gpu_type="h100")), config)
    assert "--gres=gpu:h100:2" in options and "--mem=3072M" in options and "--cpus-per-task=8" in options
    assert "--time=0-02:00:00" in options and "--signal=B:USR1@300" in options and "--requeue" in options
    assert {"--partition=gpu", "--account=lab", "--qos=high", "--export=ALL", "--exclusive"} <= set(options)
    assert f"--comment={tmp_path / 'wd' / 'attempts' / '001'}" in options and "--job-name=oomguard-3-1" in options
    assert f"--output={tmp_path / 'wd' / 'attempts' / '001'}/slurm-%j.out" in options
    defaults = sbatch_options(request(tmp_path), config)
    assert "--gres=gpu:a100:1" in defaults and "--mem=1024M" in defaults and "--cpus-per-task=4" in defaults and "--time=0-01:00:00" in defaults


def test_a_short_time_limit_gets_its_signal_at_half_of_it(tmp_path: Path) -> None:
    options = sbatch_options(request(tmp_path, Resources(time_limit=60)), SlurmConfig(signal_seconds=300))
    assert "--time=0-00:01:00" in options and "--signal=B:USR1@30" in options


def test_a_percent_in_the_folder_is_not_read_as_a_slurm_pattern(tmp_path: Path) -> None:
    folder = tmp_path / "100%" / "attempts" / "001"
    options = sbatch_options(request(tmp_path, attempt_dir=folder), SlurmConfig())
    assert f"--output={tmp_path}/100%%/attempts/001/slurm-%j.out" in options


def test_more_host_memory_than_the_config_allows_is_that_most_once_then_refused_with_the_key(tmp_path: Path) -> None:
    # Doubled from 3 GiB past the most (4 GiB): the most, once.
    assert "--mem=4096M" in sbatch_options(request(tmp_path, Resources(host_memory=6 * 2**30)), SlurmConfig(max_host_memory=4 * 2**30))
    with pytest.raises(LaunchFailed) as raised:  # doubled from the most itself
        sbatch_options(request(tmp_path, Resources(host_memory=8 * 2**30)), SlurmConfig(max_host_memory=4 * 2**30))
    assert "slurm.max_host_memory" in raised.value.why and "raise slurm.max_host_memory" in raised.value.fix


def test_the_batch_script_execs_the_shim_with_the_config_on_its_standard_input(tmp_path: Path) -> None:
    script = batch_script(request(tmp_path, cwd="/data/my scripts"), "/venv/bin/python")
    lines = script.splitlines()
    assert lines[0] == "#!/bin/sh"
    command = shlex.split(lines[2].removesuffix(" <<'OOMGUARD_ATTEMPT_CONFIG'"))
    attempt = str(tmp_path / "wd" / "attempts" / "001")
    assert command[:6] == ["exec", "/venv/bin/python", "-m", "oomguard.daemon.shim", attempt, "--workdir"]
    assert command[7:11] == ["--cwd", "/data/my scripts", "--pass-usr1", "--"]
    assert lines[3:] == ["{", '  "number": 1', "}", "OOMGUARD_ATTEMPT_CONFIG"]


def test_sbatch_gets_the_attempts_environment_and_where_the_cluster_is_but_not_a_jobs_variables_nor_gpus() -> None:
    env = submit_environment(
        {"PATH": "/usr/bin", "SLURM_JOB_ID": "7", "SBATCH_TIMELIMIT": "5", "HF_HOME": "/h", "CUDA_VISIBLE_DEVICES": "3"}, {"SLURM_CONF": "/etc/s.conf"},
    )
    assert env == {"PATH": "/usr/bin", "HF_HOME": "/h", "SLURM_CONF": "/etc/s.conf"}


def test_scontrols_line_is_read_with_paths_that_hold_spaces() -> None:
    line = (
        "JobId=12 JobName=oomguard-3-1 UserId=ann(1000) JobState=OUT_OF_MEMORY Reason=OutOfMemory Restarts=1 ExitCode=0:125 "
        "TimeLimit=1-00:00:00 Command=(null) WorkDir=/ Comment=/home/ann/my runs/attempts/001 StdOut=/home/ann/my runs/attempts/001/slurm-12.out "
        "TRES=cpu=2,mem=1536M,node=1,billing=2"
    )
    fields = parse_fields(line)
    assert fields["Comment"] == "/home/ann/my runs/attempts/001" and fields["Restarts"] == "1"
    end = scheduler_end(fields)
    assert (end.state, end.reason, end.time_limit, end.host_memory) == ("OUT_OF_MEMORY", "OutOfMemory", 86400, 1536 * 2**20)
    # Slurm 23.02 and later name the memory a job had AllocTRES= (and ReqTRES=).
    newer = parse_fields("JobState=OUT_OF_MEMORY Reason=OutOfMemory ReqTRES=cpu=1,mem=1G,node=1 AllocTRES=cpu=2,mem=2G,node=1")
    assert scheduler_end(newer).host_memory == 2 * 2**30
    assert scheduler_end(None).state is None
    assert scheduler_end(parse_fields("JobState=TIMEOUT Reason=None TimeLimit=UNLIMITED TRES=cpu=1,mem=2G")).time_limit is None
