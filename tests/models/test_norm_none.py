"""`model.norm=none`: models without normalisation layers (FedMef's NSConv models, ReLU -> conv)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hfl.config import ModelConfig
from hfl.errors import ConfigError
from hfl.models import build_model
from hfl.models.exits import add_exits
from hfl.server import run_experiment
from tests.conftest import small_config

NO_NORM_MODELS = ["preresnet20", "resnet18", "mobilenetv2"]
NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)


@pytest.mark.parametrize("name", NO_NORM_MODELS)
def test_holds_only_conv_and_linear_tensors_and_trains(name: str) -> None:
    torch.manual_seed(0)
    model, with_bn = build_model(name, 3, 10, width=0.25, norm="none"), build_model(name, 3, 10, width=0.25, norm="bn")
    layers = {f"{n}.{k}" for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear)) for k, _ in m.named_parameters()}
    bn_affine = sum(p.numel() for m in with_bn.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters())

    logits = model(torch.randn(2, 3, 32, 32))
    logits.sum().backward()

    assert not any(isinstance(m, NORM_TYPES) for m in model.modules())
    assert set(model.state_dict()) == layers
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in with_bn.parameters()) - bn_affine
    assert logits.shape == (2, 10)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_a_preactivation_block_adds_its_unactivated_input() -> None:
    """Without a norm the ReLU must not act in place: it would rectify the residual stream itself."""
    block = build_model("preresnet20", 3, 10, width=0.25, norm="none").body[1]  # an identity-shortcut block
    x = torch.randn(2, 4, 8, 8)

    out = block(x.clone())

    expected = x + block.conv2(torch.relu(block.conv1(torch.relu(x))))
    torch.testing.assert_close(out, expected)


def test_exits_read_features_the_next_block_leaves_alone() -> None:
    """An exit and the next pre-activation block read the same features; backward needs them unchanged."""
    model = add_exits(build_model("preresnet20", 3, 10, width=0.25, norm="none"), range(8))

    sum(out.sum() for out in model.forward_exits(torch.randn(2, 3, 16, 16))).backward()

    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(("model", "method"), [({"name": "preresnet20"}, "depthfl"), ({"name": "mobilenetv2", "width": 0.25}, "heterofl")])
def test_a_round_runs_and_scores_the_model_without_norms(tmp_path, model: dict, method: str) -> None:
    """DepthFL's exits on a pre-activation net; HeteroFL, whose default is static batch norm, evaluated
    without recomputing statistics there are none of."""
    config = small_config(model={**model, "norm": "none"}, method={"name": method}, fl={"rounds": 1, "clients": 2, "fraction": 1.0})

    summary = run_experiment(config, tmp_path)

    assert summary["rounds"] == 1 and summary["client_rounds"] == 2
    assert 0 <= summary["final_accuracy"] <= 1


def test_config_names_the_allowed_norms() -> None:
    with pytest.raises(ConfigError, match="one of auto, bn, static_bn, none"):
        ModelConfig(norm="group")
    with pytest.raises(ConfigError, match="norm='none'.*pretrained"):
        ModelConfig(name="resnet18", norm="none", pretrained="/weights")
