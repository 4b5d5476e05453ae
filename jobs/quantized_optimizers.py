"""Quantized AdamW: the 8- and 4-bit optimizers of the rungs optimizer_8bit and optimizer_4bit,
in the one checkpoint format of jobs/optimizers.py (torch AdamW's ``state_dict``): quantized
moments are written dequantized to fp32 and quantized on load (``quantized_state_dict``,
``load_quantized_state_dict``: one way for both libraries below), and each optimizer also
writes its own codes under a top-level key of its own (``codes_key``), so a run resumes exactly
under the same optimizer.

8-bit AdamW: bitsandbytes (>= 0.50; 0.50.2 here), ``bitsandbytes.optim.AdamW8bit``, where it
imports; torchao's ``torchao.optim.AdamW8bit`` where it does not. bitsandbytes ships a CPU
backend (torch custom ops with a CPU library), so the same optimizer runs on CPU and CUDA, and
installing it leaves an installed torch alone (``pip install --dry-run`` next to torch
2.13.0+cpu wanted no torch). bench/quantized_optimizers.py measured one optimizer step on a
19M-parameter model (8 fp32 Linear(1536, 1536)), 1 thread of a 2-core CPU, torch 2.13.0+cpu,
20 steps of the same random gradients (fp32 AdamW moved the weights by up to 1.9e-2): torch's
fused fp32 AdamW 14 ms, state 2.0 bytes per fp32 weight byte; bitsandbytes 0.50.2 387 ms,
0.51 bytes per byte, the weights at most 9.9e-4 from fp32 AdamW's after 20 steps; torchao 0.18
559 ms compiled (first step 8.6 s with an empty compile cache) or 3.1 s eagerly, 0.51 bytes
per byte, 3.0e-3 from AdamW's. So bitsandbytes first: faster and closer to AdamW. The same
library's functional quantizers (NF4, row-wise int8) store the quantized LoRA base
(``oomguard.jobs.adapters``). Block-wise moments: one fp32 scale per 256 values; tensors under
4096 values keep fp32 moments (both libraries' default).

4-bit AdamW: torchao's ``torchao.optim.AdamW4bit`` (bitsandbytes has none): 4-bit moments, one
fp32 scale per 128 values; 0.27 bytes per fp32 weight byte (also on SD 1.5's UNet). Same
model: 856 ms a step compiled, 2.2 s eagerly; the weights at most 1.1e-2 from fp32 AdamW's.

Where torchao's update runs eagerly. torchao compiles each parameter's update with
``torch.compile``, one graph per parameter shape: 2.6-5.5x faster steps than eager on the CPU
(above), but the first step compiles every graph, 45 s on one core for the tests' 45k-parameter
UNet (24 shapes, empty compile cache), and needs a C++ toolchain. The CPU is where oomguard
runs its tests and emulated-memory demos (small models, few steps), so where every parameter is
on the CPU the update runs eagerly (``_torchao_step``); on a GPU it is compiled, as torchao
intends. torchao keeps ``lr`` as a tensor (a float would be a constant of the compiled update);
ours keep it a float outside ``step`` (schedulers, checkpoints and the offloaded optimizer read
floats). torchao 0.18's prebuilt extensions (mxfp8, CUTLASS kernels) do not load here (built
for another Python and for CUDA), and its import says so in a few lines of every job log that
imports diffusers, which imports torchao when it is installed; its optimizers are Python and
need none of them.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from oomguard.jobs.optimizers import adamw_group

BLOCKSIZE_8BIT = 256  # bitsandbytes' block size for 8-bit optimizer state
# A quantized optimizer's state_dict also carries its codes under a top-level key of its own
# (torch's optimizers ignore it): dequantizing and quantizing again is not the identity (a
# block whose largest value is negative loses its scale), so a resume under the same optimizer
# uses the codes. bitsandbytes' 8-bit AdamW's (the key its checkpoints have always had):
CODES_KEY = "adamw8bit_codes"
_CODE_KEYS = ("state1", "absmax1", "state2", "absmax2")
MIN_8BIT_SIZE = 4096


# -- quantized AdamW: one checkpoint format ----------------------------------------------------


def quantized_state_dict(
    optimizer: torch.optim.Optimizer,
    adamw_state: Callable[[dict[str, Any]], dict[str, Any]],
    codes: Callable[[dict[str, Any]], dict[str, Any] | None],
    codes_key: str,
) -> dict[str, Any]:
    """The ``state_dict`` of a quantized AdamW in torch AdamW's format: each parameter's state
    as ``adamw_state`` makes it (fp32 moments), AdamW's group keys, and under ``codes_key`` each
    parameter's own codes (``codes``; None where it keeps none) for an exact resume."""
    packed = torch.optim.Optimizer.state_dict(optimizer)
    return {
        "state": {index: adamw_state(state) for index, state in packed["state"].items()},
        "param_groups": [adamw_group(group) for group in packed["param_groups"]],
        codes_key: {index: own for index, state in packed["state"].items() if (own := codes(state)) is not None},
    }


def load_quantized_state_dict(
    optimizer: torch.optim.Optimizer,
    state_dict: dict[str, Any],
    quantized_state: Callable[[dict[str, Any], dict[str, Any] | None, torch.Tensor], dict[str, Any]],
    codes_key: str,
) -> None:
    """Load a state_dict in torch AdamW's format (any optimizer's here) into a quantized AdamW:
    each parameter's state as ``quantized_state`` makes it from AdamW's state, the codes this
    optimizer wrote under ``codes_key`` (None when the checkpoint has none), and the parameter."""
    states = state_dict["state"]
    torch.optim.Optimizer.load_state_dict(optimizer, {"state": {}, "param_groups": state_dict["param_groups"]})
    indices = [i for group in state_dict["param_groups"] for i in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    codes = state_dict.get(codes_key, {})
    for index, param in zip(indices, params):
        if index in states:
            optimizer.state[param] = quantized_state(states[index], codes.get(index), param)


def _adamw_step(step: Any) -> torch.Tensor:
    """AdamW's ``step`` (a float32 scalar tensor on the host) from any optimizer's."""
    return torch.tensor(float(step.item() if isinstance(step, torch.Tensor) else step), dtype=torch.float32)


# -- 8-bit AdamW ---------------------------------------------------------------------------


def adamw8bit(params: list[torch.Tensor], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """8-bit AdamW over ``params``: bitsandbytes' where it imports, else torchao's (see the
    module docstring for why that order)."""
    bitsandbytes = _bitsandbytes_adamw8bit_class()
    if bitsandbytes is not None:
        return bitsandbytes(params, lr=lr, weight_decay=weight_decay, min_8bit_size=MIN_8BIT_SIZE)
    return torchao_adamw_class(8)(params, lr=lr, weight_decay=weight_decay)


@functools.cache
def _bitsandbytes_adamw8bit_class() -> type | None:
    """``adamw8bit_class()``, or None (with a warning that says why) where bitsandbytes does not
    import: a build without a library for this platform fails in its import."""
    try:
        return adamw8bit_class()
    except (ImportError, RuntimeError, OSError) as error:
        warnings.warn(
            f"bitsandbytes did not import ({type(error).__name__}: {error}): 8-bit AdamW uses torchao's AdamW8bit instead "
            "(slower on the CPU; reinstall bitsandbytes >= 0.50 to use it)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


@functools.cache
def adamw8bit_class() -> type:
    """bitsandbytes' AdamW8bit with torch AdamW's ``state_dict`` (defined on first use, so that
    importing this module does not import bitsandbytes)."""
    from bitsandbytes.optim import AdamW8bit as Base

    class AdamW8bit(Base):  # type: ignore[misc, valid-type]
        codes_key = CODES_KEY

        def state_dict(self) -> dict[str, Any]:
            return quantized_state_dict(self, _adamw_state_of_8bit, _8bit_codes, self.codes_key)

        def load_state_dict(self, state_dict: dict[str, Any], move_to_device: bool = True) -> None:
            states = state_dict["state"]
            if states and not any("exp_avg" in state for state in states.values()):
                # bitsandbytes' own format.
                super().load_state_dict(state_dict, move_to_device=move_to_device)
                return
            load_quantized_state_dict(self, state_dict, lambda state, codes, param: _8bit_state_of_adamw(self, state, codes, param), self.codes_key)

    return AdamW8bit


def _8bit_codes(state: dict[str, Any]) -> dict[str, Any] | None:
    return {key: state[key] for key in _CODE_KEYS} if state["state1"].dtype == torch.uint8 else None


def _8bit_state_of_adamw(optimizer: Any, state: dict[str, Any], codes: dict[str, torch.Tensor] | None, param: torch.Tensor) -> dict[str, Any]:
    """The state of ``param`` for bitsandbytes' 8-bit ``optimizer`` from AdamW's: its own codes
    when they fit (an exact resume), else the fp32 moments, quantized on the host."""
    from bitsandbytes import functional

    result: dict[str, Any] = {"step": int(_adamw_step(state["step"]).item())}
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
    return {"step": _adamw_step(state["step"]), "exp_avg": moments[0], "exp_avg_sq": moments[1]}


# -- torchao's 8- and 4-bit AdamW ------------------------------------------------------------------

_MOMENTS = (("exp_avg", True), ("exp_avg_sq", False))  # AdamW's moments; signed: their code maps


def adamw4bit(params: list[torch.Tensor], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """torchao's 4-bit AdamW over ``params``."""
    return torchao_adamw_class(4)(params, lr=lr, weight_decay=weight_decay)


@functools.cache
def torchao_adamw_class(bits: int) -> type:
    """torchao's AdamW8bit or AdamW4bit with torch AdamW's ``state_dict``, a float ``lr``
    outside ``step`` and an eager update on the CPU (see the module docstring)."""
    from torchao.optim import AdamW4bit, AdamW8bit

    bases = {8: AdamW8bit, 4: AdamW4bit}
    if bits not in bases:
        raise ValueError(f"torchao has 8- and 4-bit AdamW; {bits} bits asked for")

    class TorchaoAdamW(bases[bits]):  # type: ignore[misc, valid-type]
        codes_key = f"torchao_adamw{bits}bit_codes"

        def add_param_group(self, param_group: dict[str, Any]) -> None:
            rate = float(param_group.get("lr", self.defaults["lr"]))
            super().add_param_group(param_group)
            # torchao made it a float32 tensor (0.01 became 0.00999999977): see _torchao_step.
            self.param_groups[-1]["lr"] = rate

        @torch.no_grad()
        def step(self, closure: Callable[[], Any] | None = None) -> Any:
            return _torchao_step(self, super().step, closure)

        def state_dict(self) -> dict[str, Any]:
            return quantized_state_dict(self, _adamw_state_of_torchao, _torchao_codes, self.codes_key)

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            load_quantized_state_dict(self, state_dict, lambda state, codes, param: _torchao_state_of_adamw(self, state, codes, param), self.codes_key)

    TorchaoAdamW.__name__ = TorchaoAdamW.__qualname__ = f"TorchaoAdamW{bits}bit"
    return TorchaoAdamW


def _torchao_step(optimizer: torch.optim.Optimizer, step: Callable[[Any], Any], closure: Any) -> Any:
    """torchao's ``step``, with each group's lr as the tensor it reads (a fresh one each step: a
    float would be a constant of its compiled update, recompiled whenever a scheduler changes
    it) and a float again afterwards; eagerly where every parameter is on the CPU."""
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32)
    on_cpu = all(p.device.type == "cpu" for group in optimizer.param_groups for p in group["params"])
    try:
        if on_cpu:
            with torch.compiler.set_stance("force_eager"):
                return step(closure)
        return step(closure)
    finally:
        for group, rate in zip(optimizer.param_groups, rates):
            group["lr"] = rate


def _torchao_quantized() -> tuple[type, ...]:
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    return (OptimState4bit, OptimState8bit)


def _adamw_state_of_torchao(state: dict[str, Any]) -> dict[str, Any]:
    """AdamW's state of one parameter of torchao's optimizer: quantized moments dequantized on
    the host (fp32 moments are 4x or 8x their codes)."""
    quantized = _torchao_quantized()
    result: dict[str, Any] = {"step": _adamw_step(state["step"])}
    for key, _ in _MOMENTS:
        moment = state[key]
        result[key] = moment.cpu().dequantize() if isinstance(moment, quantized) else moment
    return result


def _torchao_codes(state: dict[str, Any]) -> dict[str, Any] | None:
    quantized = _torchao_quantized()
    codes = {key: {"codes": state[key].codes, "scale": state[key].scale} for key, _ in _MOMENTS if isinstance(state[key], quantized)}
    return codes or None


def _torchao_state_of_adamw(optimizer: Any, state: dict[str, Any], codes: dict[str, Any] | None, param: torch.Tensor) -> dict[str, Any]:
    """The state of ``param`` for torchao's ``optimizer`` from AdamW's: each moment in the
    buffer torchao would make for it (quantized or not, torchao's own rule), filled on the host
    from its own codes when they fit (an exact resume), else from the fp32 moment (quantized by
    the buffer's copy), then moved to the parameter's device."""
    result: dict[str, Any] = {"step": _adamw_step(state["step"])}
    for key, signed in _MOMENTS:
        # torchao's own (private) maker of a moment's buffer: its rule for which tensors are
        # quantized lives there alone. The empty host tensor is never written, only its shape read.
        buffer = optimizer._new_buffer(torch.empty_like(param, device="cpu"), signed)
        own = (codes or {}).get(key)
        if own is not None and isinstance(buffer, _torchao_quantized()) and own["codes"].shape == buffer.codes.shape and own["scale"].shape == buffer.scale.shape:
            buffer.codes.copy_(own["codes"])
            buffer.scale.copy_(own["scale"])
        else:
            buffer.copy_(state[key].detach().to("cpu", torch.float32).reshape(param.shape))
        result[key] = buffer.to(param.device)
    return result


# -- offload to the host -----------------------------------------------------------------------
