import pytest
import torch
from PIL import Image

from oomguard.jobs.data import ImageSource, SampleOrder, step_generator, step_seed

# SampleOrder ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_items", "batch_size"), [(16, 4), (10, 3), (7, 7), (5, 8), (1, 2), (100, 16)])
@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_indices_depend_only_on_seed_and_step(num_items, batch_size, seed):
    steps = [0, 1, 2, 3, 10, 57]
    first = SampleOrder(num_items, seed)
    forward = {step: first.indices(step, batch_size) for step in steps}
    # a fresh order asked in another order (as a resumed run would) gives the same samples
    second = SampleOrder(num_items, seed)
    backward = {step: second.indices(step, batch_size) for step in reversed(steps)}
    assert forward == backward
    # ... and asking again gives the same again
    assert {step: first.indices(step, batch_size) for step in steps} == forward
    for indices in forward.values():
        assert len(indices) == batch_size
        assert all(0 <= i < num_items for i in indices)


@pytest.mark.parametrize(("num_items", "seed"), [(16, 0), (10, 3), (7, 99), (1, 0), (1000, 5)])
def test_each_epoch_is_a_permutation(num_items, seed):
    order = SampleOrder(num_items, seed)
    epochs = [order.indices(epoch, num_items) for epoch in range(4)]  # batch = one epoch
    for epoch in epochs:
        assert sorted(epoch) == list(range(num_items))
    if num_items > 6:
        assert len({tuple(e) for e in epochs}) == len(epochs), "epochs are shuffled differently"
        assert epochs[0] != list(range(num_items)), "the order is shuffled"


@pytest.mark.parametrize(("num_items", "batch_size"), [(10, 4), (10, 3), (7, 2), (16, 5), (3, 8)])
def test_batches_straddle_epochs_in_one_stream(num_items, batch_size):
    order = SampleOrder(num_items, seed=7)
    steps = 3 * num_items  # several epochs' worth
    stream = [i for step in range(steps) for i in order.indices(step, batch_size)]
    for epoch in range(steps * batch_size // num_items):
        window = stream[epoch * num_items : (epoch + 1) * num_items]
        assert sorted(window) == list(range(num_items)), f"epoch {epoch} is a permutation"
        assert window == order.indices(epoch, num_items)


def test_a_straddling_batch_ends_one_epoch_and_starts_the_next():
    order = SampleOrder(10, seed=3)
    epoch0, epoch1 = order.indices(0, 10), order.indices(1, 10)
    assert order.indices(2, 4) == epoch0[8:] + epoch1[:2]  # positions 8..11


def test_the_same_positions_with_a_different_split():
    """Splitting a batch differently (micro-batches) never changes which samples a step sees."""
    order = SampleOrder(13, seed=11)
    big = [order.indices(step, 6) for step in range(5)]
    small = [order.indices(step, 3) for step in range(10)]
    assert [i for b in big for i in b] == [i for s in small for i in s]


@pytest.mark.parametrize("seeds", [(0, 1), (1, 2), (5, 500)])
def test_seeds_give_different_orders(seeds):
    a, b = (SampleOrder(50, seed).indices(0, 50) for seed in seeds)
    assert a != b


def test_orders_do_not_share_state():
    a, b = SampleOrder(20, 1), SampleOrder(20, 2)
    expected_a, expected_b = SampleOrder(20, 1).indices(3, 7), SampleOrder(20, 2).indices(3, 7)
    for _ in range(3):  # interleaved, through the shared permutation cache
        assert a.indices(3, 7) == expected_a
        assert b.indices(3, 7) == expected_b


# step_generator -----------------------------------------------------------------------------


@pytest.mark.parametrize(("seed", "step"), [(0, 0), (0, 1), (42, 0), (42, 10_000), (2**40, 3)])
def test_step_generator_is_reproducible(seed, step):
    a = torch.randn(8, generator=step_generator(seed, step))
    b = torch.randn(8, generator=step_generator(seed, step))
    assert torch.equal(a, b)
    assert step_generator(seed, step).initial_seed() == step_seed(seed, step)


def test_step_generators_differ_between_steps_and_seeds():
    draws = {(seed, step): tuple(torch.randint(0, 2**31, (4,), generator=step_generator(seed, step)).tolist()) for seed in range(4) for step in range(50)}
    assert len(set(draws.values())) == len(draws)


@pytest.mark.parametrize(("seed", "step"), [(0, 0), (1, 1), (-1, 5), (2**62, 2**62)])
def test_step_seed_is_a_valid_torch_seed(seed, step):
    value = step_seed(seed, step)
    assert 0 <= value < 2**63
    torch.Generator().manual_seed(value)


# ImageSource: synthetic ---------------------------------------------------------------------


@pytest.mark.parametrize("resolution", [8, 16, 32])
def test_synthetic_images(resolution):
    source = ImageSource("synthetic:12", resolution)
    assert len(source) == 12
    batch = source.load([0, 5, 11, 5])
    assert batch.shape == (4, 3, resolution, resolution)
    assert batch.dtype == torch.float32
    assert batch.min() >= -1 and batch.max() <= 1
    assert torch.equal(batch[1], batch[3]), "an index always gives the same image"
    assert not torch.equal(batch[0], batch[1])
    assert batch.std() > 0.05, "not a flat image"


def test_synthetic_images_are_deterministic_across_instances():
    a = ImageSource("synthetic:8", 16).load(list(range(8)))
    b = ImageSource("synthetic:8", 16).load(list(reversed(range(8))))
    assert torch.equal(a, b.flip(0))


def test_synthetic_images_do_not_touch_the_global_random_state():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    ImageSource("synthetic:4", 8).load([0, 1, 2, 3])
    assert torch.equal(torch.rand(3), expected)


# ImageSource: a folder of files -------------------------------------------------------------

RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)


def bands(width, height, vertical=True):
    """Red on the first fifth of the long side, blue on the last, green between."""
    image = Image.new("RGB", (width, height), GREEN)
    long = width if vertical else height
    edge = long // 5
    for colour, (start, end) in ((RED, (0, edge)), (BLUE, (long - edge, long))):
        image.paste(colour, (start, 0, end, height) if vertical else (0, start, width, end))
    return image


@pytest.fixture
def folder(tmp_path):
    images = tmp_path / "images"
    (images / "nested").mkdir(parents=True)
    Image.new("RGB", (16, 16), RED).save(images / "a.png")
    Image.new("RGB", (40, 40), GREEN).save(images / "b.PNG")
    Image.new("L", (16, 16), 255).save(images / "nested" / "c.png")  # grey scale: becomes RGB
    Image.new("RGBA", (16, 16), (0, 0, 255, 10)).save(images / "d.png")
    (images / "notes.txt").write_text("not an image")
    return images


def test_folder_finds_images_sorted_and_recursively(folder):
    source = ImageSource(str(folder), 16)
    assert len(source) == 4
    batch = source.load([0, 1, 2, 3])
    assert batch.shape == (4, 3, 16, 16)
    assert batch.min() >= -1 and batch.max() <= 1
    # sorted by path: a.png, b.PNG, d.png, nested/c.png
    expected = torch.tensor([[1, -1, -1], [-1, 1, -1], [-1, -1, 1], [1, 1, 1]], dtype=torch.float32)
    torch.testing.assert_close(batch.mean(dim=(2, 3)), expected)


def test_folder_ignores_directories_that_look_like_images(folder):
    (folder / "looks_like.png").mkdir()
    source = ImageSource(str(folder), 16)
    assert len(source) == 4
    assert source.load([0, 1, 2, 3]).shape == (4, 3, 16, 16)


def test_folder_without_images_is_an_error(tmp_path):
    (tmp_path / "notes.txt").write_text("nothing to see")
    with pytest.raises(ValueError, match="no images"):
        ImageSource(str(tmp_path), 16)


@pytest.mark.parametrize(
    ("size", "vertical"),
    [((64, 32), True), ((96, 32), True), ((32, 64), False), ((48, 16), True), ((17, 50), False)],
)
def test_non_square_images_are_resized_and_centre_cropped(tmp_path, size, vertical):
    """Red | green | blue bands along the long side: the centre crop is the green middle."""
    bands(*size, vertical=vertical).save(tmp_path / "wide.png")
    resolution = 16
    image = ImageSource(str(tmp_path), resolution).load([0])[0]
    assert image.shape == (3, resolution, resolution)
    # Not squashed: no red or blue band inside the crop (resampling may blur its edges).
    inner = image[:, 2:-2, 2:-2]
    torch.testing.assert_close(inner[1], torch.ones_like(inner[1]), atol=0.05, rtol=0)
    assert inner[0].max() < -0.9 and inner[2].max() < -0.9
    # The short side fills the resolution entirely: green across the whole short side.
    middle = image[1, :, resolution // 2] if vertical else image[1, resolution // 2, :]
    assert (middle > 0.9).all()


@pytest.mark.parametrize("resolution", [8, 16, 24])
def test_square_images_are_scaled(tmp_path, resolution):
    Image.new("RGB", (50, 50), (255, 128, 0)).save(tmp_path / "x.png")
    image = ImageSource(str(tmp_path), resolution).load([0])[0]
    assert image.shape == (3, resolution, resolution)
    torch.testing.assert_close(image[:, 0, 0], torch.tensor([1.0, 128 / 127.5 - 1, -1.0]))


def test_file_images_are_the_same_every_time(folder):
    source = ImageSource(str(folder), 16)
    assert torch.equal(source.load([2, 0]), ImageSource(str(folder), 16).load([2, 0]))
