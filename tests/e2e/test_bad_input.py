"""Every malformed job file in tests/bad_jobs is refused, by `oomguard submit` and by the
daemon's spool, with a message naming the problem; the daemon keeps running and a valid job
queued beside them still runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.e2e.conftest import oomguard, tiny_job, wait_for

BAD_JOBS = sorted((Path(__file__).parent.parent / "bad_jobs").glob("*.toml"))


def expected(path: Path) -> str:
    first_line = path.read_text(encoding="utf-8", errors="replace").splitlines()[0]
    assert first_line.startswith("# expect: "), f"{path.name} lacks its '# expect:' line"
    return first_line[len("# expect: "):]


def test_there_are_enough_bad_files() -> None:
    assert len(BAD_JOBS) >= 12


@pytest.mark.parametrize("path", BAD_JOBS, ids=lambda p: p.stem)
def test_submit_refuses_a_bad_job_file(path: Path, tmp_path: Path) -> None:
    result = oomguard("submit", str(path), state_dir=tmp_path / "state", timeout=30)
    assert result.returncode == 2
    assert expected(path) in result.stderr
    assert path.name in result.stderr
    inbox = tmp_path / "state" / "spool" / "inbox"
    assert not inbox.exists() or not list(inbox.iterdir())


@pytest.mark.slow
def test_the_spool_rejects_bad_files_and_runs_good_ones(tmp_path: Path, daemon_factory) -> None:
    daemon = daemon_factory()
    inbox = daemon.state_dir / "spool" / "inbox"
    rejected = daemon.state_dir / "spool" / "rejected"
    # Dropped in by hand, as a user with a shell would: copy, no validation on the way.
    for path in BAD_JOBS:
        shutil.copy(path, inbox / path.name)
    good = oomguard("submit", str(tiny_job(tmp_path, name="good", max_steps=3)), state_dir=daemon.state_dir, check=True)
    assert "queued" in good.stdout

    wait_for(lambda: len(list(rejected.glob("*.error"))) == len(BAD_JOBS), 60, "every bad file to be rejected")
    for path in BAD_JOBS:
        error = (rejected / (path.name + ".error")).read_text()
        assert expected(path) in error, error
        assert (rejected / path.name).exists()
    assert not [p for p in inbox.iterdir() if not p.name.startswith(".")]
    record = daemon.wait_job("good", timeout=120)
    assert record["state"] == "finished"
    assert daemon.alive()
    # Only the good job was recorded.
    assert record["id"] == 1
    assert oomguard("show", "2", state_dir=daemon.state_dir).returncode == 3
