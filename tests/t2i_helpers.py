"""Text-to-image jobs for the tests: a captioned image folder and job files over the tiny
pipelines of tests/pipelines.py."""

from __future__ import annotations

import json
from pathlib import Path

# Peaks of the plain plan (micro-batch 4, nothing saved) of the jobs below, measured with the
# emulated device: about 2.0 MiB for SD LoRA, 2.3 MiB for SDXL full. 1.5 MiB fits neither.
CAP_BELOW_PLAIN = "1.5MiB"


def write_captioned_images(folder: Path, count: int = 8) -> Path:
    """``count`` random images of different sizes and aspect ratios (so resizing and cropping
    matter), captioned half in metadata.jsonl and half in a .txt beside the image."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(count):
        pixels = (rng.random((36 + 6 * i, 40 - 2 * i, 3)) * 255).astype("uint8")
        Image.fromarray(pixels).save(folder / f"image{i}.png")
        caption = f"a photo of thing number {i}, {'red' if i % 2 else 'blue'}"
        if i % 2:
            (folder / f"image{i}.txt").write_text(caption + "\n", encoding="utf-8")
        else:
            rows.append({"file_name": f"image{i}.png", "text": caption})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return folder


def text_to_image_job(
    folder: Path, name: str, pipeline: Path, data: Path, *, method: str = "lora", max_steps: int = 6, probe: bool = False, train: str = "",
) -> Path:
    """A job file in ``folder`` fine-tuning ``pipeline`` on ``data``; its path."""
    lora = "lora_rank = 4\nlora_alpha = 8\n" if method == "lora" else ""
    text = f"""\
name = "{name}"
trainer = "text_to_image"

[data]
source = "{data}"
resolution = 32
random_flip = true

[model]
path = "{pipeline}"
method = "{method}"
{lora}
[train]
batch_size = 4
max_steps = {max_steps}
learning_rate = 1e-3
lr_scheduler = "cosine"
lr_warmup_steps = 1
checkpoint_every_steps = 2
snr_gamma = 5.0
noise_offset = 0.05
{train}
[ladder]
probe = {"true" if probe else "false"}
"""
    path = folder / f"{name}.toml"
    path.write_text(text)
    return path


def final_tensors(final: Path) -> dict[str, object]:
    """Every tensor of every safetensors file under ``final``, by file and name."""
    from safetensors.torch import load_file

    return {f"{file.relative_to(final)}:{key}": value for file in sorted(final.rglob("*.safetensors")) for key, value in load_file(str(file)).items()}
