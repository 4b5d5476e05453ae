"""The optimizer a Plan asks for: AdamW, 8-bit or 4-bit AdamW, on the device or offloaded to the host.

One checkpoint format for all of them: every optimizer built here writes and reads torch
AdamW's ``state_dict`` (per parameter index ``step``, ``exp_avg``, ``exp_avg_sq``; AdamW's
param-group keys), so a checkpoint written under one plan resumes under any other: with or
without offload, and across the 8- and 4-bit rungs (jobs/quantized_optimizers.py: their
moments are written dequantized, with their own codes beside them).

Offload ("optimizer"), ZeRO-Offload style: the host keeps an fp32 copy of every trained
weight, its gradient buffer and the optimizer's state; a step copies the gradients to the
host, runs the update there (torch's fused CPU AdamW, or the 8- or 4-bit one) and copies the
weights back. The device keeps weights and gradients only. Host-side tensors are made and
used under ``memory.paused()`` so the emulated device does not count them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from oomguard.strategies import rungs

# Param-group keys that say how torch's AdamW runs, not what it computes: they are written as
# torch's defaults and never copied between our wrappers and the optimizers inside them.
IMPLEMENTATION_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable"})
# bitsandbytes' own group keys (other optimizers of its family); not part of AdamW's format.
_BNB_ONLY_KEYS = frozenset({"alpha", "t_alpha", "t_beta3"})


def build_optimizer(plan: Any, model: torch.nn.Module, lr: float, weight_decay: float, memory: Any) -> torch.optim.Optimizer:
    """The optimizer for ``plan`` over the model's trainable parameters, in named order: the
    rungs' (strategies/rungs: offload places it, optimizer_8bit makes it), else torch's AdamW.

    ``memory`` is the run's ``DeviceMemory``: host-side work happens under its ``paused()``.
    """
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")

    def make(tensors: list[torch.Tensor], fused: bool | None) -> torch.optim.Optimizer:
        made = rungs.make_optimizer(plan, tensors, lr, weight_decay, fused)
        if made is not None:
            return made
        if plan.optimizer != "adamw":
            # A plan stored by another version of oomguard, or written by hand.
            raise ValueError(f"no rung on the ladder builds the optimizer {plan.optimizer!r}: use 'adamw' or the optimizer of a rung (adamw8bit, adamw4bit)")
        return torch.optim.AdamW(tensors, lr=lr, weight_decay=weight_decay, fused=fused)

    placed = rungs.place_optimizer(plan, params, make, memory)
    if placed is not None:
        return placed
    # The fused AdamW kernel (one pass per parameter, CPU and CUDA) is the fastest torch has;
    # the offloaded optimizer uses it on the host too, so offload never wins on speed alone.
    return make(params, params[0].device.type in ("cpu", "cuda"))


def device_state_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The optimizer's state tensors that sit on the device of their parameter (one per storage).

    Empty for an offloaded optimizer; accelerate's wrapper is looked through.
    """
    while not isinstance(optimizer, HostOffloadedOptimizer) and isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    if isinstance(optimizer, HostOffloadedOptimizer):
        return []
    seen: set[int] = set()
    tensors = []
    for param, state in optimizer.state.items():
        for value in state.values():
            for tensor in _stored_tensors(value):
                if tensor.device == param.device and id(tensor.untyped_storage()) not in seen:
                    seen.add(id(tensor.untyped_storage()))
                    tensors.append(tensor)
    return tensors


def _stored_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors that hold ``value``'s memory: torchao's quantized moments are tensor
    subclasses without a storage of their own (their codes, scales and code map hold it); a
    DTensor stays whole (the runner takes its local shard)."""
    if not isinstance(value, torch.Tensor):
        return []
    if is_traceable_wrapper_subclass(value) and not _is_dtensor(value):
        names, _ = value.__tensor_flatten__()
        return [t for name in names for t in _stored_tensors(getattr(value, name))]
    return [value]


def _is_dtensor(value: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def portable_state_dict(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` in the one format every plan reads: torch AdamW's, with the
    implementation flags (fused, foreach, ...) at their defaults."""
    state = optimizer.state_dict()
    return {**state, "param_groups": [adamw_group(group) for group in state["param_groups"]]}


def load_portable_state_dict(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a ``portable_state_dict``, keeping how this optimizer runs (its implementation flags)."""
    flags = [{k: g[k] for k in IMPLEMENTATION_FLAGS if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, kept in zip(optimizer.param_groups, flags):
        group.update(kept)


@functools.cache
def _adamw_defaults() -> dict[str, Any]:
    return dict(torch.optim.AdamW([torch.nn.Parameter(torch.empty(0, device="meta"))]).defaults)


def adamw_group(group: dict[str, Any]) -> dict[str, Any]:
    """``group`` in torch AdamW's param-group format (keys a scheduler added are kept)."""
    result = dict(_adamw_defaults())
    result.update({k: v for k, v in group.items() if k not in IMPLEMENTATION_FLAGS and k not in _BNB_ONLY_KEYS})
    if isinstance(result["lr"], torch.Tensor):
        # torchao's optimizers keep lr as a tensor inside their step; AdamW's format has a float.
        result["lr"] = result["lr"].item()
    return result


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params" and k not in IMPLEMENTATION_FLAGS}


class HostOffloadedOptimizer(torch.optim.Optimizer):
    """Keeps ``inner``'s state and an fp32 copy of the weights on the host; see the module docstring.

    Its ``param_groups`` hold the device parameters (LR schedulers and accelerate change their
    ``lr`` as usual; the values are handed to the host optimizer before every step) and its
    ``state`` stays empty: ``state_dict`` and ``load_state_dict`` are the host optimizer's, in
    torch AdamW's format.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        make_inner: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        memory: Any,
        host: torch.device = torch.device("cpu"),
    ) -> None:
        params = list(params)
        self._memory = memory
        pin = host.type == "cpu" and any(p.device.type == "cuda" for p in params)
        with memory.paused():
            self._host_params = [_host_copy(p, host, pin, copy=True) for p in params]
            self._host_grads = [_host_copy(p, host, pin, copy=False) for p in params]
            self.inner = make_inner(self._host_params)
        defaults = {k: v for k, v in adamw_group(self.inner.param_groups[0]).items() if k != "params"}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        device_params = [p for group in self.param_groups for p in group["params"]]
        updated = []
        with self._memory.paused():
            for param, host_param, host_grad in zip(device_params, self._host_params, self._host_grads):
                if param.grad is None:
                    host_param.grad = None
                    continue
                host_grad.copy_(param.grad, non_blocking=True)
                host_param.grad = host_grad
                updated.append((param, host_param))
            _wait_for_copies(device_params)
            for group, inner_group in zip(self.param_groups, self.inner.param_groups):
                inner_group.update(_hyperparameters(group))
            self.inner.step()
            # From pinned memory this is asynchronous; the host copy is not written again
            # before the next step's device-to-host copies, which the same stream orders after.
            for param, host_param in updated:
                param.copy_(host_param, non_blocking=True)
        return loss

    def state_dict(self) -> dict[str, Any]:
        with self._memory.paused():
            inner = self.inner.state_dict()
        groups = [
            {**adamw_group(_hyperparameters(group)), "params": inner_group["params"]}
            for group, inner_group in zip(self.param_groups, inner["param_groups"])
        ]
        return {**inner, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        flags = [{k: g[k] for k in IMPLEMENTATION_FLAGS if k in g} for g in self.inner.param_groups]
        with self._memory.paused():
            self.inner.load_state_dict(state_dict)
        for group, inner_group, saved, kept in zip(self.param_groups, self.inner.param_groups, state_dict["param_groups"], flags):
            group.update(_hyperparameters(saved))
            inner_group.update(kept)


def _host_copy(param: torch.Tensor, host: torch.device, pin: bool, copy: bool) -> torch.Tensor:
    tensor = torch.empty(param.shape, dtype=param.dtype, device=host, pin_memory=pin)
    if copy:
        tensor.copy_(param.detach())
        return torch.nn.Parameter(tensor, requires_grad=True)
    return tensor


def _wait_for_copies(params: list[torch.Tensor]) -> None:
    """Device-to-host copies into pinned memory are asynchronous: wait before the host reads."""
    for device in {p.device for p in params if p.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()
