"""A training script that behaves like diffusers' examples/unconditional_image_generation/
train_unconditional.py where a relaunch with another split is concerned, written for
oomguard's tests. It knows nothing of oomguard.

What it shares with the real script:
- the learning-rate schedule comes from diffusers' ``get_scheduler`` and is sized from the
  data loader, in micro-batches: ``num_warmup_steps=lr_warmup_steps * accumulation``,
  ``num_training_steps=len(loader) * num_epochs``; it is prepared, and stepped every
  micro-batch inside ``accelerator.accumulate``;
- it runs ``num_epochs`` epochs (no step limit); one optimizer step per ``sync_gradients``;
- ``--resume_from_checkpoint latest`` loads the newest ``checkpoint-N`` with
  ``accelerator.load_state``, sets ``global_step = N`` and skips the batches already trained
  in the epoch, counted in micro-batches of the new split, as the real script computes them;
- checkpoints with ``accelerator.save_state`` every ``--checkpointing_steps`` on the main
  process; a progress line per optimizer step like its tqdm bar's postfix
  (``Epoch 1: ... step=12``);
- a pretrained UNet loaded with ``from_pretrained`` (safetensors), optionally with LoRA
  adapters (peft), sent to the device by ``accelerator.prepare``;
- torch is probed with ``importlib.util.find_spec`` before it is imported, as a data library
  imported first does.

At the end it prints the optimizer steps, the samples trained on (kept in its checkpoints with
``register_for_checkpointing``) and the final learning rate, for the tests to compare with an
uninterrupted run.
"""

import argparse
import importlib.util
import math
import os
import re

# A data library imported before torch asks whether torch is there first, as datasets' config
# does (importlib.util.find_spec), and torch is imported later.
TORCH_AVAILABLE = importlib.util.find_spec("torch") is not None

import torch  # noqa: E402
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from diffusers.optimization import get_scheduler


class SamplesSeen:
    """Samples trained on so far, saved and restored with the accelerate state."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


class Images(torch.utils.data.Dataset):
    """Made one sample at a time when the loader asks for it, as an image folder is read: on a
    GPU the data set is never in device memory, only the batch."""

    def __init__(self, size: int, shape: tuple[int, ...], seed: int) -> None:
        self.size, self.shape, self.seed = size, shape, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.randn(self.shape, generator=torch.Generator().manual_seed(self.seed * 100_003 + index))


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    if args.pretrained_model_name_or_path is None:
        torch.manual_seed(args.seed)
        return torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.SiLU(), torch.nn.Linear(64, 64), torch.nn.SiLU(), torch.nn.Linear(64, 48))
    from diffusers import UNet2DModel

    model = UNet2DModel.from_pretrained(args.pretrained_model_name_or_path)
    if args.lora_rank:
        from peft import LoraConfig, get_peft_model

        model.requires_grad_(False)
        model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=args.lora_rank, init_lora_weights="gaussian", target_modules=["to_q", "to_k", "to_v"]))
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pretrained_model_name_or_path", default=None)
    parser.add_argument("--lora_rank", type=int, default=0)
    parser.add_argument("--resolution", type=int, default=4)
    parser.add_argument("--dataset_size", type=int, default=768)
    parser.add_argument("--train_batch_size", type=int, default=128)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--num_epochs", type=int, default=3)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--lr_scheduler", default="cosine")
    parser.add_argument("--lr_warmup_steps", type=int, default=2)
    parser.add_argument("--checkpointing_steps", type=int, default=4)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--mixed_precision", default="no")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    # As diffusers' examples make it: the output folder is the project's (save_state's default place).
    project = ProjectConfiguration(project_dir=args.output_dir, logging_dir=os.path.join(args.output_dir, "logs"))
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps, mixed_precision=args.mixed_precision, cpu=True, project_config=project,
    )
    model = build_model(args)
    image = (3, args.resolution, args.resolution) if args.pretrained_model_name_or_path else (48,)
    loader = torch.utils.data.DataLoader(Images(args.dataset_size, image, args.seed), batch_size=args.train_batch_size, shuffle=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate)
    lr_scheduler = get_scheduler(
        args.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=args.lr_warmup_steps * args.gradient_accumulation_steps,
        num_training_steps=len(loader) * args.num_epochs,
    )
    model, optimizer, loader, lr_scheduler = accelerator.prepare(model, optimizer, loader, lr_scheduler)
    samples = SamplesSeen()
    accelerator.register_for_checkpointing(samples)

    num_update_steps_per_epoch = math.ceil(len(loader) / args.gradient_accumulation_steps)
    global_step = first_epoch = resume_step = 0
    if args.resume_from_checkpoint == "latest":
        found = [d for d in os.listdir(args.output_dir) if re.fullmatch(r"checkpoint-\d+", d)] if os.path.isdir(args.output_dir) else []
        if found:
            path = max(found, key=lambda d: int(d.split("-")[1]))
            accelerator.print(f"Resuming from checkpoint {path}")
            accelerator.load_state(os.path.join(args.output_dir, path))
            global_step = int(path.split("-")[1])
            resume_global_step = global_step * args.gradient_accumulation_steps
            first_epoch = global_step // num_update_steps_per_epoch
            resume_step = resume_global_step % (num_update_steps_per_epoch * args.gradient_accumulation_steps)
        else:
            accelerator.print("Checkpoint 'latest' does not exist. Starting a new training run.")

    for epoch in range(first_epoch, args.num_epochs):
        model.train()
        for step, batch in enumerate(loader):
            if epoch == first_epoch and step < resume_step:
                continue  # trained before the checkpoint
            with accelerator.accumulate(model):
                noise = torch.randn_like(batch)  # drawn per micro-batch, as the real scripts do
                prediction = model(batch + noise, 0).sample if args.pretrained_model_name_or_path else model(batch + noise)
                loss = torch.nn.functional.mse_loss(prediction, noise)
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            samples.count += batch.shape[0] * accelerator.num_processes
            if accelerator.sync_gradients:
                global_step += 1
                print(f"Epoch {epoch}: [loss={loss.item():.3g}, lr={lr_scheduler.get_last_lr()[0]:.3g}, step={global_step}]", flush=True)
                if global_step % args.checkpointing_steps == 0 and accelerator.is_main_process:
                    accelerator.save_state(os.path.join(args.output_dir, f"checkpoint-{global_step}"))
    print(f"done: steps={global_step} samples={samples.count} final_lr={lr_scheduler.get_last_lr()[0]:.9e}", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
