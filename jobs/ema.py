"""The exponential moving average of a job's trained weights (train.ema), kept as diffusers'
training scripts keep it (diffusers.training_utils.EMAModel with the defaults they use): after
every optimizer step each averaged weight s moves toward its trained weight p,
s -= (1 - d) * (s - p). The decay d after the t-th optimizer step is EMAModel's without
warm-up: 0 after the first (the average starts as the weights), then t / (9 + t), at most
train.ema_decay. It is a function of the global step, so a resumed run averages as an
uninterrupted one does.

What is averaged is the job's trained weights under the names its final model has: every
parameter of a full fine-tune, the adapters of a LoRA job (jobs/training.py,
``Training.trained_weights``). Where the average lives is the plan's (rung ema_offload):
beside the weights on the device, or in host memory, updated there from a copy of each
weight. The update is the same fp32 elementwise arithmetic either way.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext

import torch

from oomguard.jobs.memory_cap import DeviceMemory


def decay_at(step: int, largest: float) -> float:
    """The decay of the update after optimizer step ``step`` (1 for the first one)."""
    if step <= 1:
        return 0.0
    return min(step / (9 + step), largest)


class EmaWeights:
    """The average of the trained weights by name, on the device (counted by ``memory``) or in
    host memory (pinned when the weights are on a GPU, so the copies can overlap)."""

    def __init__(self, start: dict[str, torch.Tensor], largest_decay: float, device: torch.device, on_host: bool, memory: DeviceMemory) -> None:
        """``start``: the values to average from, host tensors of this object's own (they are
        kept, not copied, in host memory)."""
        self.largest_decay = largest_decay
        self.on_host = on_host
        self.memory = memory
        if on_host:
            pin = device.type == "cuda"
            with memory.paused():
                self.averages = {name: value.pin_memory() if pin else value for name, value in start.items()}
        else:
            self.averages = {name: value.to(device) for name, value in start.items()}
            memory.move_in(self.averages.values())

    @torch.no_grad()
    def update(self, trained: Iterable[tuple[str, torch.Tensor]], step: int) -> None:
        """Move every average toward its trained weight in ``trained`` after optimizer step
        ``step``; names the average does not hold are not the job's trained weights."""
        decay = decay_at(step, self.largest_decay)
        # In host memory nothing of the update is on the device but the weights themselves.
        with self.memory.paused() if self.on_host else nullcontext():
            for name, weight in trained:
                average = self.averages.get(name)
                if average is None:
                    continue
                weight = weight.to(average.device)
                if decay == 0.0:
                    average.copy_(weight)
                else:
                    # EMAModel's foreach form: s - (1 - d) * (s - p).
                    average.sub_(average - weight, alpha=1.0 - decay)

    def device_tensors(self) -> list[torch.Tensor]:
        return [] if self.on_host else list(self.averages.values())

    def nbytes(self) -> int:
        return sum(value.numel() * value.element_size() for value in self.averages.values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averages, as host tensors of their own (what a checkpoint writes)."""
        with self.memory.paused():
            return {name: value.detach().to("cpu", copy=True) for name, value in self.averages.items()}

    def copy_to(self, model: torch.nn.Module) -> None:
        """Put the averages in ``model``'s weights of the same names (the final model is the
        average, as diffusers' scripts save it)."""
        with self.memory.paused():
            unexpected = model.load_state_dict(self.state_dict(), strict=False).unexpected_keys
        if unexpected:
            raise RuntimeError(f"the EMA holds weights the final model lacks: {unexpected[:3]} (a bug: please report it)")
