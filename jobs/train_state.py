"""What a checkpoint holds, written and read so that any plan can resume any other plan's
checkpoint: the model's weights by name (for a LoRA run: its frozen base in full precision
and the adapters apart; with train.ema, the average of the trained weights), the optimizer state in torch AdamW's format (every optimizer of
jobs.optimizers reads and writes it), the LR scheduler, the grad scaler and the RNG states.

Every rung but LoRA loads everything. Taking LoRA changes what is trained: the adapters
start fresh (they add nothing at first) and so does their optimizer state.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from oomguard.jobs.optimizers import load_portable_state_dict, portable_state_dict
from oomguard.jobs.training import ModelWeights
from oomguard.strategies.plan import Plan

MODEL = "model.safetensors"
ADAPTERS = "adapters.safetensors"
EMA = "ema.safetensors"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
SCALER = "scaler.pt"
RNG = "rng.pt"
TRAINER_STATE = "trainer_state.json"


def optimizer_kind(plan: Plan) -> dict[str, Any]:
    """What decides whether saved optimizer state fits a plan's optimizer: the parameters it
    trains (offload and the 8-bit optimizer keep AdamW's format)."""
    return {"lora_rank": plan.lora_rank}


def save(
    directory: Path,
    *,
    weights: ModelWeights,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    scaler: torch.amp.GradScaler | None,
    plan: Plan,
    step: int,
    job_name: str,
) -> None:
    from safetensors.torch import save_file

    save_file(_host(weights.base), str(directory / MODEL))
    if weights.adapters is not None:
        save_file(_host(weights.adapters), str(directory / ADAPTERS))
    if weights.ema is not None:
        save_file(_host(weights.ema), str(directory / EMA))
    torch.save({"kind": optimizer_kind(plan), "state": portable_state_dict(optimizer)}, directory / OPTIMIZER)
    torch.save(lr_scheduler.state_dict(), directory / SCHEDULER)
    if scaler is not None:
        torch.save(scaler.state_dict(), directory / SCALER)
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, directory / RNG)
    (directory / TRAINER_STATE).write_text(json.dumps({"step": step, "job": job_name}))


def _host(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().cpu() for k, v in state.items()}


def load_weights(directory: Path, plan: Plan) -> ModelWeights:
    """The model weights of the checkpoint in ``directory``, written under ``plan``."""
    from safetensors.torch import load_file

    adapters = load_file(str(directory / ADAPTERS)) if (directory / ADAPTERS).exists() else None
    ema = load_file(str(directory / EMA)) if (directory / EMA).exists() else None
    return ModelWeights(base=load_file(str(directory / MODEL)), adapters=adapters, lora_rank=plan.lora_rank if adapters else None, ema=ema)


def finite(weights: ModelWeights) -> bool:
    """No NaN or inf in any weight (a run that diverged may have saved such a checkpoint)."""
    tensors = [*weights.base.values(), *(weights.adapters or {}).values(), *(weights.ema or {}).values()]
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def load_rest(
    directory: Path,
    *,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    scaler: torch.amp.GradScaler | None,
    plan: Plan,
    say: Callable[[str], None],
) -> None:
    """Optimizer (when it fits this plan), scheduler, scaler and RNG states."""
    saved = torch.load(directory / OPTIMIZER, map_location="cpu", weights_only=False)
    if saved["kind"] == optimizer_kind(plan):
        load_portable_state_dict(optimizer, saved["state"])
    else:
        say(f"optimizer state was written for {saved['kind']}, this plan uses {optimizer_kind(plan)}: starting fresh optimizer state")
    lr_scheduler.load_state_dict(torch.load(directory / SCHEDULER, weights_only=False))
    if scaler is not None and (directory / SCALER).exists():
        scaler.load_state_dict(torch.load(directory / SCALER, weights_only=False))
    rng = torch.load(directory / RNG, weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
