"""A job file's [resources] for a cluster (host_memory, cpus, time_limit, gpu_type) and
[ladder] in_process: read, kept through the store's round trip, and each problem named."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomguard.jobs.spec import JobSpec, parse_job_text
from oomguard.strategies.errors import JobFileError
from tests.jobs_helpers import TINY_JOB


def job(extra: str) -> JobSpec:
    text = TINY_JOB.format(name="c", batch_size=8, max_steps=8, checkpoint_every_steps=2, keep_checkpoints=2) + extra
    return parse_job_text(text, "<c.toml>", base_dir=Path.cwd())


def test_the_clusters_keys_are_read_and_kept() -> None:
    spec = job('\n[resources]\ngpus = 2\nhost_memory = "48GiB"\ncpus = 8\ntime_limit = "1-12:00:00"\ngpu_type = "a100"\n[ladder]\nin_process = false\n')
    resources = spec.resources
    assert (resources.gpus, resources.host_memory, resources.cpus, resources.time_limit, resources.gpu_type) == (2, 48 * 2**30, 8, 36 * 3600, "a100")
    assert spec.ladder.in_process is False
    assert JobSpec.load(spec.to_dict()) == spec
    plain = job("")
    assert plain.resources.host_memory is None and plain.resources.time_limit is None and plain.ladder.in_process is True


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ('time_limit = "a day"', "resources.time_limit: not a time limit: 'a day'"),
        ("time_limit = 0", "resources.time_limit: a time limit must be positive"),
        ('host_memory = "lots"', "resources.host_memory: not a memory size: 'lots'"),
        ("cpus = 0", "resources.cpus: expected an integer in 1..4096"),
        ('gpu_type = "a100 --uid=0"', "resources.gpu_type: expected a GPU type as the cluster's gres.conf names it"),
        ('time_limt = "1"', "resources.time_limt"),
    ],
)
def test_each_problem_is_named_with_its_key(table: str, expected: str) -> None:
    with pytest.raises(JobFileError) as raised:
        job(f"\n[resources]\n{table}\n")
    assert expected in str(raised.value), str(raised.value)
