"""Tiny Stable Diffusion pipeline folders, made offline for the text-to-image tests.

Nothing can be downloaded here, the tokenizer included, so everything is built from config with
random weights and written with ``save_pretrained``, in the layouts a user's pipeline folder
has: SD 1.x/2.x (``unet/ vae/ text_encoder/ tokenizer/ scheduler/`` and model_index.json) and
SDXL (the same with ``text_encoder_2/ tokenizer_2/``, and a UNet that takes SDXL's extra
conditioning). The tokenizer is a byte-level CLIP vocabulary without merges: every character is
a token, so any caption tokenizes, and it is small. Sizes are the smallest that make a working
pipeline: a 32 px image is 16 x 16 latents.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

Layout = Literal["sd", "sdxl"]

# CLIP's special tokens, the first two ids of the vocabulary (bos 0; eos, pad and unk 1).
START, END = "<|startoftext|>", "<|endoftext|>"
# The text encoder's sequence length (CLIP's), and what the tokenizer pads and cuts to.
MAX_LENGTH = 77


def _byte_characters() -> list[str]:
    """The 256 printable characters byte-level BPE (GPT-2, CLIP) stands for the 256 bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + n) for n in range(len(others))]


def tiny_tokenizer() -> Any:
    from transformers import CLIPTokenizer

    vocab: dict[str, int] = {}
    for token in [START, END, *_byte_characters(), *(c + "</w>" for c in _byte_characters())]:
        vocab.setdefault(token, len(vocab))
    # model_max_length: without it a tokenizer built in memory pads "to the max length" of 1e30.
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=MAX_LENGTH)


def _text_encoder(tokenizer: Any, hidden: int, *, projection: bool, layers: int = 2) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        # The special ids match the tokenizer's: CLIP pools its output at the end token.
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=2, num_hidden_layers=layers,
        max_position_embeddings=MAX_LENGTH, projection_dim=hidden,
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def _vae(channels: tuple[int, int] = (4, 8)) -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=list(channels), in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=2,
        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"], up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"],
    )


def _unet(cross_attention_dim: int, *, sdxl: bool, text_embeds_dim: int = 0, channels: tuple[int, int] = (4, 8)) -> Any:
    from diffusers import UNet2DConditionModel

    extra: dict[str, Any] = {}
    if sdxl:
        # SDXL's added conditioning: six size numbers (original size, crop corner, target size),
        # each embedded in addition_time_embed_dim, beside the second encoder's pooled output.
        time_embed_dim = 8
        extra = {
            "addition_embed_type": "text_time", "addition_time_embed_dim": time_embed_dim,
            "projection_class_embeddings_input_dim": 6 * time_embed_dim + text_embeds_dim, "use_linear_projection": True,
        }
    return UNet2DConditionModel(
        block_out_channels=tuple(channels), layers_per_block=1, sample_size=16, in_channels=4, out_channels=4, norm_num_groups=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=cross_attention_dim, attention_head_dim=2, **extra,
    )


def save_tiny_pipeline(
    folder: Path, layout: Layout = "sd", seed: int = 0, *, text_hidden: int = 8, text_layers: int = 2,
    vae_channels: tuple[int, int] = (4, 8), unet_channels: tuple[int, int] = (4, 8),
) -> Path:
    """A tiny random pipeline of ``layout`` saved in ``folder`` (made if missing); the folder.

    The sizes default to the smallest working pipeline (what the tests use); bench/ladder.py
    asks for larger text encoders (``text_hidden``, even: two heads; ``text_layers``) and VAE
    (``vae_channels``, its two blocks, even) so that the frozen parts are a visible share of
    the device memory. ``unet_channels``: the UNet's two blocks, even.
    """
    import torch
    from diffusers import DDPMScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline

    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer()
    # As Stable Diffusion's own scheduler config has it (steps_offset 1: diffusers warns at 0).
    scheduler = DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False, steps_offset=1)

    def text_encoder(*, projection: bool) -> Any:
        return _text_encoder(tokenizer, text_hidden, projection=projection, layers=text_layers)

    if layout == "sd":
        pipeline: Any = StableDiffusionPipeline(
            vae=_vae(vae_channels), text_encoder=text_encoder(projection=False), tokenizer=tokenizer,
            unet=_unet(text_hidden, sdxl=False, channels=unet_channels),
            scheduler=scheduler, safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        )
    else:
        # The UNet attends to both encoders' hidden states side by side (8 + 8 by default), and
        # takes the second one's projected, pooled output as text_embeds.
        pipeline = StableDiffusionXLPipeline(
            vae=_vae(vae_channels), text_encoder=text_encoder(projection=False), text_encoder_2=text_encoder(projection=True),
            tokenizer=tokenizer, tokenizer_2=tiny_tokenizer(),
            unet=_unet(2 * text_hidden, sdxl=True, text_embeds_dim=text_hidden, channels=unet_channels), scheduler=scheduler,
        )
    pipeline.save_pretrained(folder)
    return folder
