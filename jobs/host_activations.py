"""The activations forward saves for backward, kept in host memory (rung activation_offload).

Autograd's saved-tensor hooks, as ``torch.autograd.graph.save_on_cpu`` does it, with two
differences: the copies go through the run's DeviceMemory (so the emulated device counts the
copy coming back and not the one on the host), and tensors that share a parameter's storage
stay where they are (save_on_cpu copies the weights too, every micro-batch, for nothing).
"""

from __future__ import annotations

from typing import Any

import torch

from oomguard.jobs.memory_cap import DeviceMemory

# Smaller saved tensors stay on the device: copying them costs more than they hold.
SMALLEST_MOVED = 1 << 10


class HostActivations(torch.autograd.graph.saved_tensors_hooks):
    """Use around forward: what it saves for backward lives on the host until backward."""

    def __init__(self, memory: DeviceMemory, model: torch.nn.Module) -> None:
        weights = {_storage_key(t) for t in (*model.parameters(), *model.buffers())}

        def pack(tensor: torch.Tensor) -> Any:
            if tensor.layout is not torch.strided or _storage_key(tensor) in weights or _nbytes(tensor) < SMALLEST_MOVED:
                return tensor
            return tensor.device, memory.to_host(tensor)

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return memory.to_device(host, device)

        super().__init__(pack, unpack)


def _storage_key(tensor: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().data_ptr()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
