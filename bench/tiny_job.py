"""The tiny built-in job the fault and soak benchmarks run many of: the model of
tests/jobs_helpers.py's TINY_JOB (micro-batch 8 peaks at about 4.1 MiB emulated, 4 at 2.5 MiB),
with the name, workdir line, batch, length, seed and checkpoint interval as placeholders."""

TINY_JOB = """name = "{name}"
trainer = "unconditional"
{workdir}
[data]
source = "synthetic:16"
resolution = 16

[model]
block_out_channels = [8, 16]
layers_per_block = 1
down_block_types = ["DownBlock2D", "DownBlock2D"]
up_block_types = ["UpBlock2D", "UpBlock2D"]
norm_num_groups = 4

[train]
batch_size = {batch_size}
max_steps = {max_steps}
learning_rate = 1e-3
seed = {seed}
checkpoint_every_steps = {checkpoint_every}
keep_checkpoints = 2
"""
