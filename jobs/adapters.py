"""LoRA adapters (peft) on a diffusers UNet2DModel, over a frozen base stored in int8 or NF4.

Targets (``lora_target_names``): every ``nn.Linear`` and ``nn.Conv2d`` inside the down, mid and
up blocks: the ResNets' 3x3 convolutions, 1x1 shortcuts and time-embedding projections, the
attention projections (q, k, v, out) and the down/up-sampling convolutions. A UNet2DModel
keeps almost all its weights in convolutions, so adapting attention alone would leave most of
the network untrainable. Left out (frozen, never quantized): ``conv_in`` and ``conv_out``
(three image channels, below any useful rank and the layers most sensitive to error) and
the time-embedding MLP (small, shared by every block). peft injects the adapters in place
(``inject_adapter_in_model``; UNet2DModel has no ``add_adapter``), with ``lora_alpha`` equal
to the rank (scale 1), A drawn from torch's global RNG (the caller seeds it) and B zero, so
the model's output is unchanged when the adapters are added.

Quantized base: bitsandbytes' functional quantizers (the library of the 8-bit optimizer)
store the weights: int8 with one absmax scale per output channel
(``int8_vectorwise_quant``) or NF4 with one fp32 scale per 64 weights (``quantize_4bit``), on
CPU and CUDA. The layer around them is ours: bitsandbytes' ``Linear8bitLt``/``Linear4bit``
(and torchao's weight-only quantization) cover ``nn.Linear`` only, and most of a UNet's
weights are in ``nn.Conv2d``. A quantized layer dequantizes its weight in forward, uses it
and drops it; its backward dequantizes again to compute the input's gradient (the base is
frozen, so no weight gradient), so at most one layer's full-precision weight exists at a
time and none is kept for backward. The codes and scales are frozen ``nn.Parameter``s, so
they count as parameters in the memory breakdown and checkpoints carry them.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ADAPTER = "default"
BLOCK_PREFIXES = ("down_blocks.", "mid_block.", "up_blocks.")
NF4_BLOCKSIZE = 64


def lora_target_names(model: nn.Module) -> list[str]:
    """The names of the layers ``apply_lora`` adapts (see the module docstring)."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, nn.Conv2d)) and name.startswith(BLOCK_PREFIXES)
    ]


def apply_lora(model: nn.Module, rank: int) -> nn.Module:
    """Freeze ``model`` and inject rank-``rank`` LoRA adapters in place; returns ``model``.

    Only the adapters' parameters require grad afterwards.
    """
    from peft import LoraConfig, inject_adapter_in_model

    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    model.requires_grad_(False)
    config = LoraConfig(
        r=rank,
        lora_alpha=rank,
        lora_dropout=0.0,
        bias="none",
        init_lora_weights=True,
        target_modules=lora_target_names(model),
    )
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".lora_" in name)
    return model


def lora_layers(model: nn.Module) -> dict[str, Any]:
    """The peft LoRA layers of ``model`` by module name."""
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' weights (peft's key format, without the adapter name)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, adapter_name=ADAPTER)


def load_adapter_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load weights from ``adapter_state_dict`` into a model that ``apply_lora`` adapted alike."""
    from peft import set_peft_model_state_dict

    expected = set(adapter_state_dict(model))
    if set(state) != expected:
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(f"adapter state does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    set_peft_model_state_dict(model, state, adapter_name=ADAPTER)


# -- the quantized frozen base -------------------------------------------------------------------


def quantize_base(model: nn.Module, kind: str) -> nn.Module:
    """Store the frozen base weights of the LoRA-adapted layers in ``kind`` ("int8" or "nf4").

    In place; returns ``model``. Layers quantized already are quantized again from their
    dequantized weight, so go from fp32 to the wanted kind directly where you can.
    """
    if kind not in ("int8", "nf4"):
        raise ValueError(f"base quantization must be 'int8' or 'nf4', not {kind!r}")
    layers = lora_layers(model)
    if not layers:
        raise ValueError("quantize_base needs LoRA adapters (apply_lora) on a frozen base")
    for layer in layers.values():
        base = layer.base_layer
        if isinstance(base, QuantizedLayer):
            if base.kind == kind:
                continue
            base = base.dequantized_layer()
        if isinstance(base, nn.Conv2d) and (base.padding_mode != "zeros" or isinstance(base.padding, str)):
            continue  # not handled by the input-gradient convolution below; stays fp32
        if isinstance(base, nn.Conv2d):
            layer.base_layer = QuantizedConv2d(base, kind)
        elif isinstance(base, nn.Linear):
            layer.base_layer = QuantizedLinear(base, kind)
    return model


def _quantize(weight: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    from bitsandbytes import functional

    weight = weight.detach()
    if kind == "int8":
        codes, scales, _ = functional.int8_vectorwise_quant(weight.reshape(weight.shape[0], -1).contiguous())
        return codes, scales
    # NF4 over the flattened weight, padded to an even length: bitsandbytes 0.50's CPU kernel
    # dequantizes a 2-D shape wrongly when a row is not a whole number of blocks, and sends
    # an odd last dimension (every 3x3 kernel) to a torch.compile'd fallback.
    flat = weight.reshape(-1)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    codes, state = functional.quantize_4bit(flat, blocksize=NF4_BLOCKSIZE, compress_statistics=False, quant_type="nf4")
    return codes, state.absmax


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, kind: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    from bitsandbytes import functional

    if kind == "int8":
        return functional.int8_vectorwise_dequant(codes, scales).reshape(shape).to(dtype)
    padded = torch.Size([codes.numel() * 2])
    state = functional.QuantState(absmax=scales, shape=padded, dtype=dtype, blocksize=NF4_BLOCKSIZE, quant_type="nf4")
    return functional.dequantize_4bit(codes, state).reshape(-1)[: shape.numel()].view(shape)


class _DequantizeAndApply(torch.autograd.Function):
    """y = layer(x) with the weight dequantized on the fly; saves nothing but the input's shape."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: QuantizedLayer) -> torch.Tensor:
        out = layer.apply_weight(x, layer.dequantized_weight())
        ctx.layer = layer
        ctx.input_shape = x.shape
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None
        weight = ctx.layer.dequantized_weight().to(grad_out.dtype)
        return ctx.layer.input_gradient(grad_out, weight, ctx.input_shape), None


class QuantizedLayer(nn.Module, abc.ABC):
    """A frozen Linear or Conv2d whose weight is kept as int8 or NF4 codes plus fp32 scales."""

    kind: str

    def _store(self, layer: nn.Linear | nn.Conv2d, kind: str) -> None:
        self.kind = kind
        self.weight_shape = layer.weight.shape
        self.weight_dtype = layer.weight.dtype
        codes, scales = _quantize(layer.weight, kind)
        self.weight_codes = nn.Parameter(codes, requires_grad=False)
        self.weight_scales = nn.Parameter(scales, requires_grad=False)
        self.bias = None if layer.bias is None else nn.Parameter(layer.bias.detach(), requires_grad=False)

    def dequantized_weight(self) -> torch.Tensor:
        return _dequantize(self.weight_codes, self.weight_scales, self.kind, self.weight_shape, self.weight_dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (a new tensor each time: for merging and inspection)."""
        return self.dequantized_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DequantizeAndApply.apply(x, self)

    @abc.abstractmethod
    def apply_weight(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The layer's output for input ``x`` with the dequantized ``weight``."""

    @abc.abstractmethod
    def input_gradient(self, grad_out: torch.Tensor, weight: torch.Tensor, input_shape: torch.Size) -> torch.Tensor:
        """The gradient of the layer's input, from the gradient of its output."""

    @abc.abstractmethod
    def dequantized_layer(self) -> nn.Module:
        """A plain layer of the same kind with the dequantized weight."""

    def extra_repr(self) -> str:
        return f"{self.kind}, weight_shape={tuple(self.weight_shape)}"


class QuantizedLinear(QuantizedLayer):
    def __init__(self, layer: nn.Linear, kind: str) -> None:
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self._store(layer, kind)

    def apply_weight(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight, self.bias)

    def input_gradient(self, grad_out: torch.Tensor, weight: torch.Tensor, input_shape: torch.Size) -> torch.Tensor:
        return grad_out.matmul(weight)

    def dequantized_layer(self) -> nn.Linear:
        layer = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        return _with_weights(layer, self)


class QuantizedConv2d(QuantizedLayer):
    def __init__(self, layer: nn.Conv2d, kind: str) -> None:
        super().__init__()
        for name in ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups"):
            setattr(self, name, getattr(layer, name))
        self._store(layer, kind)

    def apply_weight(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)

    def input_gradient(self, grad_out: torch.Tensor, weight: torch.Tensor, input_shape: torch.Size) -> torch.Tensor:
        return torch.nn.grad.conv2d_input(input_shape, weight, grad_out, self.stride, self.padding, self.dilation, self.groups)

    def dequantized_layer(self) -> nn.Conv2d:
        layer = nn.Conv2d(
            self.in_channels, self.out_channels, self.kernel_size, self.stride, self.padding, self.dilation,
            self.groups, bias=self.bias is not None, device="meta",
        )
        return _with_weights(layer, self)


def _with_weights(layer: nn.Module, quantized: QuantizedLayer) -> nn.Module:
    layer.weight = nn.Parameter(quantized.dequantized_weight(), requires_grad=False)
    if quantized.bias is not None:
        layer.bias = nn.Parameter(quantized.bias.detach().clone(), requires_grad=False)
    return layer


# -- the plain model for save_pretrained ------------------------------------------------------------


def merged_tensors(model: nn.Module, *, buffers: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain model's parameters (and persistent buffers), where they are, one at a time:
    base and adapters merged, dequantized, keys as the model had before ``apply_lora`` (for
    UNet2DModel exactly ``UNet2DModel.state_dict()``'s). A merged weight is a new tensor; every
    other one is the model's own, detached."""
    layers = lora_layers(model)
    skip: tuple[str, ...] = ()
    with torch.no_grad():
        for name, module in model.named_modules():
            if skip and name.startswith(skip):
                continue
            prefix = f"{name}." if name else ""
            if name in layers or isinstance(module, QuantizedLayer):
                base = layers[name].get_base_layer() if name in layers else module
                weight = base.weight.detach().clone()  # dequantized for a quantized base
                if name in layers:
                    for adapter in layers[name].active_adapters:
                        if adapter in layers[name].lora_A:
                            weight += layers[name].get_delta_weight(adapter).to(weight.dtype)
                yield prefix + "weight", weight
                if base.bias is not None:
                    yield prefix + "bias", base.bias.detach()
                skip = (*skip, prefix)
                continue
            for key, value in module.named_parameters(recurse=False):
                yield prefix + key, value.detach()
            if buffers:
                for key, value in module.named_buffers(recurse=False):
                    if key not in module._non_persistent_buffers_set:
                        yield prefix + key, value.detach()


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``merged_tensors`` as a state dict on the host. One layer at a time is merged on the
    device and moved to the host, so a run near its memory limit can still write its final
    model."""
    return {key: value.to("cpu", copy=True) for key, value in merged_tensors(model)}


def merged_model(model: nn.Module) -> nn.Module:
    """A plain model (on the host) of ``model``'s class and config with ``merged_state_dict``
    loaded (strict): what ``save_pretrained`` should write at the end of a LoRA run."""
    plain = type(model).from_config(model.config)
    plain.load_state_dict(merged_state_dict(model), strict=True)
    return plain
