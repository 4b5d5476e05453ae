"""The text-to-image jobs of bench/ladder.py: job templates in bench/jobs/text_to_image/ over
tiny Stable Diffusion pipelines (SD 1.x and SDXL layouts) and a captioned image folder.

Nothing can be downloaded on a bench machine, so the pipelines are random ones written by
tests/pipelines.py and the images are random pixels. Both are made once and cached in
bench/.cache/text_to_image/ (git-ignored), rebuilt whenever the recipe below (or the diffusers
version that wrote them) changes. The job files are the templates with ``${sd_pipeline}``,
``${sdxl_pipeline}`` and ``${captioned_images}`` filled in, written beside the cache on every
run (they are cheap, and a template edited since shows at once).
"""

from __future__ import annotations

import json
import os
import shutil
import string
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "bench" / "jobs" / "text_to_image"
CACHE = ROOT / "bench" / ".cache" / "text_to_image"

# Larger than the tests' smallest pipelines, so that the frozen parts (the VAE's encoder and
# the text encoders, on the device beside the UNet) are a visible share of device memory:
# about 0.7 MiB (SD) and 0.35 MiB (SDXL, two encoders of half the width) against a UNet of
# 0.3 MiB, while a step of batch 8 still takes 0.15 s (whole batch) to 0.8 s (8 slices) of one
# CPU thread. SDXL's UNet attends to both encoders side by side (2 x 32 wide).
PIPELINES: dict[str, dict[str, Any]] = {
    "sd": {"text_hidden": 64, "text_layers": 4, "vae_channels": (8, 16), "unet_channels": (8, 16)},
    "sdxl": {"text_hidden": 32, "text_layers": 4, "vae_channels": (8, 16), "unet_channels": (8, 16)},
}
# Images of a few sizes and aspect ratios (so resizing and cropping do work), each larger than
# the jobs' 32 px resolution; captions in metadata.jsonl.
IMAGES = 16
IMAGE_SIZES = ((40, 48), (48, 40), (36, 36), (64, 44))
SEED = 0
RECIPE = {"version": 1, "pipelines": PIPELINES, "images": IMAGES, "image_sizes": IMAGE_SIZES, "seed": SEED}


def templates() -> list[Path]:
    """The job templates; each file is named as its job."""
    return sorted(TEMPLATES.glob("*.toml"))


def prepare(chosen: list[Path]) -> list[Path]:
    """The job files of the ``chosen`` templates, ready to load (the cache made first where
    needed), in the same order."""
    if not chosen:
        return []
    folders = _cached()
    values = {"sd_pipeline": str(folders["sd"]), "sdxl_pipeline": str(folders["sdxl"]), "captioned_images": str(folders["images"])}
    out = CACHE / "jobs"
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for template in chosen:
        # substitute, not safe_substitute: a placeholder this module does not fill is an error.
        text = string.Template(template.read_text()).substitute(values)
        path = out / template.name
        path.write_text(text)
        paths.append(path)
    return paths


def shown_path(path: Path) -> str:
    """A job file's path for the report: a filled-in template's is its template's (the
    filled-in copy lives in the git-ignored cache)."""
    if path.parent == CACHE / "jobs" and (TEMPLATES / path.name).is_file():
        return str((TEMPLATES / path.name).relative_to(ROOT))
    return os.path.relpath(path, ROOT)


def _cached() -> dict[str, Path]:
    """The pipeline and image folders, made again unless the cache holds this recipe's."""
    import diffusers
    import transformers

    recipe = {**json.loads(json.dumps(RECIPE)), "diffusers": diffusers.__version__, "transformers": transformers.__version__}
    folders = {"sd": CACHE / "sd", "sdxl": CACHE / "sdxl", "images": CACHE / "images"}
    stamp = CACHE / "recipe.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == recipe and all(f.is_dir() for f in folders.values()):
        return folders
    # Made in a fresh folder and renamed into place, so an interrupted build is never reused.
    building = CACHE.with_name(CACHE.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    _make(building, folders)
    (building / "recipe.json").write_text(json.dumps(recipe, indent=2) + "\n")
    shutil.rmtree(CACHE, ignore_errors=True)
    building.rename(CACHE)
    return folders


def _make(building: Path, folders: dict[str, Path]) -> None:
    # tests/pipelines.py is the one place that knows how to write a working tiny pipeline offline.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.pipelines import save_tiny_pipeline

    for layout in ("sd", "sdxl"):
        save_tiny_pipeline(building / folders[layout].name, layout, SEED, **PIPELINES[layout])  # type: ignore[arg-type]
    write_captioned_images(building / folders["images"].name)


def write_captioned_images(folder: Path) -> Path:
    """IMAGES random images with captions in metadata.jsonl, in ``folder``."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    rows = []
    for i in range(IMAGES):
        height, width = IMAGE_SIZES[i % len(IMAGE_SIZES)]
        Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8")).save(folder / f"image{i:02d}.png")
        rows.append({"file_name": f"image{i:02d}.png", "text": f"a photo of thing number {i}, {('red', 'green', 'blue')[i % 3]}"})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return folder
