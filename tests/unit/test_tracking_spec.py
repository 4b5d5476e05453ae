"""train.log_with (jobs/spec/trackers.py): which experiment trackers a built-in job's metrics go to."""

from __future__ import annotations

import importlib.util
import json

import pytest

from oomguard.jobs.spec import JobSpec, parse_job_text
from oomguard.jobs.spec import trackers
from oomguard.strategies.errors import JobFileError
from tests.jobs_helpers import TINY_JOB

BASE = TINY_JOB.format(name="metrics", batch_size=8, max_steps=8, checkpoint_every_steps=2, keep_checkpoints=2)

COMMAND_JOB = """\
name = "script"
trainer = "command"

[command]
argv = ["python", "-c", "pass"]
cwd = "/tmp"

[train]
batch_size = 8
max_steps = 8
{extra}
"""


def parse(extra: str = "", text: str = BASE) -> JobSpec:
    return parse_job_text(text + extra + "\n", "job.toml", base_dir="/tmp", check_files=False)


def refusal(extra: str, text: str = BASE) -> str:
    with pytest.raises(JobFileError) as caught:
        parse(extra, text)
    return str(caught.value)


def test_a_job_without_the_key_writes_tensorboard():
    assert parse().train.log_with == ("tensorboard",)


def test_an_empty_list_turns_metrics_off():
    assert parse("log_with = []").train.log_with == ()


def test_the_trackers_named_are_kept_in_order_and_round_trip():
    job = parse('log_with = ["tensorboard"]')
    assert job.train.log_with == ("tensorboard",)
    for spec in (parse(), parse("log_with = []"), job):
        assert JobSpec.parse(spec.to_dict()) == spec
        assert JobSpec.parse(json.loads(json.dumps(spec.to_dict()))) == spec
        assert JobSpec.load(json.loads(json.dumps(spec.to_dict()))) == spec


def test_a_spec_stored_before_the_key_existed_loads_with_the_default():
    stored = parse("log_with = []").to_dict()
    del stored["train"]["log_with"]
    assert JobSpec.load(stored).train.log_with == ("tensorboard",)


def test_an_unknown_tracker_is_refused_with_the_names_and_a_guess():
    message = refusal('log_with = ["tensorbord"]')
    assert message == (
        "job.toml: train.log_with: unknown tracker 'tensorbord' (expected one of: tensorboard, wandb, mlflow); did you mean 'tensorboard'?"
    )


def test_a_tracker_listed_twice_or_not_a_list_is_refused():
    assert "tracker 'tensorboard' is listed twice" in refusal('log_with = ["tensorboard", "tensorboard"]')
    assert 'expected a list of tracker names, found a string ("tensorboard")' in refusal('log_with = "tensorboard"')


def test_a_tracker_whose_package_is_missing_is_refused_with_the_pip_command(monkeypatch):
    monkeypatch.setattr(trackers, "_installed", lambda module: module != "mlflow")
    message = refusal('log_with = ["tensorboard", "mlflow"]')
    assert message == (
        'job.toml: train.log_with: tracker "mlflow" needs the Python package mlflow, which is not installed where oomguard runs: '
        '`pip install mlflow` into oomguard\'s environment, or remove "mlflow" from log_with'
    )


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_where_it_is_not_installed_is_refused_when_the_file_is_checked():
    assert "`pip install wandb`" in refusal('log_with = ["wandb"]')


def test_a_command_job_is_told_its_script_logs_its_own():
    message = refusal('log_with = ["tensorboard"]', COMMAND_JOB.format(extra=""))
    assert message.startswith("job.toml: train.log_with: a command job's script has its own")
    assert "log_with" not in parse(text=COMMAND_JOB.format(extra="")).to_dict()["train"]
