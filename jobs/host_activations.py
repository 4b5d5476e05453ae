"""The activations forward saves for backward, kept in host memory (rung activation_offload).

Autograd's saved-tensor hooks, as ``torch.autograd.graph.save_on_cpu`` does it, with two
differences: the copies go through the run's DeviceMemory (so the emulated device counts the
copy coming back and not the one on the host), and tensors that share a parameter's storage
stay where they are (save_on_cpu copies the weights too, every micro-batch, for nothing), and a
tensor saved by several ops is copied once. Under autocast the low-precision copies of the
weights that autocast saves are not the weights' storages and are copied like activations
(a known cost: a half-precision copy of the model each way per micro-batch).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from oomguard.jobs.memory_cap import DeviceMemory

# Smaller saved tensors stay on the device: copying them costs more than they hold.
SMALLEST_MOVED = 1 << 10


class HostActivations(torch.autograd.graph.saved_tensors_hooks):
    """Use around forward: what it saves for backward lives on the host until backward."""

    def __init__(self, memory: DeviceMemory, model: torch.nn.Module) -> None:
        weights = {_storage_key(t) for t in (*model.parameters(), *model.buffers())}
        # A tensor several ops save (the input of q, k and v) is copied once: by the tensor
        # itself, held weakly (a tensor freed since may leave its address and id to a new one),
        # and its version (unchanged in place since).
        copies: dict[int, tuple[weakref.ref[torch.Tensor], int, Any]] = {}

        def pack(tensor: torch.Tensor) -> Any:
            if tensor.layout is not torch.strided or _storage_key(tensor) in weights or _nbytes(tensor) < SMALLEST_MOVED:
                return tensor
            seen = copies.get(id(tensor))
            if seen is not None and seen[0]() is tensor and seen[1] == tensor._version:
                return seen[2]
            packed = tensor.device, memory.to_host(tensor)
            copies[id(tensor)] = (weakref.ref(tensor), tensor._version, packed)
            return packed

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return memory.to_device(host, device)

        super().__init__(pack, unpack)


def _storage_key(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().data_ptr()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
