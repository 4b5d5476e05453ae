"""Which mixed precision a device can really run.

The CPU's half-precision autocast type is bf16 (fp16 autocast on the CPU has no gradient
scaler to go with it, and accelerate 1.15 quietly trains "fp16" in fp32 there), so a CPU runs
"fp16" as "bf16". A GPU without native bf16 (before Ampere; torch would emulate it slowly)
runs "bf16" as "fp16", which the runner pairs with a gradient scaler.
"""

from __future__ import annotations

import torch


def resolve_mixed_precision(requested: str, device: torch.device) -> str:
    """"no", "bf16" or "fp16": the autocast type the runner uses for ``requested``."""
    if requested not in ("no", "bf16", "fp16"):
        raise ValueError(f"mixed precision must be 'no', 'bf16' or 'fp16', not {requested!r}")
    if requested == "no":
        return "no"
    if device.type == "cuda":
        if requested == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
            return "fp16"
        return requested
    if device.type == "cpu":
        return "bf16"
    return requested
