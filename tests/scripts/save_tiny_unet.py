"""Save a small diffusers UNet2DModel with random weights, as a pretrained folder (safetensors)
for the tests and benchmarks that load one with ``from_pretrained``: nothing is downloaded.

    python tests/scripts/save_tiny_unet.py FOLDER [SAMPLE_SIZE]

Tests call save_tiny_unet() in their own process (which has torch loaded already) rather than
paying a process's imports for it.
"""

import sys

from diffusers import UNet2DModel


def save_tiny_unet(folder: str, sample_size: int = 16) -> None:
    UNet2DModel(
        sample_size=sample_size, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8,
    ).save_pretrained(folder)


def main() -> None:
    save_tiny_unet(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 16)


if __name__ == "__main__":
    main()
