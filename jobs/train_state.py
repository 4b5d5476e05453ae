"""What a checkpoint holds, written and read so that any plan can resume any other plan's
checkpoint: the model's weights by name (for a LoRA run: its frozen base in full precision
and the adapters apart; with train.ema, the average of the trained weights), the optimizer state in torch AdamW's format (every optimizer of
jobs.optimizers reads and writes it), the LR scheduler, the grad scaler and the RNG states.

Every rung but LoRA loads everything. Taking LoRA changes what is trained: the adapters
start fresh (they add nothing at first) and so does their optimizer state.

A sharded model's ranks write its weights and optimizer state together through
torch.distributed.checkpoint (``dcp/``: each rank its shards, and the layout), so no rank
gathers the whole model; the optimizer's param groups go beside it. Any plan reads either
form, on any number of ranks: the whole weights and optimizer state are read on the host and
each rank keeps its part (resharding).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from oomguard.jobs.optimizers import adamw_group, load_portable_state_dict, portable_state_dict
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
SHARDS = "dcp"
OPTIMIZER_GROUPS = "optimizer_groups.pt"


def optimizer_kind(plan: Plan) -> dict[str, Any]:
    """What decides whether saved optimizer state fits a plan's optimizer: the parameters it
    trains (offload and the 8-bit optimizer keep AdamW's format)."""
    return {"lora_rank": plan.lora_rank}


def save_shards(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every rank's shards of a sharded model's weights and optimizer state, into
    ``directory/dcp`` (all ranks call it together); the optimizer's param groups (parameters
    by name) for rank 0 to write with ``save``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state["state"]}, checkpoint_id=directory / SHARDS)
    return [adamw_group(group) for group in optimizer_state["param_groups"]]


def save(
    directory: Path,
    *,
    weights: ModelWeights | None,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    scaler: torch.amp.GradScaler | None,
    plan: Plan,
    step: int,
    job_name: str,
    shard_groups: list[dict[str, Any]] | None = None,
) -> None:
    """The checkpoint's files; ``weights`` None: the ranks wrote the weights and optimizer state
    as shards (``save_shards``), whose param groups are ``shard_groups``."""
    from safetensors.torch import save_file

    if weights is None:
        torch.save({"kind": optimizer_kind(plan), "param_groups": shard_groups}, directory / OPTIMIZER_GROUPS)
    else:
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

    if (directory / SHARDS).exists():
        return ModelWeights(base=_read_whole(directory / SHARDS, "model."))
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
    model: torch.nn.Module | None = None,
    sharded: bool = False,
) -> None:
    """Optimizer (when it fits this plan), scheduler, scaler and RNG states. ``model``: the
    optimizer's model, whose parameter names key a sharded checkpoint's state (needed for one,
    and when ``sharded``: the model is sharded now, and each rank keeps its part of the state)."""
    saved = _optimizer_state(directory, model)
    if saved["kind"] == optimizer_kind(plan):
        if sharded:
            assert model is not None
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            whole = by_name(saved["state"], trained_names(model))
            set_optimizer_state_dict(model, optimizer, whole, options=StateDictOptions(full_state_dict=True))
        else:
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


def trained_names(model: torch.nn.Module) -> list[str]:
    """The names of the parameters the optimizer updates, in its order (jobs/optimizers.py)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def by_name(portable: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A portable optimizer state (parameters by index) with parameters by name, as
    torch.distributed.checkpoint's state_dict functions key it."""
    return {
        "state": {names[int(index)]: entry for index, entry in portable["state"].items()},
        "param_groups": [{**group, "params": [names[int(index)] for index in group["params"]]} for group in portable["param_groups"]],
    }


def by_index(state: dict[str, dict[str, torch.Tensor]], groups: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """``by_name``'s inverse: the portable format, parameters by their index in ``names``."""
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: entry for name, entry in state.items()},
        "param_groups": [{**group, "params": [index[name] for name in group["params"]]} for group in groups],
    }


def _optimizer_state(directory: Path, model: torch.nn.Module | None) -> dict[str, Any]:
    """The saved optimizer state in the portable format, from either form of checkpoint."""
    if not (directory / SHARDS).exists():
        return torch.load(directory / OPTIMIZER, map_location="cpu", weights_only=False)
    if model is None:
        raise ValueError(f"{directory} holds a sharded optimizer state: reading it needs the model's parameter names")
    saved = torch.load(directory / OPTIMIZER_GROUPS, weights_only=False)
    flat = _read_whole(directory / SHARDS, "optimizer.")
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in flat.items():
        # Keys are "<parameter name>.<state name>"; state names (exp_avg, step) have no dot.
        name, entry = key.rsplit(".", 1)
        state.setdefault(name, {})[entry] = tensor
    return {"kind": saved["kind"], "state": by_index(state, saved["param_groups"], trained_names(model))}


def _read_whole(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The whole tensors under ``prefix`` of a torch.distributed.checkpoint folder, on the host,
    keys without the prefix, however many ranks wrote them. Every process reads on its own
    (no collective), so a single process reads a checkpoint that ranks wrote."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(path))
    layout = reader.read_metadata().state_dict_metadata
    whole = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in layout.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    dcp.load(whole, storage_reader=reader, no_dist=True)
    return {key[len(prefix):]: tensor for key, tensor in whole.items()}
