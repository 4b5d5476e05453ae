"""Aspect-ratio buckets (jobs/buckets.py) and the answer to one bucket's spike
(strategies/bucket_spike.py)."""

from __future__ import annotations

from collections import Counter

import pytest

from oomguard.jobs.buckets import Bucket, BucketedOrder, assign_bucket, bucket_sizes
from oomguard.strategies.bucket_spike import bucket_micro_batch
from oomguard.strategies.doctor import describe_oom
from oomguard.strategies.outcome import Outcome


def test_the_buckets_of_512_at_a_step_of_64_are_kohyas():
    # sd-scripts' defaults (min 256, max 1024, steps of 64) at 512: the seventeen it lists.
    sizes = sorted((b.width, b.height) for b in bucket_sizes(512, 64))
    assert sizes == [
        (256, 832), (256, 896), (256, 960), (256, 1024), (320, 704), (320, 768), (384, 640), (448, 576), (512, 512),
        (576, 448), (640, 384), (704, 320), (768, 320), (832, 256), (896, 256), (960, 256), (1024, 256),
    ]
    assert all(b.area <= 512 * 512 and b.width % 64 == 0 and b.height % 64 == 0 for b in bucket_sizes(512, 64))


def test_an_image_goes_to_the_bucket_of_the_nearest_aspect_ratio():
    buckets = bucket_sizes(512, 64)
    assert assign_bucket((480, 640), buckets, 512, 64, no_upscale=False) == Bucket(576, 448)  # 4:3 landscape
    assert assign_bucket((1000, 1000), buckets, 512, 64, no_upscale=False) == Bucket(512, 512)
    assert assign_bucket((2000, 500), buckets, 512, 64, no_upscale=False) == Bucket(256, 1024)  # tall


def test_without_upscaling_a_small_image_keeps_its_size_and_a_large_one_shrinks_to_the_area():
    buckets = bucket_sizes(64, 8)
    assert assign_bucket((30, 45), buckets, 64, 8, no_upscale=True) == Bucket(40, 24)
    large = assign_bucket((300, 200), buckets, 64, 8, no_upscale=True)
    assert large.area <= 64 * 64 and large.height > large.width


def test_each_step_draws_one_bucket_and_an_epoch_trains_on_every_image():
    image_buckets = [Bucket(64, 64)] * 3 + [Bucket(80, 48)] * 9 + [Bucket(48, 80)] * 5
    order = BucketedOrder(image_buckets, batch_size=4, seed=7)
    assert order.steps_per_epoch == 1 + 3 + 2
    seen = Counter()
    for step in range(order.steps_per_epoch):
        bucket, indices = order.batch(step)
        assert len(indices) == 4 and {image_buckets[i] for i in indices} == {bucket}
        seen.update(set(indices))
    assert set(seen) == set(range(len(image_buckets)))
    # A function of (seed, step) only: a second order, asked in another order, agrees.
    again = BucketedOrder(image_buckets, batch_size=4, seed=7)
    assert [again.batch(s) for s in reversed(range(20))] == [order.batch(s) for s in reversed(range(20))]
    assert order.largest() == Bucket(64, 64)
    assert order.batch(order.first_step_of(Bucket(64, 64)))[0] == Bucket(64, 64)


def test_a_larger_bucket_that_runs_out_where_smaller_ones_fit_gets_its_own_smaller_micro_batch():
    choices = [1, 2, 4]
    assert bucket_micro_batch((64, 64), {(80, 48)}, 4, choices) == 2
    assert bucket_micro_batch((64, 64), {(80, 48)}, 2, choices) == 1
    # Not the bucket's own: it fitted before (the cause is elsewhere), nothing smaller fitted
    # (the plan itself does not fit), or nothing smaller to go to.
    assert bucket_micro_batch((64, 64), {(64, 64), (80, 48)}, 4, choices) is None
    assert bucket_micro_batch((64, 64), set(), 4, choices) is None
    assert bucket_micro_batch((80, 48), {(64, 64)}, 4, choices) is None
    assert bucket_micro_batch((72, 56), {(80, 48), (64, 64)}, 4, choices) is None  # a larger one fitted
    assert bucket_micro_batch((64, 64), {(80, 48)}, 1, choices) is None


def test_an_oom_names_the_shape_of_the_batch_it_ran_out_on():
    outcome = Outcome.from_dict({"kind": "oom", "step": 7, "phase": "backward", "batch_shape": [4, 64, 80]})
    assert outcome.batch_shape == (4, 64, 80)
    assert "at step 7 (a micro-batch of 4 at 80x64 px)" in describe_oom(outcome)
    with pytest.raises(TypeError, match="batch_shape must be three positive integers"):
        Outcome.from_dict({"kind": "oom", "batch_shape": [4, "64", 80]})
