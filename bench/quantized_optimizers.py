#!/usr/bin/env python
"""The quantized AdamW optimizers side by side, for jobs/optimizers.py's choice of library:
one optimizer step's time, the state's bytes per fp32 weight byte, and how far the weights are
from fp32 AdamW's after 20 steps of the same gradients.

The model is 8 fp32 Linear(1536, 1536) layers (19M parameters: every weight quantized by both
libraries); the gradients are random, the same for every optimizer. Each optimizer is built as
oomguard builds it (jobs/optimizers.py): bitsandbytes' AdamW8bit, torchao's AdamW8bit and
AdamW4bit (eager on the CPU), and torchao's own step compiled as torchao ships it, for
comparison. Prints one line per optimizer; writes nothing. On the CPU, with one thread:

    OMP_NUM_THREADS=1 .venv/bin/python bench/quantized_optimizers.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from oomguard.jobs.optimizers import device_state_tensors
from oomguard.jobs.quantized_optimizers import adamw8bit_class, torchao_adamw_class

LR, WEIGHT_DECAY, STEPS, WIDTH, DEPTH = 1e-3, 1e-2, 20, 1536, 8


def parameters() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return list(torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)]).parameters())


def run(make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]) -> tuple[list[torch.Tensor], list[float], int]:
    params = parameters()
    optimizer = make(params)
    times = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator) * 1e-3
        began = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - began)
    state = sum(t.untyped_storage().nbytes() for t in device_state_tensors(optimizer) if t.dim() > 0)
    return [p.detach().clone() for p in params], times, state


def main() -> None:
    from torchao.optim import AdamW4bit, AdamW8bit

    cases: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
        "torch AdamW (fused, fp32)": lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=WEIGHT_DECAY, fused=True),
        "bitsandbytes AdamW8bit": lambda p: adamw8bit_class()(p, lr=LR, weight_decay=WEIGHT_DECAY),
        "torchao AdamW8bit (eager, as oomguard runs it on the CPU)": lambda p: torchao_adamw_class(8)(p, lr=LR, weight_decay=WEIGHT_DECAY),
        "torchao AdamW8bit (compiled, as torchao ships it)": lambda p: AdamW8bit(p, lr=LR, weight_decay=WEIGHT_DECAY),
        "torchao AdamW4bit (eager, as oomguard runs it on the CPU)": lambda p: torchao_adamw_class(4)(p, lr=LR, weight_decay=WEIGHT_DECAY),
        "torchao AdamW4bit (compiled, as torchao ships it)": lambda p: AdamW4bit(p, lr=LR, weight_decay=WEIGHT_DECAY),
    }
    reference, _, _ = run(cases["torch AdamW (fused, fp32)"])
    start = parameters()
    moved = max((r - s).abs().max().item() for r, s in zip(reference, start))
    weight_bytes = sum(p.numel() * p.element_size() for p in start)
    print(f"{weight_bytes // 4 / 1e6:.1f}M parameters, {torch.get_num_threads()} thread(s), torch {torch.__version__}; "
          f"fp32 AdamW moved the weights by up to {moved:.2e} in {STEPS} steps")
    for name, make in cases.items():
        weights, times, state = run(make)
        worst = max((w - r).abs().max().item() for w, r in zip(weights, reference))
        print(f"{name}: {statistics.median(times[5:]) * 1000:.0f} ms a step (first {times[0]:.2f} s), "
              f"state {state / weight_bytes:.3f} bytes per weight byte, weights at most {worst:.1e} from AdamW's")


if __name__ == "__main__":
    main()
