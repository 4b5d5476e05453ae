"""A training script that behaves like diffusers' example scripts, written for oomguard's
tests: argparse flags of the same names, accelerate `save_state` checkpoints named
`checkpoint-N` in --output_dir, `--resume_from_checkpoint latest`, gradient accumulation
through `accelerator.accumulate`, a "Steps: N/M" progress line per step and the final step
count at the end. It knows nothing of oomguard."""

import argparse
import os
import re

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_batch_size", type=int, default=16)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--max_train_steps", type=int, default=20)
    parser.add_argument("--checkpointing_steps", type=int, default=5)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--mixed_precision", default="no")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--use_ema", action="store_true", help="keep EMA weights on the main process (it samples from them)")
    args = parser.parse_args()

    # As diffusers' examples make it: the output folder is the project's (save_state's default place).
    project = ProjectConfiguration(project_dir=args.output_dir, logging_dir=os.path.join(args.output_dir, "logs"))
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps, mixed_precision=args.mixed_precision, cpu=True, project_config=project,
    )
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.SiLU(), torch.nn.Linear(256, 256), torch.nn.SiLU(), torch.nn.Linear(256, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 64))
    loader = torch.utils.data.DataLoader(data, batch_size=args.train_batch_size, shuffle=True, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    print(
        f"rank {accelerator.process_index}: train_batch_size={args.train_batch_size} "
        f"gradient_accumulation_steps={args.gradient_accumulation_steps} num_processes={accelerator.num_processes}",
        flush=True,
    )
    # Only the main process keeps (and updates) the EMA copy: it needs more memory than the others.
    ema = [p.detach().clone() for p in model.parameters()] if args.use_ema and accelerator.is_main_process else None

    global_step = 0
    if args.resume_from_checkpoint == "latest":
        found = [d for d in os.listdir(args.output_dir) if re.fullmatch(r"checkpoint-\d+", d)] if os.path.isdir(args.output_dir) else []
        if found:
            newest = max(found, key=lambda d: int(d.split("-")[1]))
            accelerator.load_state(os.path.join(args.output_dir, newest))
            global_step = int(newest.split("-")[1])
            print(f"Resuming from checkpoint {newest}", flush=True)
        else:
            print("Checkpoint 'latest' does not exist. Starting a new training run.", flush=True)

    while global_step < args.max_train_steps:
        for (batch,) in loader:
            with accelerator.accumulate(model):
                loss = (model(batch) - batch).pow(2).mean()
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                global_step += 1
                if ema is not None:
                    with torch.no_grad():
                        for average, p in zip(ema, model.parameters()):
                            average.lerp_(p.detach(), 0.01)
                # The progress line, as the examples' tqdm bar writes it ("Steps: ... 7/20").
                print(f"Steps: {global_step}/{args.max_train_steps} loss={loss.item():.4f}", flush=True)
                if global_step % args.checkpointing_steps == 0:
                    accelerator.save_state(os.path.join(args.output_dir, f"checkpoint-{global_step}"))
                if global_step >= args.max_train_steps:
                    break
    print(f"Steps: {global_step}/{args.max_train_steps}", flush=True)


if __name__ == "__main__":
    main()
