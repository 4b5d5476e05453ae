"""The daemon's configuration file: backend and [slurm], every problem named with its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomguard.daemon.config import ConfigError, DaemonConfig, parse_config, read_config


def test_no_file_means_the_local_backend() -> None:
    assert DaemonConfig().backend == "local"
    assert parse_config({}, "d.toml") == DaemonConfig()


def test_a_slurm_config_is_read_with_its_units(tmp_path: Path) -> None:
    path = tmp_path / "daemon.toml"
    path.write_text(
        'backend = "slurm"\n[slurm]\npartition = "gpu"\naccount = "lab"\nqos = "normal"\ntime_limit = "2-00:00:00"\n'
        'signal_seconds = 600\nhost_memory = "64GiB"\nmax_host_memory = "256GiB"\ncpus = 8\ngpu_type = "a100"\n'
        'extra_options = ["--constraint=ampere"]\nmax_jobs = 4\npoll_seconds = 2\n'
    )
    slurm = read_config(path).slurm
    assert (slurm.partition, slurm.account, slurm.qos, slurm.gpu_type) == ("gpu", "lab", "normal", "a100")
    assert slurm.time_limit == 2 * 24 * 3600 and slurm.signal_seconds == 600
    assert slurm.host_memory == 64 * 2**30 and slurm.max_host_memory == 256 * 2**30
    assert (slurm.cpus, slurm.max_jobs, slurm.poll_seconds, slurm.extra_options) == (8, 4, 2.0, ("--constraint=ampere",))


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"backend": "kubernetes"}, 'backend: expected "local" or "slurm"'),
        ({"backnd": "slurm"}, "backnd: unknown key"),
        ({"backend": "slurm", "slurm": {"partiton": "gpu"}}, "slurm.partiton: unknown key (known: partition,"),
        ({"slurm": {"partition": "gpu"}}, 'slurm: the [slurm] table is set but backend is \'local\': add backend = "slurm"'),
        ({"backend": "slurm", "slurm": {"time_limit": "soon"}}, "slurm.time_limit: not a time limit: 'soon'"),
        ({"backend": "slurm", "slurm": {"time_limit": "1", "signal_seconds": 60}}, "slurm.signal_seconds: 60 s is not shorter than slurm.time_limit"),
        ({"backend": "slurm", "slurm": {"host_memory": 64}}, 'slurm.host_memory: expected a size such as "64GiB"'),
        ({"backend": "slurm", "slurm": {"host_memory": "8GiB", "max_host_memory": "4GiB"}}, "slurm.max_host_memory: is below slurm.host_memory"),
        ({"backend": "slurm", "slurm": {"extra_options": ["--mem=4G"]}}, "slurm.extra_options: --mem is set by oomguard"),
        ({"backend": "slurm", "slurm": {"extra_options": ["-t60"]}}, "slurm.extra_options: -t is set by oomguard"),
        ({"backend": "slurm", "slurm": {"extra_options": ["--array=1-4"]}}, "slurm.extra_options: --array is set by oomguard"),
        ({"backend": "slurm", "slurm": {"extra_options": ["--wait"]}}, "would stop it following the attempt"),
        ({"backend": "slurm", "slurm": {"extra_options": "--exclusive"}}, "slurm.extra_options: expected a list of sbatch options"),
        ({"backend": "slurm", "slurm": {"partition": "gpu; rm -rf"}}, "slurm.partition: expected a name as Slurm writes it"),
        ({"backend": "slurm", "slurm": {"max_jobs": 0}}, "slurm.max_jobs: expected an integer >= 1"),
        ({"backend": "slurm", "slurm": {"poll_seconds": 0}}, "slurm.poll_seconds: expected seconds between 0.1 and 3600"),
    ],
)
def test_each_problem_names_its_key_and_fix(data: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config(data, "daemon.toml")
    assert str(raised.value).startswith("daemon.toml: ") and expected in str(raised.value), str(raised.value)


def test_a_file_that_is_not_toml_is_named(tmp_path: Path) -> None:
    path = tmp_path / "daemon.toml"
    path.write_text("backend = slurm\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        read_config(path)
    with pytest.raises(ConfigError, match="cannot read it"):
        read_config(tmp_path / "missing.toml")
