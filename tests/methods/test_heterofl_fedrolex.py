"""HeteroFL and FedRolex: budget-fitted widths, the bit-for-bit FedAvg check, the rolling rule."""

import pytest
import torch

from hfl.loggers import read_metrics
from hfl.methods.base import MethodState
from hfl.methods.heterofl import WidthOptions, scaled_conv_outputs
from hfl.models import build_model
from hfl.server import run_experiment, train_settings
from hfl.types import RoundContext
from tests.conftest import method_for, small_config


def numbers(out):
    return [(r["accuracy"], r["loss"], [c["train_loss"] for c in r["clients"]]) for r in read_metrics(out)]


def test_heterofl_at_width_one_is_fedavg_bit_for_bit(tmp_path):
    run_experiment(small_config(model={"norm": "bn"}), tmp_path / "avg")
    run_experiment(small_config(model={"norm": "bn"}, method={"name": "heterofl", "widths": [1.0], "weighting": "samples"}), tmp_path / "hetero")
    assert numbers(tmp_path / "hetero") == numbers(tmp_path / "avg")


@pytest.mark.parametrize("method", ["heterofl", "fedrolex"])
def test_budgets_are_respected_and_submodels_evaluated(tmp_path, method):
    config = small_config(method={"name": method}, model={"name": "preresnet20"}, budgets={"scenario": "fair"},
                          fl={"rounds": 2, "clients": 8, "fraction": 1.0})
    summary = run_experiment(config, tmp_path)
    assert summary["budget_violations"] == 0
    widths = {c["tier"]: c["submodel"]["width"] for r in read_metrics(tmp_path) for c in r["clients"]}
    assert widths["w1"] == 1.0 and widths["w1_6"] < widths["w1_3"] < widths["w1_2"] < 1.0
    assert set(summary["submodel_accuracy"]) == {"x0.0625", "x0.125", "x0.25", "x0.5", "x1"}
    assert summary["worst_submodel_accuracy"] == min(summary["submodel_accuracy"].values())
    assert summary["worst_submodel_accuracy"] <= summary["mean_submodel_accuracy"] <= max(summary["submodel_accuracy"].values())


def fedrolex_windows(roll, rounds, width=0.25):
    """The channels of block0 (Q = 32) a width-`width` FedRolex client holds in each of `rounds`."""
    config = small_config(method={"name": "fedrolex", "widths": [width], "roll": roll})
    method = method_for(config.method)
    group = next(g for g in method.model.channel_groups() if g.name == "block0")
    key, dim = group.members[0]
    return [method.plan(RoundContext(r, 0, 0, 10, train_settings(config.fl, r)), MethodState()).spec.indices[key][dim].tolist()
            for r in rounds]


def test_fedrolex_window_follows_eq_8_and_9():
    rounds = (1, 2, 30, 31, 33)
    windows = fedrolex_windows("forward", rounds)
    for r, held in zip(rounds, windows):
        start = (r - 1) % 32
        assert held == [(start + k) % 32 for k in range(8)]  # Eq. 8, wrapping per Eq. 9
    covered = {c for window in windows for c in window}
    assert 31 in covered and 0 in covered


def test_fedrolex_backward_roll_is_the_authors_torch_roll():
    rounds = (1, 2, 3, 33)
    for r, held in zip(rounds, fedrolex_windows("backward", rounds)):
        assert held == torch.roll(torch.arange(32), r - 1)[:8].tolist()


def test_fedrolex_keeps_ceil_of_s_q_channels():
    assert [len(w) for w in fedrolex_windows("forward", (1,), width=0.2)] == [7]  # ceil(6.4); floor would be 6


def test_scaler_divides_conv_outputs_while_active():
    model = build_model("cnn", 1, 10).eval()
    x = torch.randn(2, 1, 8, 8)
    conv = model.body[0][0]
    plain = conv(x)
    with scaled_conv_outputs(model, 0.5):
        torch.testing.assert_close(conv(x), plain / 0.5)
    torch.testing.assert_close(conv(x), plain)


def test_masked_cross_entropy_zeroes_absent_classes():
    from hfl.client import ClientModule
    from hfl.submodel import full_spec
    from hfl.types import ClientTask

    config = small_config(method={"name": "heterofl", "masked_ce": True})
    model = build_model("cnn", 1, 10)
    method = method_for(config.method)
    ctx = RoundContext(1, 0, 0, 4, train_settings(config.fl, 1))
    client = ClientModule(model, method, ClientTask(ctx, full_spec(), WidthOptions(1.0)), classes=torch.tensor([2, 5]))
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([2, 5, 5, 2])
    logits = model(x)
    keep = torch.zeros(10, dtype=torch.bool)
    keep[[2, 5]] = True
    expected = torch.nn.functional.cross_entropy(logits.masked_fill(~keep, 0.0), y)
    torch.testing.assert_close(method.objective(client, x, y)["loss"], expected)
