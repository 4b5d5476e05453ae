"""Encodings computed once and kept on disk: a text-to-image job's VAE latents (rung
cache_latents) and caption embeddings (rung cache_text).

A cache is one safetensors file, ``WORKDIR/cache/{kind}-{key}.safetensors``, whose key is a
digest of everything its tensors depend on: the encoder's files (their bytes), the inputs
(images by path, size and modification time; captions by their text) and the preprocessing.
A changed input gives another key, so a stale cache is never read; it is written to a
temporary name, flushed and renamed, so a cache that exists is complete. Caches whose key is
no longer wanted are deleted when a new one is written.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

CACHE_FOLDER = "cache"
_CHUNK = 1 << 20


def files_digest(paths: Iterable[Path]) -> str:
    """sha256 over the names and bytes of ``paths`` (in the order given)."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def folder_digest(folder: Path) -> str:
    """files_digest of every file in ``folder`` (a pipeline part: config and weights)."""
    return files_digest(sorted(p for p in folder.iterdir() if p.is_file()))


def key_of(description: dict[str, Any]) -> str:
    """A short digest of a JSON-ready description of a cache's inputs."""
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:20]


class EncodingCache:
    """One cache file: ``kind`` names what it holds, ``key`` what it was computed from."""

    def __init__(self, folder: Path, kind: str, key: str) -> None:
        self.folder = folder
        self.kind = kind
        self.path = folder / f"{kind}-{key}.safetensors"
        self._handle: Any = None

    def exists(self) -> bool:
        return self.path.is_file()

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write the cache atomically, then delete this kind's caches of other keys."""
        from safetensors.torch import save_file

        self.folder.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(self.path.name + ".tmp")
        save_file({name: t.detach().contiguous().cpu() for name, t in tensors.items()}, str(temporary))
        with temporary.open("rb") as handle:
            os.fsync(handle.fileno())
        temporary.rename(self.path)
        for other in self.folder.glob(f"{self.kind}-*.safetensors"):
            if other != self.path:
                other.unlink()

    def get(self, name: str) -> torch.Tensor:
        """One tensor, read from the memory-mapped file (the file is opened once)."""
        if self._handle is None:
            from safetensors import safe_open

            self._handle = safe_open(str(self.path), framework="pt")
        return self._handle.get_tensor(name)


def encoded_in_chunks(what: str, items: list[Any], chunk: int, encode: Any, memory: Any, name: Any) -> dict[str, torch.Tensor]:
    """``encode`` applied to ``items`` ``chunk`` at a time, one host tensor per item by
    ``name(item)``; progress printed about every tenth of the way. Out of memory, the chunk is
    halved and the same items encoded again (each item's encoding is its own: how many go at
    once changes nothing but the rounding); at one item, the OOM is the attempt's."""
    from oomguard.jobs.step_oom import free

    tensors: dict[str, torch.Tensor] = {}
    tenths_said = 0
    start = 0
    while start < len(items):
        batch = items[start:start + chunk]
        ran_out = False
        try:
            encoded = encode(batch)
        except torch.OutOfMemoryError:
            if chunk == 1:
                raise
            ran_out = True
        if ran_out:
            # Out of the except block: the traceback, and the tensors it holds, are gone.
            free(memory)
            chunk = max(1, chunk // 2)
            print(f"{what.split(':')[0]}: out of memory encoding {len(batch)} at once; now {chunk} at a time", flush=True)
            continue
        with memory.paused():  # host copies, which the emulated device must not count
            for item, row in zip(batch, encoded):
                tensors[name(item)] = row.to("cpu", copy=True)
        del encoded
        start += len(batch)
        if start * 10 // len(items) > tenths_said:
            tenths_said = start * 10 // len(items)
            print(f"{what} {start}/{len(items)}", flush=True)
    return tensors
