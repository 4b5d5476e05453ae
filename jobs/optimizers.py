"""The optimizer a Plan asks for: AdamW or 8-bit AdamW, on the device or offloaded to the host.

One checkpoint format for all of them: every optimizer built here writes and reads torch
AdamW's ``state_dict`` (per parameter index ``step``, ``exp_avg``, ``exp_avg_sq``; AdamW's
param-group keys), so a checkpoint written under one plan resumes under any other: with or
without offload, and across the 8-bit rung: 8-bit moments are written dequantized to fp32 and
quantized on load; the 8-bit optimizer also writes its codes under a top-level key that torch's
optimizers ignore, so an 8-bit run resumes exactly under an 8-bit plan.

8-bit AdamW: bitsandbytes (>= 0.50; 0.50.2 here), ``bitsandbytes.optim.AdamW8bit``. It
ships a CPU backend (torch custom ops with a CPU library), so the same optimizer runs on CPU
and CUDA, and installing it leaves an installed torch alone (``pip install --dry-run`` next to torch 2.13.0+cpu wanted no
torch). torchao 0.18 (``torchao.optim.AdamW8bit``) also installs without touching torch, but
it compiles its update with ``torch.compile``: the first step took 20 s on a 2-core CPU (and
needs a C++ toolchain there), its prebuilt extensions did not load for this Python, its state
is a tensor subclass, and diffusers imports torchao eagerly when it is installed (slower
imports and warnings in every job log). bitsandbytes' first steps took under a second. The
same library's functional quantizers (NF4, row-wise int8) store the quantized LoRA base
(``oomguard.jobs.adapters``), so one library covers both. Its block-wise moments use one fp32
scale per 256 values; tensors under 4096 values keep fp32 moments (bitsandbytes' default).

Offload ("optimizer"), ZeRO-Offload style: the host keeps an fp32 copy of every trained
weight, its gradient buffer and the optimizer's state; a step copies the gradients to the
host, runs the update there (torch's fused CPU AdamW, or the 8-bit one) and copies the
weights back. The device keeps weights and gradients only. Host-side tensors are made and
used under ``memory.paused()`` so the emulated device does not count them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from oomguard.strategies import rungs

# Param-group keys that say how torch's AdamW runs, not what it computes: they are written as
# torch's defaults and never copied between our wrappers and the optimizers inside them.
IMPLEMENTATION_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable"})
# bitsandbytes' own group keys (other optimizers of its family); not part of AdamW's format.
_BNB_ONLY_KEYS = frozenset({"alpha", "t_alpha", "t_beta3"})
BLOCKSIZE_8BIT = 256  # bitsandbytes' block size for 8-bit optimizer state
# The 8-bit optimizer's state_dict also carries its codes under this top-level key (torch's
# optimizers ignore it): dequantizing and quantizing again is not the identity (a block whose
# largest value is negative loses its scale), so a resume under the same plan uses the codes.
CODES_KEY = "adamw8bit_codes"
_CODE_KEYS = ("state1", "absmax1", "state2", "absmax2")
MIN_8BIT_SIZE = 4096


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
        return made if made is not None else torch.optim.AdamW(tensors, lr=lr, weight_decay=weight_decay, fused=fused)

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
            if isinstance(value, torch.Tensor) and value.device == param.device and id(value.untyped_storage()) not in seen:
                seen.add(id(value.untyped_storage()))
                tensors.append(value)
    return tensors


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
    return result


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params" and k not in IMPLEMENTATION_FLAGS}


# -- 8-bit AdamW ---------------------------------------------------------------------------


@functools.cache
def adamw8bit_class() -> type:
    """bitsandbytes' AdamW8bit with torch AdamW's ``state_dict`` (defined on first use, so that
    importing this module does not import bitsandbytes)."""
    from bitsandbytes.optim import AdamW8bit as Base

    class AdamW8bit(Base):  # type: ignore[misc, valid-type]
        def state_dict(self) -> dict[str, Any]:
            packed = torch.optim.Optimizer.state_dict(self)
            return {
                "state": {index: _adamw_state_of_8bit(state) for index, state in packed["state"].items()},
                "param_groups": [adamw_group(group) for group in packed["param_groups"]],
                CODES_KEY: {
                    index: {key: state[key] for key in _CODE_KEYS}
                    for index, state in packed["state"].items()
                    if state["state1"].dtype == torch.uint8
                },
            }

        def load_state_dict(self, state_dict: dict[str, Any], move_to_device: bool = True) -> None:
            states = state_dict["state"]
            if not any("exp_avg" in state for state in states.values()):
                # Empty, or bitsandbytes' own format.
                super().load_state_dict(state_dict, move_to_device=move_to_device)
                return
            torch.optim.Optimizer.load_state_dict(self, {"state": {}, "param_groups": state_dict["param_groups"]})
            indices = [i for group in state_dict["param_groups"] for i in group["params"]]
            params = [p for group in self.param_groups for p in group["params"]]
            codes = state_dict.get(CODES_KEY, {})
            for index, param in zip(indices, params):
                if index in states:
                    self.state[param] = _8bit_state_of_adamw(self, states[index], codes.get(index), param)

    return AdamW8bit


def _8bit_state_of_adamw(optimizer: Any, state: dict[str, Any], codes: dict[str, torch.Tensor] | None, param: torch.Tensor) -> dict[str, Any]:
    """The state of ``param`` for the 8-bit ``optimizer`` from AdamW's: its own codes when they
    fit (an exact resume), else the fp32 moments, quantized on the host."""
    from bitsandbytes import functional

    step = state["step"]
    result: dict[str, Any] = {"step": int(step.item() if isinstance(step, torch.Tensor) else step)}
    if "dynamic" not in optimizer.name2qmap:
        optimizer.fill_qmap()
    qmaps = optimizer.name2qmap
    if codes is not None and param.numel() >= optimizer.args.min_8bit_size and codes["state1"].shape == param.shape:
        # Our own 8-bit codes: resume exactly.
        for n, name in ((1, "dynamic"), (2, "udynamic")):
            qmaps[name] = qmaps[name].to(param.device)
            result[f"state{n}"] = codes[f"state{n}"].to(param.device, copy=True)
            result[f"absmax{n}"] = codes[f"absmax{n}"].to(param.device, torch.float32, copy=True)
            result[f"qmap{n}"] = qmaps[name]
        return result
    moments = [state[key].detach().to("cpu", torch.float32, copy=True) for key in ("exp_avg", "exp_avg_sq")]
    if param.numel() < optimizer.args.min_8bit_size:
        result["state1"], result["state2"] = (m.reshape(param.shape).to(param.device) for m in moments)
        return result
    for n, (moment, name) in enumerate(zip(moments, ("dynamic", "udynamic")), start=1):
        # Quantized on the host: the fp32 moments never reach the device.
        quantized, quant_state = functional.quantize_blockwise(moment.contiguous(), code=qmaps[name].cpu(), blocksize=BLOCKSIZE_8BIT)
        qmaps[name] = qmaps[name].to(param.device)
        result[f"state{n}"] = quantized.reshape(param.shape).to(param.device)
        result[f"absmax{n}"] = quant_state.absmax.to(param.device, torch.float32)
        result[f"qmap{n}"] = qmaps[name]
    return result


def _adamw_state_of_8bit(state: dict[str, Any]) -> dict[str, Any]:
    """AdamW's state (step, fp32 exp_avg and exp_avg_sq) of one parameter of the 8-bit optimizer."""
    from bitsandbytes import functional

    moments = []
    for n in (1, 2):
        moment = state[f"state{n}"]
        if moment.dtype == torch.uint8:
            # On the host: dequantized moments are 4x the device's 8-bit ones.
            moment = functional.dequantize_blockwise(
                moment.cpu(), absmax=state[f"absmax{n}"].cpu(), code=state[f"qmap{n}"].cpu(), blocksize=BLOCKSIZE_8BIT
            )
        moments.append(moment)
    return {"step": torch.tensor(float(state["step"]), dtype=torch.float32), "exp_avg": moments[0], "exp_avg_sq": moments[1]}


# -- offload to the host -----------------------------------------------------------------------


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
