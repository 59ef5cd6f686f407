"""Unit-wise adaptive gradient clipping (`fl.agc`, NFNets): the clip by hand, the classifier left
alone, and both client drivers applying it alike."""

import math

import pytest
import torch
from torch import nn

from hfl.client import adaptively_clipped, clip_adaptively
from hfl.errors import ConfigError
from hfl.models import build_model
from hfl.server import run_experiment
from tests.conftest import small_config
from tests.test_lightning import weights
from tests.test_server import scores


def test_each_unit_is_clipped_to_lambda_times_its_weight_norm_by_hand():
    # Filter 0: ‖θ‖ = 5, ‖g‖ = 10 > 0.5·5, scaled to 2.5. Filter 1: ‖θ‖ = 1, ‖g‖ = 0.1 < 0.5: kept.
    # The bias is one unit: ‖θ‖ = 0 is floored at 1e-3, ‖g‖ = 2 is scaled to 5e-4.
    weight = nn.Parameter(torch.tensor([[3.0, 4.0], [1.0, 0.0]]))
    weight.grad = torch.tensor([[6.0, 8.0], [0.0, 0.1]])
    bias = nn.Parameter(torch.zeros(2))
    bias.grad = torch.tensor([0.0, 2.0])
    clip_adaptively([weight, bias], 0.5)
    assert torch.allclose(weight.grad, torch.tensor([[1.5, 2.0], [0.0, 0.1]]))
    assert torch.allclose(bias.grad, torch.tensor([0.0, 5e-4]))
    assert math.isclose(float(weight.grad[0].norm()), 2.5, rel_tol=1e-6)


def test_the_classifier_is_never_clipped_and_every_other_trainable_parameter_is():
    model = build_model("preresnet20", 1, 10, width=0.25, norm="none")
    clipped = {id(p) for p in adaptively_clipped([model])}
    names = {n for n, p in model.named_parameters() if id(p) in clipped}
    assert set(model.classifier_keys()) == {"head.fc.weight", "head.fc.bias"}
    assert names == {n for n, _ in model.named_parameters()} - set(model.classifier_keys())


def test_a_negative_lambda_names_the_field():
    with pytest.raises(ConfigError, match=r"fl\.agc.*-0\.1"):
        small_config(fl={"agc": -0.1})


def test_agc_changes_the_run_and_both_drivers_apply_it_alike(tmp_path):
    runs = {}
    for name, fl, trainer in [("plain", {}, "fast"), ("fast", {"agc": 0.01}, "fast"), ("lightning", {"agc": 0.01}, "lightning")]:
        run_experiment(small_config(fl={"rounds": 2, **fl}, backend={"device": "cpu", "trainer": trainer}), tmp_path / name)
        runs[name] = weights(tmp_path / name)
    assert scores(tmp_path / "fast") == scores(tmp_path / "lightning")
    assert all(torch.equal(runs["fast"][k], runs["lightning"][k]) for k in runs["fast"])
    assert not all(torch.equal(runs["fast"][k], runs["plain"][k]) for k in runs["fast"])
