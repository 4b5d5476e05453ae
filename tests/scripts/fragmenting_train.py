"""A training script whose memory fragments PyTorch's caching allocator, written for oomguard's
tests. It knows nothing of oomguard.

Each step, the forward pass holds ten mid-size activations (1.5 MiB per sample of the
micro-batch: 12 MiB at 8, each its own segment) and frees them after backward. After the first
optimizer step the script keeps ten 7 MiB buffers (as an EMA or an optimizer's state appears
only then): each lands in a cached activation block (the allocator's best fit) and splits it,
so the cache is 7 MiB in use and 5 MiB free, in turn, across ten blocks. The next step's
activations need 12 MiB each: 50 MiB are free, but in 5 MiB pieces, and new segments must be
had. Under a cap of 210 MiB, without expandable segments, that is PyTorch's fragmentation OOM
(about 50 MiB reserved but unallocated); with them the first step's activations were one
segment, the buffers fill its start and the next activations its rest and new pages (202 MiB
with the model's small blocks). With --gradient_accumulation_steps N each optimizer step runs N
micro-batches, each holding its activations until its backward (bench/allocator_pairs.py).
"""

import argparse

import torch

MiB = 2**20
ACTIVATIONS = 10
BUFFERS = 10


def floats(nbytes: int) -> int:
    return nbytes // 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_batch_size", type=int, required=True)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--max_train_steps", type=int, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    buffers: list[torch.Tensor] = []
    for step in range(1, args.max_train_steps + 1):
        for _ in range(args.gradient_accumulation_steps):  # each micro-batch's activations in turn
            activations = [torch.empty(floats(args.train_batch_size * 3 * MiB // 2)) for _ in range(ACTIVATIONS)]
            loss = model(torch.randn(args.train_batch_size, 16)).pow(2).mean() / args.gradient_accumulation_steps
            loss.backward()
            del activations
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if not buffers:
            buffers = [torch.zeros(floats(7 * MiB)) for _ in range(BUFFERS)]
        print(f"Steps: {step}/{args.max_train_steps} loss={loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
