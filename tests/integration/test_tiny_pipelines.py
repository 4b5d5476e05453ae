"""The tiny pipeline folders the text-to-image tests train from (tests/pipelines.py) are what
a user's folder is: diffusers' own pipelines load them offline and generate with them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.pipelines import MAX_LENGTH, save_tiny_pipeline, tiny_tokenizer

SD_PARTS = {"unet", "vae", "text_encoder", "tokenizer", "scheduler"}


def test_any_caption_tokenizes_to_clips_length_without_an_unknown_token() -> None:
    tokenizer = tiny_tokenizer()
    ids = tokenizer(["a red cat", "ünïcode ✓ and\ttabs"], padding="max_length", max_length=tokenizer.model_max_length, truncation=True).input_ids
    assert [len(row) for row in ids] == [MAX_LENGTH, MAX_LENGTH]
    assert tokenizer.decode(ids[1], skip_special_tokens=True) == "ünïcode ✓ and tabs"  # whitespace runs become one space


@pytest.mark.parametrize("layout", ["sd", "sdxl"])
def test_a_saved_tiny_pipeline_loads_offline_and_generates(tmp_path: Path, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a download attempt fails instead of hanging
    folder = save_tiny_pipeline(tmp_path / layout, layout)  # type: ignore[arg-type]
    parts = {entry.name for entry in folder.iterdir() if entry.is_dir()}
    expected = SD_PARTS | ({"text_encoder_2", "tokenizer_2"} if layout == "sdxl" else set())
    assert parts == expected and "_class_name" in json.loads((folder / "model_index.json").read_text())
    pipeline_class = StableDiffusionPipeline if layout == "sd" else StableDiffusionXLPipeline
    pipeline = pipeline_class.from_pretrained(folder)
    images = pipeline("a red cat", num_inference_steps=2, height=32, width=32, output_type="np").images
    assert images.shape == (1, 32, 32, 3) and np.isfinite(images).all()
    assert os.environ["HF_HUB_OFFLINE"] == "1"
