"""MobileNetV2 (CIFAR variant) against torchvision's reference, its CIFAR strides, width slicing,
costs and a federated run."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from hfl.accounting.analytic import AnalyticCosts
from hfl.models import build_model
from hfl.models.mobilenetv2 import InvertedResidual
from hfl.server import run_experiment
from hfl.submodel import extract, width_spec
from tests.conftest import small_config

TORCHVISION_PARAMS = 2_236_682
"""sum(p.numel()) of torchvision.models.mobilenet_v2(num_classes=10) (torchvision 0.29)."""
RESIDUAL_BLOCKS = [2, 4, 5, 7, 8, 9, 11, 12, 14, 15]
"""Stride-1 blocks with equal channels: every block of a stage but its first (stages of 1, 2, 3, 4, 3, 3, 1 blocks)."""


def cifar_torchvision() -> nn.Module:
    """torchvision's MobileNetV2 with the stem and the c=24 stage's first block at stride 1, in
    training mode without its dropout: batch statistics keep the activations of torchvision's
    initialisation from vanishing (they reach 1e-9 through the initial running statistics), so
    a missing branch or shortcut shows in the logits."""
    torch.manual_seed(1)
    reference = torchvision.models.mobilenet_v2(num_classes=10)
    reference.features[0][0].stride = (1, 1)
    reference.features[2].conv[1][0].stride = (1, 1)
    reference.classifier[0].p = 0.0
    return reference.train()


def forward_flops(model: nn.Module, x: torch.Tensor) -> int:
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(x)
    return counter.get_total_flops()


def test_parameters_equal_torchvisions_layer_by_layer() -> None:
    model, reference = build_model("mobilenetv2", 3, 10), torchvision.models.mobilenet_v2(num_classes=10)

    shapes = [tuple(p.shape) for p in model.parameters()]

    assert sum(p.numel() for p in model.parameters()) == TORCHVISION_PARAMS
    assert sum(p.numel() for p in reference.parameters()) == TORCHVISION_PARAMS
    assert shapes == [tuple(p.shape) for p in reference.parameters()]


def test_computes_torchvisions_network_with_the_cifar_strides() -> None:
    """Loaded with the reference's weights (same layers in the same order), the model computes what
    torchvision's MobileNetV2 computes with the two CIFAR strides, at the same FLOPs."""
    reference = cifar_torchvision()
    model = build_model("mobilenetv2", 3, 10).train()
    model.load_state_dict(dict(zip(model.state_dict(), reference.state_dict().values())))
    x = torch.randn(4, 3, 32, 32)

    with torch.no_grad():
        expected = reference(x)
        torch.testing.assert_close(model(x), expected)
    assert expected.std() > 0.01  # far above the comparison's tolerance
    assert forward_flops(model, x) == forward_flops(reference, x)


@pytest.mark.parametrize(("size", "final"), [(32, 4), (8, 1)])
def test_three_downsamplings_leave_cifar_at_4x4_and_digits_at_1x1(size: int, final: int) -> None:
    model = build_model("mobilenetv2", 3, 10, width=0.25)
    x = torch.randn(2, 3, size, size)

    assert model.features(x).shape == (2, 32 * 10, final, final)  # the 1280 channels at width 1/4
    assert model(x).shape == (2, 10)


def test_residual_only_where_stride_is_1_and_channels_are_equal() -> None:
    model = build_model("mobilenetv2", 3, 10)

    residual = [i for i, block in enumerate(model.body) if isinstance(block, InvertedResidual)]

    assert residual == RESIDUAL_BLOCKS
    assert [b.index for b in model.blocks() if b.droppable] == RESIDUAL_BLOCKS
    assert len(model.body) == 18  # 17 inverted residual blocks and the conv1x1 to 1280


@pytest.mark.parametrize("width", [0.5, 0.1667])
def test_a_width_slice_is_the_upper_left_corner_and_runs(width: float) -> None:
    full = build_model("mobilenetv2", 3, 10)
    state = full.state_dict()
    narrow = build_model("mobilenetv2", 3, 10, width=width)

    sliced = extract(state, width_spec(full, width))
    narrow.load_state_dict(sliced, strict=True)

    for key, tensor in narrow.state_dict().items():
        assert torch.equal(tensor, state[key][tuple(slice(0, n) for n in tensor.shape)]), key
    depthwise = [m for m in narrow.modules() if isinstance(m, nn.Conv2d) and m.groups > 1]
    assert len(depthwise) == 17
    assert all(m.groups == m.in_channels == m.out_channels for m in depthwise)
    assert narrow(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_analytic_costs_equal_the_built_models() -> None:
    """Parameters and FLOPs counted from the declared groups (depthwise weights coupled on their
    outputs only) equal those of the model built at that width."""
    costs = AnalyticCosts(build_model("mobilenetv2", 3, 10), "linear", (3, 32, 32))
    narrow = build_model("mobilenetv2", 3, 10, width=0.5)

    assert costs.params(0.5, 18, frozenset()) == sum(p.numel() for p in narrow.parameters())
    assert costs.flops(0.5, 18, frozenset()) == forward_flops(narrow, torch.randn(1, 3, 32, 32))


@pytest.mark.slow
def test_heterofl_round_on_digits(tmp_path) -> None:
    """Width sub-models of the CIFAR variant train and are scored on 8x8 digits."""
    config = small_config(model={"name": "mobilenetv2", "width": 0.25}, method={"name": "heterofl"},
                          fl={"rounds": 1, "clients": 2, "fraction": 1.0, "sbn_samples": 256})

    summary = run_experiment(config, tmp_path)

    assert summary["rounds"] == 1 and summary["client_rounds"] == 2
    assert 0 <= summary["final_accuracy"] <= 1
