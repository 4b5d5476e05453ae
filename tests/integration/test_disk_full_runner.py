"""The runner on a full disk (a tmpfs of a few MiB, as root): it stops before a checkpoint it has
no room for, or when a write runs out of room half-way, with outcome "disk_full" (the path, the
bytes it needs and the bytes free), removes its partial write, keeps every verified checkpoint,
and a later attempt with room goes on to the weights of an uninterrupted run. And within a disk
budget ([resources] disk), with checkpoints kept for good (train.keep_every_steps)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
import torch

from oomguard.jobs import checkpoints
from oomguard.jobs.disk_guard import room_for, writing_into
from oomguard.jobs.disk_space import RESERVE_MIN_BYTES, DiskFull
from oomguard.strategies.outcome import EXIT_DISK_FULL, EXIT_FINISHED
from oomguard.jobs.spec import parse_job_text
from tests.jobs_helpers import TINY_JOB, assert_weights_allclose, checkpoint_steps, load_final, run_runners, tiny_job, write_attempt
from tests.small_disk import MiB, fill, free, small_disk

JOB = tiny_job("disk-full", batch_size=8, max_steps=8, checkpoint_every_steps=2)


def test_the_runner_stops_before_a_checkpoint_it_has_no_room_for_and_resumes_to_the_same_weights(tmp_path: Path) -> None:
    baseline_work = tmp_path / "baseline"
    write_attempt(tmp_path / "baseline-attempt", JOB, baseline_work)
    with small_disk(tmp_path / "disk", 8 * MiB) as disk:
        workdir = disk / "work"
        workdir.mkdir()
        # Room for the first checkpoint (about 0.6 MiB and the 0.25 MiB reserve), not for the
        # second beside it: the last verified one is never deleted before a newer one verifies.
        ballast = fill(disk, leave=5 * MiB // 4)
        write_attempt(tmp_path / "attempt-1", JOB, workdir)
        baseline, full = run_runners([tmp_path / "baseline-attempt", tmp_path / "attempt-1"])
        assert baseline.returncode == EXIT_FINISHED, baseline
        assert full.returncode == EXIT_DISK_FULL, full
        outcome = full.outcome
        assert (outcome.kind, outcome.step, outcome.phase) == ("disk_full", 4, "checkpoint")
        assert outcome.disk_path == str(workdir / "checkpoints")
        assert outcome.disk_needed is not None and outcome.disk_free is not None and outcome.disk_needed > outcome.disk_free
        assert outcome.disk_needed - RESERVE_MIN_BYTES > 512 * 1024  # the checkpoint's own bytes, as its manifest records them
        assert f"no room for a checkpoint at {workdir / 'checkpoints'}: needs" in outcome.message
        assert checkpoint_steps(workdir) == [2] and not list((workdir / "checkpoints").glob(".tmp-*"))
        checkpoints.verify(workdir / "checkpoints" / "step-000002")

        ballast.unlink()
        write_attempt(tmp_path / "attempt-2", JOB, workdir, number=2)
        (resumed,) = run_runners([tmp_path / "attempt-2"])
        assert resumed.returncode == EXIT_FINISHED, resumed
        assert resumed.outcome.resumed_from == 2
        assert_weights_allclose(load_final(workdir), load_final(baseline_work))


@pytest.mark.parametrize("how", ["torch.save", "open"])
def test_a_write_that_runs_out_of_room_half_way_leaves_nothing_and_keeps_the_last_checkpoint(tmp_path: Path, how: str) -> None:
    """The room check passed, and the write still found no room: torch.save then says
    "unexpected pos ..." rather than ENOSPC, so a failure with almost nothing left counts too."""
    with small_disk(tmp_path / "disk", 2 * MiB) as disk:
        folder = disk / "checkpoints"

        def small(directory: Path) -> None:
            torch.save({"w": torch.zeros(1000)}, directory / "state.pt")

        def too_big(directory: Path) -> None:
            if how == "torch.save":
                torch.save({"w": torch.zeros(1 << 20)}, directory / "state.pt")  # 4 MiB
            else:
                with (directory / "state.bin").open("wb") as f:
                    f.write(b"\0" * (4 * MiB))

        checkpoints.save(folder, 1, {}, small, keep=1)
        before = free(disk)
        with pytest.raises(DiskFull) as raised:
            with room_for(folder, 0, "a checkpoint"):
                checkpoints.save(folder, 2, {}, writing_into(too_big), keep=1)
        # It needs more than it had written when the disk ran out (here: all that was free).
        assert raised.value.path == str(folder) and raised.value.needed is not None and raised.value.needed > before
        assert raised.value.free is not None and raised.value.free >= before - 64 * 1024  # the partial write is gone
        assert [p.name for p in folder.iterdir()] == ["step-000001"]
        assert checkpoints.verify(folder / "step-000001").step == 1


def test_an_error_that_is_not_the_disk_stays_what_it_is(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", 2 * MiB) as disk:

        def broken(directory: Path) -> None:
            raise OSError(errno.EACCES, "Permission denied")

        with pytest.raises(PermissionError), room_for(disk, 0, "a checkpoint"):
            checkpoints.save(disk / "checkpoints", 1, {}, writing_into(broken), keep=1)
        assert list((disk / "checkpoints").iterdir()) == []


def budget_job(name: str, keep: int, extra_train: str, budget: str):
    text = TINY_JOB.format(name=name, batch_size=8, max_steps=8, checkpoint_every_steps=2, keep_checkpoints=keep)
    return parse_job_text(text + extra_train + f'[resources]\ndisk = "{budget}"\n', f"<{name}.toml>", base_dir=Path.cwd())


def test_a_disk_budget_keeps_the_newest_within_it_and_waits_when_what_is_kept_for_good_fills_it(tmp_path: Path) -> None:
    """A checkpoint takes about 0.6 MiB: a budget of 1.5 MiB holds two. Keeping three, the
    oldest goes before the third is written; keeping every one for good, the third waits."""
    trimmed, kept = tmp_path / "trimmed", tmp_path / "kept"
    write_attempt(tmp_path / "trimmed-1", budget_job("trimmed", 3, "", "1.5MiB"), trimmed)
    write_attempt(tmp_path / "kept-1", budget_job("kept", 1, "keep_every_steps = 2\n", "1.5MiB"), kept)
    finished, waiting = run_runners([tmp_path / "trimmed-1", tmp_path / "kept-1"])

    assert finished.returncode == EXIT_FINISHED, finished
    assert "removed checkpoint step-000002 (" in finished.stdout and "within the job's disk budget of 1.5 MiB" in finished.stdout
    assert checkpoint_steps(trimmed) == [4, 6]

    assert waiting.returncode == EXIT_DISK_FULL, waiting
    outcome = waiting.outcome
    assert (outcome.kind, outcome.step, outcome.disk_path, outcome.disk_budget) == ("disk_full", 6, str(kept / "checkpoints"), 3 * MiB // 2)
    assert outcome.disk_needed is not None and outcome.disk_free is not None and outcome.disk_needed > outcome.disk_free
    assert "within the job's disk budget of 1.5 MiB ([resources] disk)" in outcome.message
    assert checkpoint_steps(kept) == [2, 4]  # both kept for good; nothing was removed
    # Its owner makes room (removes the checkpoint of step 2): the next attempt goes on.
    shutil.rmtree(kept / "checkpoints" / "step-000002")
    write_attempt(tmp_path / "kept-2", budget_job("kept", 1, "keep_every_steps = 2\n", "1.5MiB"), kept, number=2)
    (resumed,) = run_runners([tmp_path / "kept-2"])
    assert resumed.returncode == EXIT_FINISHED, resumed
    assert resumed.outcome.resumed_from == 4 and checkpoint_steps(kept) == [4, 6]
