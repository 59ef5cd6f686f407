"""The ViT: widths, head layout under width slicing, exits, depth scaling and cost accounting."""

from __future__ import annotations

import pytest
import torch

from hfl.accounting.cost import measure_training_cost
from hfl.models import build_model
from hfl.models.base import ScalableModel
from hfl.models.exits import add_exits
from hfl.models.vit import Attention, ViT
from hfl.submodel import extract, full_spec, shape_model, truncate, width_spec

INPUTS = ((1, 8, 8), (3, 32, 32))  # digits, CIFAR


def small(in_channels: int = 3, width: float = 1.0, **sizes: int) -> ViT:
    torch.manual_seed(0)
    options = {"dim": 24, "depth": 3, "heads": 3, "image_size": 32, **sizes}
    return ViT(in_channels, 10, width, **options)


@pytest.mark.parametrize("shape", INPUTS, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("width", [1.0, 0.5])
def test_forward_backward_at_full_and_half_width(width: float, shape: tuple[int, int, int]) -> None:
    model = small(shape[0], width)

    logits = model(torch.randn(2, *shape))
    logits.sum().backward()

    assert logits.shape == (2, 10)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("shape", INPUTS, ids=lambda s: "x".join(map(str, s)))
def test_a_width_slice_of_the_full_model_loads_into_a_half_width_model(shape: tuple[int, int, int]) -> None:
    full = small(shape[0])
    full.add_step_sizes(1.5)
    half = small(shape[0], 0.5)
    half.add_step_sizes()

    half.load_state_dict(extract(full.state_dict(), width_spec(full, 0.5)), strict=True)

    assert half.stem.proj.out_channels == 12 and half.body[0].attn.q.out_features == 12
    assert half.body[0].mlp.fc1.out_features == 48
    assert float(half.state_dict()["body.2.mlp_step"]) == 1.5
    assert half(torch.randn(2, *shape)).shape == (2, 10)


def test_default_sizes_and_parameter_counts() -> None:
    full, half = build_model("vit", 3, 10), build_model("vit", 3, 10, width=0.5)

    assert len(full.body) == 6 and full.stem.proj.kernel_size == (4, 4) and full.body[0].attn.heads == 3
    assert sum(p.numel() for p in full.parameters()) == 2_693_194
    assert sum(p.numel() for p in half.parameters()) == 683_050
    assert len(build_model("vit_tiny", 3, 10, width=0.1667).body) == 12


def _zero_channels_from(attn: Attention, keep: int) -> None:
    with torch.no_grad():
        for layer in (attn.q, attn.k, attn.v):
            layer.weight[keep:] = 0
            layer.bias[keep:] = 0
        attn.proj.weight[:, keep:] = 0


@pytest.mark.parametrize("keep", [6, 7])  # 7 of 3 heads: the first head keeps one dimension more
def test_a_narrow_attention_is_every_head_narrowed(keep: int) -> None:
    """Channel c of q, k, v is a dimension of head c % heads at every width, so a width slice is the
    full attention with the dropped channels zeroed (at the same score scale)."""
    owner = ScalableModel(1.0, 10, "bn", head_norm=False)
    torch.manual_seed(0)
    full, narrow = Attention(owner, 12, 12, 3, ("e", "a")), Attention(owner, 12, keep, 3, ("e", "a2"))
    _zero_channels_from(full, keep)
    with torch.no_grad():
        for name in ("q", "k", "v"):
            getattr(narrow, name).weight.copy_(getattr(full, name).weight[:keep])
            getattr(narrow, name).bias.copy_(getattr(full, name).bias[:keep])
        narrow.proj.weight.copy_(full.proj.weight[:, :keep])
        narrow.proj.bias.copy_(full.proj.bias)
    narrow.scale = full.scale
    x = torch.randn(2, 5, 12)

    assert torch.allclose(narrow(x), full(x), atol=1e-6)


@pytest.mark.parametrize("kind", ["linear", "bottleneck"])
def test_exits_give_a_truncated_slice_the_global_models_exit(kind: str) -> None:
    model = small()
    add_exits(model, range(len(model.body) - 1), kind)
    model.eval()
    x = torch.randn(2, 3, 32, 32)
    outputs = model.forward_exits(x)
    spec = truncate(full_spec(), model, 2)
    client = small()
    add_exits(client, range(len(client.body) - 1), kind)
    sub = shape_model(client, spec).eval()

    sub.load_state_dict(extract(model.state_dict(), spec), strict=True)

    assert len(outputs) == len(model.body) and all(o.shape == (2, 10) for o in outputs)
    assert torch.allclose(sub(x), outputs[1], atol=1e-6)


def test_every_encoder_block_is_droppable() -> None:
    model = small(depth=4)
    model.drop_blocks({1, 2, 3})

    assert all(b.droppable for b in model.blocks())
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize("norm", ["layer", "none"])
def test_norm_must_be_a_batch_norm_kind(norm: str) -> None:
    """'none' too: it removes batch norm, and the ViT's layer norms are part of its architecture."""
    with pytest.raises(ValueError, match="model.norm=.*one of bn, static_bn"):
        small(norm=norm)


def test_training_cost_counts_every_matmul() -> None:
    dim, depth, hidden, tokens, classes = 24, 3, 96, 64, 10
    model = small()

    cost = measure_training_cost(model, (3, 32, 32), classes, batch_size=8)

    per_block = 4 * 2 * tokens * dim * dim + 2 * 2 * tokens * tokens * dim + 2 * 2 * tokens * dim * hidden
    expected = 2 * tokens * dim * 3 * 16 + depth * per_block + 2 * dim * classes
    assert cost.forward_flops_per_sample == expected
    assert cost.backward_flops_per_sample > cost.forward_flops_per_sample
    assert cost.activation_bytes > 0 and cost.peak_bytes > cost.param_bytes
    half = measure_training_cost(small(width=0.5), (3, 32, 32), classes, batch_size=8)
    assert half.forward_flops_per_sample < cost.forward_flops_per_sample
