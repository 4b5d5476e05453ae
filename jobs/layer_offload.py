"""Layer offload (rung layer_offload): a fraction of a model's blocks keep their weights,
gradients and optimizer state in host memory; each block's weights are copied to the device just
before it runs (the next block's while the current one computes) and dropped after.

FSDP2 does the streaming: each chosen block is ``fully_shard``-ed over a mesh of this one
process with ``CPUOffloadPolicy``, so its "shard" is the whole block, kept on the host (pinned on
a GPU machine). Before the block's forward FSDP copies it to the device on its all-gather stream
(the next block's is prefetched), frees it after, gathers it again for backward, and copies the
block's gradients back to the host, where the optimizer updates them. Backward sees the same
weights autograd saved, which hand-written hooks would have to arrange. The rest of the model
stays an ordinary model on the device; the optimizer is two AdamWs (the host blocks' on the
host, the rest on the device) that read and write one torch AdamW state over all parameters,
with plain tensors, so a checkpoint moves between fractions and to plans without offload.

FSDP needs a process group even for one process: an in-memory one (gloo; NCCL on a GPU) is
started when the process has none. Which blocks: the model's top-level blocks as the sharding
rungs see them (strategies/rungs/sharding.py ``units``), largest first, until their weights
reach the fraction of all the blocks' weights.

On the emulated device the host is the device (every tensor is on the CPU): what FSDP would
copy to the host is told to the emulation instead (``DeviceMemory.move_out``), and the host's
work runs under ``memory.paused()``, so that the count matches what a GPU would hold.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from oomguard.jobs.optimizers import IMPLEMENTATION_FLAGS
from oomguard.strategies.rungs.layer_offload import FRACTIONS, measured_key
from oomguard.strategies.rungs.sharding import units

# Marks a block this module keeps on the host.
_HELD = "_oomguard_held_on_host"


def block_bytes(block: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in block.parameters())


def chosen_blocks(model: torch.nn.Module, fraction: float) -> list[torch.nn.Module]:
    """The blocks kept on the host at ``fraction``, in module order: the largest first, until
    their weights reach ``fraction`` of all the blocks' weights."""
    blocks = units(model)
    total = sum(block_bytes(b) for b in blocks)
    chosen: list[torch.nn.Module] = []
    held = 0
    for block in sorted(blocks, key=block_bytes, reverse=True):  # sorted() is stable: ties in module order
        if held >= fraction * total:
            break
        chosen.append(block)
        held += block_bytes(block)
    order = {id(b): i for i, b in enumerate(blocks)}
    return sorted(chosen, key=lambda b: order[id(b)])


def held_bytes(model: torch.nn.Module) -> dict[str, int]:
    """For every fraction the rung offers, the weight bytes it keeps off the device (a
    measurement's static figures: the memory model predicts each grade from them, for the
    weights, their gradients and optimizer state alike, four bytes of state per weight byte
    with AdamW): the chosen blocks' weights, less 2.5 of those four bytes for the largest block,
    which visits the device whole at the peak in backward (its gathered weights, their
    gradients, the reduce-scatter's copy of them; measured 1.8 to 2.6 on bench/graded_pairs.py's
    layers-unet job, whose largest block holds 42 % of its weights)."""
    result = {}
    for fraction in FRACTIONS:
        sizes = [block_bytes(b) for b in chosen_blocks(model, fraction)]
        result[measured_key(fraction)] = max(0, sum(sizes) - 5 * max(sizes, default=0) // 8)
    return result


def held_on_host(tensor: torch.Tensor) -> bool:
    """Whether a parameter (or its state) of an unsharded model rests in host memory: this
    module's blocks are the only DTensors such a model has."""
    return isinstance(tensor, DTensor)


def offload_blocks(model: torch.nn.Module, fraction: float, device: torch.device, memory: Any) -> None:
    """Keep ``fraction`` of ``model``'s blocks (built on the host) in host memory, streamed to
    ``device`` as they run, and move the rest of the model to ``device``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    chosen = chosen_blocks(model, fraction)
    if not chosen:
        raise ValueError(
            f"{type(model).__name__} has no blocks (entries of top-level module lists, or children with layers of their own): "
            "layer offload cannot apply (take the offload rung instead)"
        )
    mesh = _one_process_mesh(device)
    # Pinned host memory needs a CUDA device. FSDP moves each block to the device and copies it
    # back to the host as it wraps it: one block at a time on the device.
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    with memory.paused():
        for block in chosen:
            # Said explicitly: a root module (each block is one) would otherwise keep its weights
            # on the device from forward to backward.
            fully_shard(block, mesh=mesh, reshard_after_forward=True, offload_policy=policy)
            setattr(block, _HELD, True)
            block.register_state_dict_post_hook(_plain_state)
    _prefetch_in_running_order(chosen)
    if device.type == "cpu":
        # The "device" is the host: FSDP's copy of a gradient to the host is no copy, so tell
        # the count (on a GPU the hook would only make that copy synchronous). FSDP calls these
        # hooks once it has set the gradient.
        for block in chosen:
            for param in block.parameters():
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(lambda p: memory.move_out([p.grad.to_local()]))
    _move_rest(model, device)


def _prefetch_in_running_order(blocks: list[torch.nn.Module]) -> None:
    """Once every block has run its first forward, tell each which comes next (forward) and
    which came before (backward), so that its copy starts while the current one computes: each
    block is a root of its own, whose neighbours FSDP does not know. In the order they ran, not
    their order in the model (a diffusers UNet lists its mid block after its up blocks: a block
    prefetched out of turn stays on the device until it runs)."""
    order: list[torch.nn.Module] = []

    def ran(block: torch.nn.Module, args: Any) -> None:
        if all(block is not seen for seen in order):
            order.append(block)
        if len(order) < len(blocks):
            return
        for handle in handles:
            handle.remove()
        for current, following in zip(order, order[1:]):
            current.set_modules_to_forward_prefetch([following])
            following.set_modules_to_backward_prefetch([current])

    handles = [block.register_forward_pre_hook(ran) for block in blocks]


def _plain_state(module: torch.nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """A held block's state dict with plain tensors (the whole local tensor of one process's
    DTensor): checkpoints and save_pretrained write them as any model's."""
    for key, value in state.items():
        if key.startswith(prefix) and isinstance(value, DTensor):
            state[key] = value.to_local()


def _move_rest(model: torch.nn.Module, device: torch.device) -> None:
    """``model.to(device)`` for everything outside the held blocks (which ``Module.to`` would
    move to the device too)."""
    pending = [model]
    while pending:
        module = pending.pop()
        module._apply(lambda t: t.to(device), recurse=False)
        pending.extend(child for child in module.children() if not getattr(child, _HELD, False))


def _one_process_mesh(device: torch.device) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        # An in-memory store: one process needs no address to meet others at.
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise ValueError(
            f"layer offload runs in one process, but this one is rank {dist.get_rank()} of {dist.get_world_size()}: "
            "take shard_offload across processes"
        )
    return init_device_mesh(device.type, (1,))


class LayerOffloadOptimizer(torch.optim.Optimizer):
    """AdamW over a model with blocks held on the host: the host blocks' parameters are updated
    by an optimizer on the host (outside the device's count), the rest by one beside them.

    Its one param group holds every parameter (the LR scheduler sets its ``lr``; the values are
    handed to the inner optimizers before every step); ``state`` shares each parameter's state
    dict with the inner optimizer that has it. ``state_dict`` is torch AdamW's over all
    parameters, with plain tensors (the host blocks' DTensors' whole local tensors: one process
    holds all of each), so a checkpoint resumes at any fraction and without the rung.
    """

    def __init__(self, params: list[torch.nn.Parameter], make: Callable[[list[torch.Tensor], bool | None], torch.optim.Optimizer], memory: Any) -> None:
        self._memory = memory
        held = [p for p in params if held_on_host(p)]
        kept = [p for p in params if not held_on_host(p)]
        self._inner: list[tuple[torch.optim.Optimizer, bool]] = []
        if held:
            with memory.paused():
                # fused: torch's fused CPU AdamW, as the offload rung's host update.
                self._inner.append((make(held, True), True))
        if kept:
            self._inner.append((make(kept, kept[0].device.type in ("cpu", "cuda")), False))
        first = self._inner[0][0]
        defaults = {k: v for k, v in first.param_groups[0].items() if k != "params"}
        super().__init__(params, defaults)
        self._share_state()

    def _share_state(self) -> None:
        for inner, _ in self._inner:
            for p in inner.param_groups[0]["params"]:
                self.state[p] = inner.state[p]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[0]
        hyperparameters = {k: v for k, v in group.items() if k != "params" and k not in IMPLEMENTATION_FLAGS}
        for inner, on_host in self._inner:
            inner.param_groups[0].update(hyperparameters)
            if on_host:
                with self._memory.paused():
                    inner.step()
            else:
                inner.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        with self._memory.paused():
            packed = super().state_dict()
            states = {index: {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()} for index, state in packed["state"].items()}
        return {**packed, "state": states}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch's loading casts each value to its parameter's dtype and device, as plain tensors;
        # the host blocks' optimizer computes with DTensors like its parameters.
        with self._memory.paused():
            super().load_state_dict(state_dict)
            for p, state in self.state.items():
                if held_on_host(p):
                    for key, value in state.items():
                        if isinstance(value, torch.Tensor) and key != "step" and not isinstance(value, DTensor):
                            state[key] = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False)
        for inner, _ in self._inner:
            for p in inner.param_groups[0]["params"]:
                inner.state[p] = self.state[p]
