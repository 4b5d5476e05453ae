"""A text-to-image job file: its [data] (captioned images) and [model] (a pipeline folder and
the method), every mistake a user can make named with its key and its fix, and what the
ladder may do for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomguard.jobs.spec import JobSpec, parse_job_text
from oomguard.jobs.spec.text_to_image import CaptionedDataSpec, PipelineSpec
from oomguard.strategies.errors import JobFileError

CONFIGS = {
    "unet": ("config.json", {"block_out_channels": [4, 8]}),
    "vae": ("config.json", {"block_out_channels": [4, 8]}),
    "text_encoder": ("config.json", {}),
    "tokenizer": ("tokenizer_config.json", {}),
    "scheduler": ("scheduler_config.json", {}),
}
SDXL_CONFIGS = {"text_encoder_2": ("config.json", {}), "tokenizer_2": ("tokenizer_config.json", {})}


def pipeline_folder(root: Path, *, sdxl: bool = False, unet_blocks: int = 2) -> Path:
    """The files a saved pipeline has that intake looks at (config files, no weights)."""
    folder = root / ("sdxl" if sdxl else "sd")
    for part, (name, config) in {**CONFIGS, **(SDXL_CONFIGS if sdxl else {})}.items():
        (folder / part).mkdir(parents=True)
        if part == "unet":
            config = {"block_out_channels": [4] * unet_blocks}
        (folder / part / name).write_text(json.dumps(config))
    (folder / "model_index.json").write_text("{}")
    return folder


def image_folder(root: Path, count: int = 3) -> Path:
    folder = root / "images"
    folder.mkdir()
    rows = []
    for i in range(count):
        (folder / f"{i}.png").write_bytes(b"")  # intake reads captions, not pixels
        rows.append({"file_name": f"{i}.png", "text": f"caption {i}"})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    return pipeline_folder(tmp_path), image_folder(tmp_path)


def job_text(pipeline: Path, images: Path, *, model: str = "", data: str = "", train: str = "", ladder: str = "") -> str:
    return f"""
name = "t2i"
trainer = "text_to_image"
[data]
source = "{images}"
resolution = 32
{data}
[model]
path = "{pipeline}"
{model}
[train]
batch_size = 4
max_steps = 10
learning_rate = 1e-4
{train}
{ladder}
"""


def parse(text: str, tmp_path: Path) -> JobSpec:
    return parse_job_text(text, tmp_path / "job.toml")


def error_of(text: str, tmp_path: Path) -> str:
    with pytest.raises(JobFileError) as caught:
        parse(text, tmp_path)
    return str(caught.value)


def test_a_lora_job_parses_with_its_defaults(tmp_path, folders):
    pipeline, images = folders
    job = parse(job_text(pipeline, images, model='method = "lora"\nlora_rank = 8', train="snr_gamma = 5.0\nnoise_offset = 0.1"), tmp_path)
    assert job.data == CaptionedDataSpec(source=str(images), resolution=32, center_crop=True, random_flip=False, caption_column="text")
    assert job.model == PipelineSpec(path=str(pipeline), method="lora", lora_rank=8)
    assert job.model.alpha == 8.0 and job.model.target_modules == ("to_k", "to_q", "to_v", "to_out.0")
    assert (job.train.snr_gamma, job.train.noise_offset, job.train.lr_scheduler) == (5.0, 0.1, "constant_with_warmup")


def test_a_stored_spec_comes_back_as_it_was(tmp_path, folders):
    pipeline, images = folders
    job = parse(job_text(pipeline, images, model='method = "lora"\nlora_alpha = 2.5\ntarget_modules = ["to_q"]', train='lr_scheduler = "cosine"'), tmp_path)
    stored = json.loads(json.dumps(job.to_dict()))
    assert JobSpec.load(stored) == job
    assert JobSpec.parse(stored) == job


def test_a_lora_job_cannot_take_the_lora_rung_but_a_full_fine_tune_can(tmp_path, folders):
    pipeline, images = folders
    allow = '[ladder]\nallow = ["micro_batch", "checkpointing", "lora", "base_quantization"]'
    lora = parse(job_text(pipeline, images, model='method = "lora"', ladder=allow), tmp_path)
    full = parse(job_text(pipeline, images, ladder=allow), tmp_path)
    assert lora.policy().allow == ("micro_batch", "checkpointing")
    assert full.policy().allow == ("micro_batch", "checkpointing", "lora", "base_quantization")


def test_an_sdxl_folder_is_accepted_with_both_second_parts(tmp_path):
    job = parse(job_text(pipeline_folder(tmp_path, sdxl=True), image_folder(tmp_path)), tmp_path)
    assert job.model.path.endswith("sdxl")


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda p: __import__("shutil").rmtree(p / "unet"), "model.path: {p} has no unet/ folder"),
        (lambda p: (p / "vae" / "config.json").unlink(), "model.path: {p}/vae has no config.json"),
        (lambda p: (p / "text_encoder_2").mkdir(), "model.path: {p} has no tokenizer_2/ folder"),
        (lambda p: (p / "unet" / "config.json").write_text("{not json"), "model.path: cannot read {p}/unet/config.json"),
    ],
)
def test_a_broken_pipeline_folder_is_named_with_the_fix(tmp_path, folders, damage, expected):
    pipeline, images = folders
    damage(pipeline)
    message = error_of(job_text(pipeline, images), tmp_path)
    assert expected.format(p=pipeline) in message
    assert "save" in message  # the fix: a folder as save_pretrained writes it


def test_a_missing_pipeline_folder(tmp_path, folders):
    _, images = folders
    message = error_of(job_text(tmp_path / "nowhere", images), tmp_path)
    assert f"model.path: {tmp_path / 'nowhere'} does not exist" in message


def test_a_resolution_the_vae_and_unet_cannot_halve(tmp_path):
    pipeline = pipeline_folder(tmp_path, unet_blocks=3)  # VAE 2x, UNet 4x: multiples of 8
    message = error_of(job_text(pipeline, image_folder(tmp_path)).replace("resolution = 32", "resolution = 36"), tmp_path)
    assert "data.resolution: 36 is not divisible by 8" in message and "use a multiple of 8" in message


def test_an_image_without_a_caption_names_both_ways_to_give_one(tmp_path, folders):
    pipeline, images = folders
    (images / "extra.jpg").write_bytes(b"")
    message = error_of(job_text(pipeline, images), tmp_path)
    assert f"data.source: image {images / 'extra.jpg'} has no caption" in message
    assert '"file_name": "extra.jpg"' in message and str(images / "extra.txt") in message


def test_a_caption_beside_the_image_counts(tmp_path, folders):
    pipeline, images = folders
    (images / "extra.jpg").write_bytes(b"")
    (images / "extra.txt").write_text("a dog ✓", encoding="utf-8")
    assert parse(job_text(pipeline, images), tmp_path).data.source == str(images)


def test_a_caption_file_that_is_not_utf8(tmp_path, folders):
    pipeline, images = folders
    (images / "extra.jpg").write_bytes(b"")
    (images / "extra.txt").write_bytes("caf\xe9".encode("latin-1"))
    message = error_of(job_text(pipeline, images), tmp_path)
    assert f"data.source: caption file {images / 'extra.txt'} is not UTF-8 text (byte 3): save it as UTF-8" in message


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", "metadata.jsonl line 4 is not JSON"),
        ('{"text": "x"}', 'metadata.jsonl line 4 has no "file_name" string'),
        ('{"file_name": "0.png", "caption": "x"}', 'metadata.jsonl line 4 has no "text" string (keys: caption, file_name)'),
        ('{"file_name": "gone.png", "text": "x"}', "metadata.jsonl line 4 names 'gone.png', which is not a file under"),
    ],
)
def test_a_bad_metadata_line_is_named_by_its_number(tmp_path, folders, line, expected):
    pipeline, images = folders
    with (images / "metadata.jsonl").open("a") as metadata:
        metadata.write(line + "\n")
    assert expected in error_of(job_text(pipeline, images), tmp_path)


def test_the_caption_column_can_be_named(tmp_path, folders):
    pipeline, images = folders
    (images / "metadata.jsonl").write_text("".join(json.dumps({"file_name": f"{i}.png", "prompt": "x"}) + "\n" for i in range(3)))
    assert "set data.caption_column" in error_of(job_text(pipeline, images), tmp_path)
    assert parse(job_text(pipeline, images, data='caption_column = "prompt"'), tmp_path).data.caption_column == "prompt"


def test_a_data_folder_without_images(tmp_path):
    pipeline, empty = pipeline_folder(tmp_path), tmp_path / "empty"
    empty.mkdir()
    assert "data.source: no image files (.png, .jpg, .jpeg, .webp, .bmp) in folder" in error_of(job_text(pipeline, empty), tmp_path)


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("lora_rank = 8", 'model.lora_rank: is for method = "lora"; remove it, or set model.method = "lora"'),
        ('method = "lora"\ntarget_modules = []', "model.target_modules: expected a non-empty list of module names"),
        ('method = "lora"\nlora_rank = 0', "model.lora_rank: expected an integer in 1..1024, found 0"),
        ('method = "dreambooth"', 'model.method: expected one of "full", "lora", found "dreambooth"'),
        ("block_out_channels = [32]", "model.block_out_channels: unknown key (expected one of: lora_alpha, lora_rank, method, path, target_modules)"),
    ],
)
def test_bad_model_keys(tmp_path, folders, model, expected):
    pipeline, images = folders
    assert expected in error_of(job_text(pipeline, images, model=model), tmp_path)


def test_text_to_image_train_keys_are_refused_for_the_unconditional_trainer(tmp_path):
    text = """
name = "u"
trainer = "unconditional"
[data]
source = "synthetic:4"
resolution = 16
[model]
block_out_channels = [8, 16]
down_block_types = ["DownBlock2D", "DownBlock2D"]
up_block_types = ["UpBlock2D", "UpBlock2D"]
norm_num_groups = 4
[train]
batch_size = 2
max_steps = 2
learning_rate = 1e-4
snr_gamma = 5.0
"""
    assert "train.snr_gamma: unknown key" in error_of(text, tmp_path)


def test_a_bad_lr_scheduler_is_named_with_the_choices(tmp_path, folders):
    pipeline, images = folders
    message = error_of(job_text(pipeline, images, train='lr_scheduler = "cosine_annealing"'), tmp_path)
    assert 'train.lr_scheduler: expected one of "constant_with_warmup", "constant", "linear", "cosine"' in message


@pytest.mark.parametrize("name", ["text_to_image_lora.toml", "text_to_image_full.toml"])
def test_the_example_job_files_are_valid(name):
    # Their folders are the user's to fill in: the keys and values are checked, not the files.
    path = Path(__file__).resolve().parents[2] / "jobs" / "examples" / name
    job = parse_job_text(path.read_text(), path, check_files=False)
    assert job.trainer == "text_to_image" and job.policy().allow


def test_samples_while_training_parse_and_come_back_as_they_were(tmp_path, folders):
    pipeline, images = folders
    job = parse(job_text(pipeline, images, train='sample_every_steps = 500\nsample_prompts = ["a red cat", "a blue dog"]'), tmp_path)
    assert (job.train.sample_every_steps, job.train.sample_prompts, job.train.sample_inference_steps) == (500, ("a red cat", "a blue dog"), 20)
    stored = json.loads(json.dumps(job.to_dict()))
    assert JobSpec.load(stored) == job
    assert JobSpec.parse(stored) == job
    assert parse(job_text(pipeline, images), tmp_path).train.sample_every_steps is None


@pytest.mark.parametrize(
    ("train", "expected"),
    [
        ("sample_every_steps = 10", 'train.sample_every_steps: is set but train.sample_prompts is not: add e.g. sample_prompts = ["a photo of a cat"]'),
        ('sample_prompts = ["a cat"]', "train.sample_prompts: is set but train.sample_every_steps is not: add e.g. sample_every_steps = 500"),
        ('sample_every_steps = 10\nsample_prompts = ["a cat", ""]', "train.sample_prompts: expected a list of non-empty prompts"),
        ("sample_every_steps = 10\nsample_prompts = 3", "train.sample_prompts: expected a list of non-empty prompts"),
        ('sample_every_steps = 10\nsample_prompts = ["a cat"]\nsample_inference_steps = 0', "train.sample_inference_steps: expected an integer"),
        ("sample_every_steps = 10\nsample_prompts = [" + ", ".join(['"p"'] * 17) + "]", "train.sample_prompts: expected at most 16 prompts"),
    ],
)
def test_bad_sample_keys_name_the_fix(tmp_path, folders, train, expected):
    pipeline, images = folders
    assert expected in error_of(job_text(pipeline, images, train=train), tmp_path)


def test_buckets_are_stored_only_when_on_and_no_upscale_needs_them(tmp_path, folders):
    plain = parse(job_text(*folders), tmp_path)
    assert not plain.data.buckets and "buckets" not in plain.data.to_dict()
    bucketed = parse(job_text(*folders, data="buckets = true\nbucket_no_upscale = true\n"), tmp_path)
    assert bucketed.data.buckets and bucketed.data.bucket_no_upscale
    assert JobSpec.load(json.loads(json.dumps(bucketed.to_dict()))) == bucketed
    assert "data.bucket_no_upscale: is for aspect-ratio buckets; add data.buckets = true, or remove it" in error_of(
        job_text(*folders, data="bucket_no_upscale = true\n"), tmp_path
    )
