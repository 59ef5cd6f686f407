"""Contract tests run on every registered model: forward/backward, channel groups, blocks, sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hfl.models  # noqa: F401  (registers every model)
from hfl.models.base import ResidualBlock, ScalableModel
from hfl.registry import MODELS

NAMES = list(MODELS)
WIDTHS = (1.0, 0.5, 0.1667)
INPUTS = ((1, 8, 8), (3, 32, 32))  # scikit-learn digits, CIFAR
NUM_CLASSES = 10

EXPECTED_BLOCKS = {
    "cnn": 2, "preresnet20": 9, "resnet18": 8, "resnet34": 16, "resnet56": 27, "resnet110": 54, "mobilenetv2": 18, "gpt": 12,
}

# Exact parameter counts (3 input channels, 10 classes, width 1), next to the published sizes.
# ResNet-56/110 use 1x1 conv + BN projections (option B), 2,752 parameters more than the
# zero-padding shortcuts (option A) of the 0.85M / 1.7M figures.
EXACT_PARAMS = {"preresnet20": 272_282, "resnet18": 11_173_962, "resnet56": 855_770, "resnet110": 1_730_714}
PUBLISHED_PARAMS = {"preresnet20": 0.27e6, "resnet18": 11.17e6, "resnet56": 0.85e6, "resnet110": 1.7e6}


def build(name: str, in_channels: int = 3, width: float = 1.0, norm: str = "bn") -> ScalableModel:
    torch.manual_seed(0)
    return MODELS.get(name)(in_channels, NUM_CLASSES, width=width, norm=norm)


def test_expected_models_are_registered() -> None:
    assert set(EXPECTED_BLOCKS) <= set(NAMES)


@pytest.mark.parametrize("shape", INPUTS, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", NAMES)
def test_forward_backward(name: str, width: float, shape: tuple[int, int, int]) -> None:
    """With hfl's default objective on the inputs the model reads (a language model's token ids
    stand in for the images): one row of class scores per target, the class dimension second."""
    model = build(name, shape[0], width)
    x, y = model.example_batch(2, shape[0], shape[-1])

    logits = model(x)
    F.cross_entropy(logits, y).backward()

    assert logits.shape == (2, NUM_CLASSES, *y.shape[1:])
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient for {missing}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("norm", ["bn", "static_bn"])
def test_static_bn_forward(norm: str) -> None:
    model = build("preresnet20", 1, 0.5, norm=norm)

    logits = model(torch.randn(2, 1, 8, 8))

    has_stats = any(k.endswith("running_mean") for k in model.state_dict())
    assert logits.shape == (2, NUM_CLASSES)
    assert has_stats == (norm == "bn")


@pytest.mark.parametrize("norm", ["bn", "static_bn"])
@pytest.mark.parametrize("ratio", [0.5, 0.1667])
@pytest.mark.parametrize("name", NAMES)
def test_channel_groups_slice_to_smaller_width(name: str, ratio: float, norm: str) -> None:
    full, small = build(name, width=1.0, norm=norm), build(name, width=ratio, norm=norm)
    full_state = full.state_dict()

    expected = {k: list(v.shape) for k, v in full_state.items()}
    seen: set[tuple[str, int]] = set()
    for group in full.channel_groups():
        assert group.size == group.base
        assert group.members, f"group {group.name} indexes no weight"
        for key, dim in group.members:
            assert (key, dim) not in seen, f"{key} dim {dim} is in two groups"
            seen.add((key, dim))
            assert full_state[key].shape[dim] == group.size, (group.name, key, dim)
            expected[key][dim] = group.kept(ratio)

    small_shapes = {k: list(v.shape) for k, v in small.state_dict().items()}
    assert small_shapes == expected
    assert all(g.size == g.kept(ratio) and g.size % g.unit == 0 for g in small.channel_groups())


@pytest.mark.parametrize("name", NAMES)
def test_blocks_exits_and_depth_dropping(name: str) -> None:
    model = build(name, width=0.5)
    blocks, exits = model.blocks(), model.exit_points()
    assert [b.index for b in blocks] == list(range(len(model.body)))
    assert [e.after_block for e in exits] == [b.index for b in blocks]
    if name in EXPECTED_BLOCKS:
        assert len(blocks) == EXPECTED_BLOCKS[name]

    x, _ = model.example_batch(2)
    h = model.stem(x)
    for block, exit_point, layer in zip(blocks, exits, model.body):
        out = layer(h)
        assert block.droppable == (out.shape == h.shape), block.name
        assert exit_point.channels == out.shape[1] and exit_point.group == block.out_group
        h = out

    droppable = {b.index for b in blocks if b.droppable}
    fixed = [b.index for b in blocks if not b.droppable]
    if fixed and not isinstance(model.body[fixed[-1]], ResidualBlock):
        with pytest.raises(ValueError):
            model.drop_blocks({fixed[-1]})
    elif fixed:  # a shape-changing residual block keeps its projection shortcut (NeFL's depth scaling)
        kept = model.body[fixed[-1]].shortcut_modules
        model.drop_blocks({fixed[-1]})
        assert {name for name, _ in model.body[fixed[-1]].named_children()} <= set(kept)
    model.drop_blocks(droppable)
    logits = model(x)
    assert logits.shape[:2] == (2, NUM_CLASSES)
    state = model.state_dict()
    for group in model.channel_groups():
        assert all(state[k].shape[d] == group.size for k, d in group.members)


@pytest.mark.parametrize("name", sorted(EXACT_PARAMS))
def test_parameter_counts(name: str) -> None:
    count = sum(p.numel() for p in build(name).parameters())

    assert count == EXACT_PARAMS[name]
    assert abs(count - PUBLISHED_PARAMS[name]) <= 0.02 * PUBLISHED_PARAMS[name]
