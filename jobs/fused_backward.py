"""The optimizer step inside backward (rung fused_backward): each parameter is updated as soon as
its gradient is complete, and its gradient freed, so no step holds every gradient at once.

PyTorch's pattern (the tutorial "How to save memory by fusing the optimizer step into the
backward pass"): one optimizer per parameter, stepped from the parameter's
``register_post_accumulate_grad_hook``. The update is AdamW's, per tensor, as the fused
kernel computes it for the whole model, so the weights are the same up to float rounding.

To the runner it is one optimizer: ``param_groups`` holds one group over every parameter (the
LR scheduler sets its ``lr``; each hook copies the hyperparameters into its parameter's
optimizer before stepping), ``state`` shares each parameter's state dict with the optimizer of
that parameter, so ``state_dict``/``load_state_dict`` are torch AdamW's format over all
parameters: a checkpoint written with the step in backward resumes without it, and back.
``step()`` does nothing: the updates happened in backward.

A gradient accumulated over several micro-batches would be stepped on after the first: the
rung needs one micro-batch per step (its conflict says so), and so one process (the ranks
average gradients after backward).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

# The hyperparameters a step reads from its group; the rest (implementation flags, params) stay
# each parameter's optimizer's own.
_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


class FusedBackwardOptimizer(torch.optim.Optimizer):
    def __init__(self, params: list[torch.nn.Parameter], make: Callable[[list[torch.Tensor], bool | None], torch.optim.Optimizer]) -> None:
        fused = params[0].device.type in ("cpu", "cuda")
        self._own = {p: make([p], fused) for p in params}
        first = next(iter(self._own.values()))
        defaults = {k: v for k, v in first.param_groups[0].items() if k != "params"}
        super().__init__(params, defaults)
        self._zeroed: set[torch.nn.Parameter] = set()
        self._share_state()
        self._hooks = [p.register_post_accumulate_grad_hook(self._step_one) for p in params]

    def zero_first(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Gradients that are zero in exact arithmetic (Trainer.zero_gradient_parameters): made
        zero before their update, as the runner does before an ordinary step."""
        self._zeroed = set(params)

    def _share_state(self) -> None:
        for p, own in self._own.items():
            self.state[p] = own.state[p]

    def _step_one(self, p: torch.Tensor) -> None:
        own = self._own[p]
        group = self.param_groups[0]
        own.param_groups[0].update({k: group[k] for k in _HYPERPARAMETERS if k in group})
        if p in self._zeroed:
            p.grad.zero_()
        own.step()
        p.grad = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # noqa: ARG002 - the updates ran in backward
        return None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for p, own in self._own.items():
            own.state[p] = self.state[p]
