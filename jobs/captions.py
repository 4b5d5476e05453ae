"""The captioned images of a text-to-image job: every image of a folder with its caption.

A caption comes from ``metadata.jsonl`` at the top of the folder (one JSON object per line with
``file_name``, the image's path relative to the folder, and the caption under the caption
column, ``text`` unless the job says otherwise: the layout of Hugging Face's imagefolder, which
diffusers' example scripts read) or, for an image the metadata does not name, from a ``.txt``
file of the same name beside it (``cat.png`` -> ``cat.txt``: the layout of kohya-style data
sets). An image without either is an error, and so is a caption that is not UTF-8 text: a
job must not train on an empty or garbled prompt without anyone noticing.

Torch-free: intake checks a folder with it (bounded), the runner reads all of it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

IMAGE_EXTENSIONS: tuple[str, ...] = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
METADATA = "metadata.jsonl"


class CaptionError(ValueError):
    """A captioned image folder that cannot be trained on as it is; the text says what to fix."""


@dataclass(frozen=True)
class CaptionedImage:
    path: Path
    caption: str


def image_paths(folder: Path, limit: int | None = None) -> list[Path]:
    """The image files under ``folder``, sorted by path (the first ``limit`` of them found in
    sorted walk order when a limit is given). Links to folders are not followed."""
    found: list[Path] = []
    for current, folders, files in os.walk(folder):
        folders.sort()
        for name in sorted(files):
            if os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS:
                found.append(Path(current) / name)
                if limit is not None and len(found) >= limit:
                    return sorted(found)
    return sorted(found)


def read_metadata(folder: Path, caption_column: str) -> dict[Path, str]:
    """The captions ``metadata.jsonl`` gives, by the image's absolute path (empty without one)."""
    metadata = folder / METADATA
    if not metadata.is_file():
        return {}
    captions: dict[Path, str] = {}
    try:
        text = metadata.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise CaptionError(f"{metadata} is not UTF-8 text (byte {error.start}): save it as UTF-8") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{metadata} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise CaptionError(f"{where} is not JSON ({error.msg}): each line must be one object such as "
                               f'{{"file_name": "cat.png", "{caption_column}": "a cat"}}') from None
        if not isinstance(row, dict) or not isinstance(row.get("file_name"), str):
            raise CaptionError(f'{where} has no "file_name" string: name the image, relative to {folder}')
        caption = row.get(caption_column)
        if not isinstance(caption, str):
            found = ", ".join(sorted(str(k) for k in row)) if isinstance(row, dict) else "nothing"
            raise CaptionError(f'{where} has no "{caption_column}" string (keys: {found}): add the caption, '
                               'or set data.caption_column to the key that holds it')
        image = (folder / row["file_name"]).resolve()
        if not image.is_file():
            raise CaptionError(f'{where} names {row["file_name"]!r}, which is not a file under {folder}: fix the name or drop the line')
        captions[image] = caption
    return captions


def caption_beside(image: Path) -> str | None:
    """The caption in the ``.txt`` file beside ``image``, or None when there is none."""
    text_file = image.with_suffix(".txt")
    try:
        raw = text_file.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return raw.decode("utf-8").strip()
    except UnicodeDecodeError as error:
        raise CaptionError(f"caption file {text_file} is not UTF-8 text (byte {error.start}): save it as UTF-8") from None


def captioned_images(folder: Path, caption_column: str = "text", limit: int | None = None) -> list[CaptionedImage]:
    """Every image under ``folder`` with its caption, sorted by path (the first ``limit``
    images only, when given: what intake checks of a big folder). Raises CaptionError."""
    paths = image_paths(folder, limit)
    if not paths:
        raise CaptionError(f"no image files ({', '.join(IMAGE_EXTENSIONS)}) in folder {folder}")
    from_metadata = read_metadata(folder, caption_column)
    images = []
    for path in paths:
        caption = from_metadata.get(path.resolve())
        if caption is None:
            caption = caption_beside(path)
        if caption is None:
            raise CaptionError(
                f"image {path} has no caption: add a line for it to {folder / METADATA} "
                f'({{"file_name": "{path.relative_to(folder).as_posix()}", "{caption_column}": "..."}}) '
                f"or write its caption in {path.with_suffix('.txt')}"
            )
        images.append(CaptionedImage(path, caption))
    return images
