"""What a checkpoint holds, written and read so that any plan can resume any other plan's
checkpoint: the model's weights by name, the optimizer state tagged with the optimizer that
wrote it, the LR scheduler, the grad scaler and the RNG states.

Exact rungs (micro-batch, checkpointing, attention, optimizer offload) load everything.
A change of optimizer or of what is trained (8-bit AdamW, LoRA) cannot carry the old moments
over: those rungs are approximate, and the new optimizer starts with fresh state.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from oomguard.strategies.plan import Plan

MODEL = "model.safetensors"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
SCALER = "scaler.pt"
RNG = "rng.pt"
TRAINER_STATE = "trainer_state.json"


def optimizer_kind(plan: Plan) -> dict[str, Any]:
    """What decides whether saved optimizer state fits a plan's optimizer (offload does not:
    the offloaded AdamW keeps torch AdamW's state format)."""
    return {"optimizer": plan.optimizer, "lora_rank": plan.lora_rank}


def save(
    directory: Path,
    *,
    model_state: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    scaler: torch.amp.GradScaler | None,
    plan: Plan,
    step: int,
    job_name: str,
) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in model_state.items()}, str(directory / MODEL))
    torch.save({"kind": optimizer_kind(plan), "state": optimizer.state_dict()}, directory / OPTIMIZER)
    torch.save(lr_scheduler.state_dict(), directory / SCHEDULER)
    if scaler is not None:
        torch.save(scaler.state_dict(), directory / SCALER)
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, directory / RNG)
    (directory / TRAINER_STATE).write_text(json.dumps({"step": step, "job": job_name}))


def load_model_state(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / MODEL))


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
        optimizer.load_state_dict(saved["state"])
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
