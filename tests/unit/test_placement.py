"""Placement: which GPUs a job gets, or why it waits."""

from __future__ import annotations

import pytest

from oomguard.daemon.gpus import GpuState
from oomguard.daemon.placement import Holder, Need, Placed, Waiting, place

MiB = 2**20


def gpu(index: int, used: int = 0, total: int = 64 * MiB) -> GpuState:
    return GpuState(index=index, name="test", total=total, used=used)


def test_an_exclusive_job_takes_the_emptiest_free_gpu():
    assert place(Need(1, False, None), [gpu(0, used=1 * MiB), gpu(1)], {}) == Placed((1,))


def test_an_exclusive_job_never_joins_another_job():
    where = place(Need(1, False, 4 * MiB), [gpu(0), gpu(1)], {0: [Holder(7, share=True)], 1: [Holder(8, share=False)]})
    assert isinstance(where, Waiting)
    assert where.reason == "needs 1 GPU: GPU 0 is taken by job 7; GPU 1 is taken by job 8"


def test_sharing_jobs_share_by_memory_and_fill_the_fullest_gpu_first():
    holders = {0: [Holder(1, share=True, need_bytes=20 * MiB, used_bytes=20 * MiB)], 1: [Holder(2, share=True, need_bytes=10 * MiB, used_bytes=10 * MiB)]}
    gpus = [gpu(0, used=20 * MiB), gpu(1, used=10 * MiB)]
    assert place(Need(1, True, 30 * MiB), gpus, holders) == Placed((0,))
    assert place(Need(1, True, 50 * MiB), gpus, holders) == Placed((1,))
    assert isinstance(place(Need(1, True, 60 * MiB), gpus, holders), Waiting)


def test_memory_promised_to_a_starting_job_is_not_free():
    # Job 1 will need 40 MiB and holds 5 so far: only 64 - 5 - 35 = 24 MiB are really free.
    holders = {0: [Holder(1, share=True, need_bytes=40 * MiB, used_bytes=5 * MiB)]}
    where = place(Need(1, True, 30 * MiB), [gpu(0, used=5 * MiB)], holders)
    assert isinstance(where, Waiting) and "promised to jobs starting there" in where.reason
    assert place(Need(1, True, 20 * MiB), [gpu(0, used=5 * MiB)], holders) == Placed((0,))


def test_a_sharing_job_of_unknown_need_does_not_join_others():
    where = place(Need(1, True, None), [gpu(0, used=5 * MiB)], {0: [Holder(1, share=True, need_bytes=5 * MiB, used_bytes=5 * MiB)]})
    assert isinstance(where, Waiting) and "taken by job 1" in where.reason


def test_an_unknown_need_waits_for_a_nearly_empty_gpu():
    where = place(Need(1, False, None), [gpu(0, used=20 * MiB)], {})
    assert isinstance(where, Waiting)
    assert "the job's need is not known yet" in where.reason and "resources.memory" in where.reason
    assert place(Need(1, False, 10 * MiB), [gpu(0, used=20 * MiB)], {}) == Placed((0,))


def test_a_neighbour_holding_memory_makes_a_job_wait_for_what_it_needs():
    where = place(Need(1, False, 8 * MiB), [gpu(0, used=60 * MiB)], {})
    assert isinstance(where, Waiting)
    assert where.reason == "needs 1 GPU: GPU 0 has 4.0 MiB free of 64.0 MiB, the job needs 8.0 MiB"


@pytest.mark.parametrize(("wanted", "expected"), [(2, Placed((0, 2))), (3, None)])
def test_several_gpus(wanted, expected):
    gpus = [gpu(0), gpu(1), gpu(2)]
    where = place(Need(wanted, False, None), gpus, {1: [Holder(4, share=False)]})
    if expected is None:
        assert isinstance(where, Waiting) and where.reason.startswith("needs 3 GPUs: GPU 1 is taken by job 4")
    else:
        assert where == expected


def test_more_gpus_than_the_box_has():
    where = place(Need(3, False, None), [gpu(0), gpu(1)], {})
    assert isinstance(where, Waiting) and where.reason == "needs 3 GPUs; this box has 2 (lower resources.gpus)"


def test_no_one_joins_a_sharing_job_that_is_still_measuring():
    where = place(Need(1, True, 4 * MiB), [gpu(0, used=2 * MiB)], {0: [Holder(1, share=True, need_bytes=None, used_bytes=2 * MiB)]})
    assert isinstance(where, Waiting) and "taken by job 1" in where.reason
