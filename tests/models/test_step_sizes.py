"""Learnable step sizes (NeFL): off by default, exact at 1, scalars outside every channel group."""

from __future__ import annotations

import copy

import pytest
import torch

from hfl.submodel.copies import nefl_do_step_sizes
from hfl.models import build_model
from hfl.models.vit import ViT
from hfl.registry import MODELS
from hfl.submodel import extract, scatter, width_spec

SHAPES = {"preresnet20": (3, 16, 16), "resnet18": (3, 16, 16), "vit": (3, 16, 16)}


def tiny(name: str, width: float = 1.0):
    """Small instances: ResNets at a quarter width, a 4-block ViT of dim 12."""
    torch.manual_seed(0)
    if name == "vit":
        return ViT(3, 10, width, patch_size=4, dim=12, depth=4, heads=3, image_size=16)
    return build_model(name, 3, 10, width=0.25 * width)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_are_built_without_step_sizes(name: str) -> None:
    model = MODELS.get(name)(3, 10, width=0.1667)

    assert model.step_size_keys() == []
    assert not any("step" in key for key in model.state_dict())


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_step_sizes_at_one_compute_the_plain_model(name: str) -> None:
    plain = tiny(name).eval()
    stepped = copy.deepcopy(plain)
    stepped.add_step_sizes(1.0)
    x = torch.randn(2, *SHAPES[name])

    assert torch.equal(stepped(x), plain(x))
    assert set(stepped.state_dict()) - set(plain.state_dict()) == set(stepped.step_size_keys())


def test_step_size_keys_sit_under_their_blocks() -> None:
    resnet, vit = tiny("preresnet20"), tiny("vit")
    resnet.add_step_sizes()
    vit.add_step_sizes()

    assert resnet.step_size_keys() == [f"body.{i}.step" for i in range(9)]
    assert vit.step_size_keys()[:2] == ["body.0.attn_step", "body.0.mlp_step"]
    assert len(vit.step_size_keys()) == 2 * len(vit.body)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_step_sizes_are_trainable_scalars(name: str) -> None:
    model = tiny(name)
    model.add_step_sizes([0.5 + i for i in range(len(model.body))])
    params = dict(model.named_parameters())

    model(torch.randn(2, *SHAPES[name])).sum().backward()

    for key in model.step_size_keys():
        assert params[key].shape == () and params[key].requires_grad
        assert params[key].grad is not None and torch.isfinite(params[key].grad)
    assert float(model.state_dict()[model.step_size_keys()[-1]]) == 0.5 + len(model.body) - 1


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_width_slicing_keeps_step_sizes_whole(name: str) -> None:
    full = tiny(name)
    full.add_step_sizes([1.0 + i for i in range(len(full.body))])
    spec = width_spec(full, full.width / 2)
    state = full.state_dict()

    sub_state = extract(state, spec)
    half = tiny(name, width=0.5)
    half.add_step_sizes()
    half.load_state_dict(sub_state, strict=True)
    values, coverage = scatter(sub_state, spec, state)

    assert not set(full.step_size_keys()) & set(spec.indices)
    for key in full.step_size_keys():
        assert torch.equal(sub_state[key], state[key]) and torch.equal(half.state_dict()[key], state[key])
        assert torch.equal(values[key], state[key]) and bool(coverage[key])
    assert half(torch.randn(2, *SHAPES[name])).shape == (2, 10)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_dropped_blocks_are_skipped(name: str) -> None:
    model = tiny(name)
    model.add_step_sizes()
    droppable = [b.index for b in model.blocks() if b.droppable]
    dropped = set(droppable[1::2])
    original = list(model.body)
    calls = [0] * len(original)
    for i, block in enumerate(original):
        block.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))

    model.drop_blocks(dropped)
    logits = model(torch.randn(2, *SHAPES[name]))

    assert logits.shape == (2, 10)
    assert [i for i, n in enumerate(calls) if n == 0] == sorted(dropped)
    assert all(n == 1 for i, n in enumerate(calls) if i not in dropped)
    assert not any(key.startswith(tuple(f"body.{i}." for i in dropped)) for key in model.step_size_keys())


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_zero_step_size_computes_what_skipping_the_block_computes(name: str) -> None:
    full = tiny(name).eval()
    omitted = {b.index for b in full.blocks() if b.droppable} - {0}
    steps = nefl_do_step_sizes(len(full.body), omitted)
    skipping = copy.deepcopy(full)
    full.add_step_sizes(steps)
    skipping.drop_blocks(omitted)
    skipping.add_step_sizes(steps)
    x = torch.randn(2, *SHAPES[name])

    assert torch.allclose(full(x), skipping(x), atol=1e-6)


def test_nefl_do_gives_the_kept_block_before_a_gap_one_step_per_skipped_block() -> None:
    # The paper's example: without block 2, Y3 = Y0 + F0 + 2 F1 (s0 = 1, s1 = 2, s2 = 0).
    assert nefl_do_step_sizes(3, {2}) == [1.0, 2.0, 0.0]
    assert nefl_do_step_sizes(4, set()) == [1.0] * 4
    assert nefl_do_step_sizes(6, {2, 3, 5}) == [1.0, 3.0, 0.0, 0.0, 2.0, 0.0]
    # a gap at the start of the body has no block before it and is not compensated
    assert nefl_do_step_sizes(5, {0, 1, 3}) == [0.0, 0.0, 2.0, 0.0, 1.0]


@pytest.mark.parametrize(
    "row",
    [
        # Kang et al., Table 12 (NeFL-DO on ResNet-56: three stages of nine blocks), submodels 1, 2, 4
        [1, 8, 0, 0, 0, 0, 0, 0, 0] * 3,
        [1, 1, 7, 0, 0, 0, 0, 0, 0] * 2 + [1, 1, 1, 6, 0, 0, 0, 0, 0],
        [1, 1, 1, 6, 0, 0, 0, 0, 0] * 2 + [1, 1, 1, 1, 1, 4, 0, 0, 0],
        [1] * 9 + [1, 1, 1, 1, 1, 1, 1, 2, 0] + [1, 1, 1, 1, 1, 1, 3, 0, 0],
    ],
)
def test_nefl_do_reproduces_the_papers_resnet56_table(row: list[int]) -> None:
    omitted = {i for i, s in enumerate(row) if s == 0}

    assert nefl_do_step_sizes(len(row), omitted) == [float(s) for s in row]


def test_nefl_do_rejects_blocks_outside_the_body() -> None:
    with pytest.raises(ValueError, match="omitted blocks"):
        nefl_do_step_sizes(3, {3})


def test_step_sizes_need_residual_blocks_and_one_value_per_block() -> None:
    with pytest.raises(TypeError, match="not residual"):
        build_model("cnn", 1, 10).add_step_sizes()
    with pytest.raises(ValueError, match="one per body block"):
        tiny("preresnet20").add_step_sizes([1.0, 2.0])
