"""LoRA adapters on a UNet2DModel, the quantized frozen base under them, and the plain model
that comes out at the end."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from oomguard.jobs.adapters import (
    QuantizedConv2d,
    QuantizedLayer,
    QuantizedLinear,
    adapter_state_dict,
    apply_lora,
    load_adapter_state_dict,
    lora_layers,
    lora_target_names,
    merged_model,
    merged_state_dict,
    quantize_base,
)


RANK = 4
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_unet():
    """A UNet2DModel with attention that trains a step in milliseconds (seeded)."""
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    return UNet2DModel(
        sample_size=8,
        block_out_channels=[8, 16],
        layers_per_block=1,
        down_block_types=["DownBlock2D", "AttnDownBlock2D"],
        up_block_types=["AttnUpBlock2D", "UpBlock2D"],
        norm_num_groups=4,
        attention_head_dim=8,
    )


def lora_unet(kind: str | None = None):
    model = apply_lora(tiny_unet(), RANK)
    if kind is not None:
        quantize_base(model, kind)
    return model


SAMPLE = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
TIMESTEPS = torch.tensor([10, 700])


def predict(model) -> torch.Tensor:
    with torch.no_grad():
        return model(SAMPLE, TIMESTEPS).sample


def train_step(model, lr: float = 1e-2) -> None:
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr)
    F.mse_loss(model(SAMPLE, TIMESTEPS).sample, SAMPLE).backward()
    optimizer.step()


# -- LoRA --------------------------------------------------------------------------------------


def test_targets_the_blocks_linears_and_convolutions_not_the_ends():
    names = lora_target_names(tiny_unet())
    for expected in (
        "down_blocks.0.resnets.0.conv1",
        "down_blocks.1.resnets.0.conv_shortcut",
        "down_blocks.1.resnets.0.time_emb_proj",
        "down_blocks.1.attentions.0.to_q",
        "mid_block.attentions.0.to_out.0",
        "up_blocks.0.upsamplers.0.conv",
        "down_blocks.0.downsamplers.0.conv",
    ):
        assert expected in names
    assert not {"conv_in", "conv_out", "time_embedding.linear_1"} & set(names)


def test_only_the_adapters_train_and_the_output_starts_unchanged():
    base = tiny_unet()
    model = lora_unet()
    assert set(lora_layers(model)) == set(lora_target_names(base))
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert torch.equal(predict(model), predict(base))  # B starts at zero
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    train_step(model)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[name]), name
        else:
            assert p.grad is not None, name
    assert not torch.equal(predict(model), predict(base))


def test_the_adapters_are_initialised_from_the_seed():
    a, b = lora_unet(), lora_unet()
    assert all(torch.equal(value, adapter_state_dict(b)[key]) for key, value in adapter_state_dict(a).items())


def test_merged_state_dict_is_a_plain_unet_that_computes_the_same():
    model = lora_unet()
    train_step(model)
    merged = merged_state_dict(model)
    plain = tiny_unet()
    assert list(merged) == list(plain.state_dict())
    plain.load_state_dict(merged, strict=True)
    torch.testing.assert_close(predict(plain), predict(model), rtol=1e-4, atol=1e-5)


def test_the_merged_model_saves_and_loads_with_diffusers(tmp_path):
    from diffusers import UNet2DModel

    model = lora_unet("int8")
    train_step(model)
    merged_model(model).save_pretrained(tmp_path)
    loaded = UNet2DModel.from_pretrained(tmp_path)
    torch.testing.assert_close(predict(loaded), predict(model), rtol=1e-4, atol=1e-5)


def test_adapter_state_round_trips():
    model = lora_unet()
    train_step(model)
    state = adapter_state_dict(model)
    assert state and all(".lora_A." in k or ".lora_B." in k for k in state)
    fresh = lora_unet()
    load_adapter_state_dict(fresh, state)
    assert torch.equal(predict(fresh), predict(model))
    with pytest.raises(ValueError, match="missing"):
        load_adapter_state_dict(fresh, dict(list(state.items())[1:]))


# -- the quantized base ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["int8", "nf4"])
@pytest.mark.parametrize(
    "layer",
    [
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.Conv2d(3, 3, 3, stride=2, padding=1),  # 81 weights: an odd count for NF4's pairs
        torch.nn.Conv2d(32, 16, 1, bias=False),
        torch.nn.Linear(48, 40),
    ],
    ids=["conv3x3", "conv-odd", "conv1x1", "linear"],
)
def test_a_quantized_layer_computes_with_its_dequantized_weight(kind, layer):
    torch.manual_seed(0)
    layer.requires_grad_(False)
    quantized = (QuantizedConv2d if isinstance(layer, torch.nn.Conv2d) else QuantizedLinear)(layer, kind)
    inputs = layer.weight.shape[1]
    x = torch.randn((2, inputs, 9, 9) if isinstance(layer, torch.nn.Conv2d) else (5, inputs), requires_grad=True)
    weight = quantized.weight
    assert weight.shape == layer.weight.shape and weight.dtype == torch.float32
    # int8: half a step of 127 per channel; nf4: 16 levels per block of 64
    error = ((weight - layer.weight).norm() / layer.weight.norm()).item()
    assert error < (0.01 if kind == "int8" else 0.12)
    reference = x.detach().clone().requires_grad_(True)
    if isinstance(layer, torch.nn.Conv2d):
        expected = F.conv2d(reference, weight, layer.bias, layer.stride, layer.padding)
    else:
        expected = F.linear(reference, weight, layer.bias)
    out = quantized(x)
    torch.testing.assert_close(out, expected)
    grad = torch.randn(out.shape)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x.grad, reference.grad)
    assert not any(p.requires_grad for p in quantized.parameters())


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_a_quantized_base_trains_its_adapters_and_merges(kind):
    model = lora_unet(kind)
    bases = [layer.base_layer for layer in lora_layers(model).values()]
    assert bases and all(isinstance(base, QuantizedLayer) and base.kind == kind for base in bases)
    train_step(model)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    plain = tiny_unet()
    plain.load_state_dict(merged_state_dict(model), strict=True)
    torch.testing.assert_close(predict(plain), predict(model), rtol=1e-4, atol=1e-5)


def test_quantized_base_under_bf16_autocast():
    model = lora_unet("nf4")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        prediction = model(SAMPLE, TIMESTEPS).sample
    F.mse_loss(prediction.float(), SAMPLE).backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


def test_quantized_base_weights_take_a_quarter_and_a_seventh():
    fp32 = lora_unet()
    base_bytes = sum(layer.base_layer.weight.nbytes for layer in lora_layers(fp32).values())
    sizes = {}
    for kind in ("int8", "nf4"):
        model = lora_unet(kind)
        sizes[kind] = sum(
            layer.base_layer.weight_codes.nbytes + layer.base_layer.weight_scales.nbytes
            for layer in lora_layers(model).values()
        )
    assert sizes["int8"] < 0.3 * base_bytes
    assert sizes["nf4"] < 0.2 * base_bytes


def test_int8_base_requantizes_to_nf4_and_quantization_needs_lora():
    model = quantize_base(lora_unet("int8"), "nf4")
    assert {layer.base_layer.kind for layer in lora_layers(model).values()} == {"nf4"}
    with pytest.raises(ValueError, match="LoRA"):
        quantize_base(tiny_unet(), "int8")
    with pytest.raises(ValueError, match="fp8"):
        quantize_base(lora_unet(), "fp8")
