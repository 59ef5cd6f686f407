"""HeteroFL and FedRolex: budget-fitted widths, the bit-for-bit FedAvg check, the rolling rule."""

import pytest
import torch

from hfl.loggers import read_metrics
from hfl.methods.base import MethodState
from hfl.methods.heterofl import WidthOptions, scaled_conv_outputs
from hfl.models import build_model
from hfl.server import run_experiment, train_settings
from hfl.types import RoundContext
from tests.conftest import (
    assert_submodels_scored_on_final_weights,
    method_for,
    run_with_env,
    small_config,
)


def numbers(out):
    return [(r["accuracy"], r["loss"], [c["train_loss"] for c in r["clients"]]) for r in read_metrics(out)]


def final_weights(out):
    return torch.load(out / "checkpoint.pt", weights_only=False)["global_state"]


def assert_same_weights(a, b):
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.slow
@pytest.mark.parametrize(("norm", "weighting"), [("bn", "samples"), ("static_bn", "clients")])
def test_heterofl_at_width_one_is_fedavg_bit_for_bit(tmp_path, norm, weighting):
    """On PreResNet-20 (batch norms in every block): with the same `model.norm` and the same
    `method.weighting` on both sides, HeteroFL at rate 1 gives FedAvg's weights and metrics bit for
    bit. ("static_bn", "clients") is HeteroFL's default against FedAvg set to match it."""
    fl = {"rounds": 2}
    run_experiment(small_config(model={"name": "preresnet20", "norm": norm}, method={"name": "fedavg", "weighting": weighting}, fl=fl),
                   tmp_path / "avg")
    hetero = {"name": "heterofl", "widths": [1.0]} | ({} if weighting == "clients" else {"weighting": weighting})
    run_experiment(small_config(model={"name": "preresnet20"} | ({} if norm == "static_bn" else {"norm": norm}), method=hetero, fl=fl),
                   tmp_path / "hetero")
    assert numbers(tmp_path / "hetero") == numbers(tmp_path / "avg")
    assert_same_weights(final_weights(tmp_path / "hetero"), final_weights(tmp_path / "avg"))


@pytest.mark.parametrize("method", ["heterofl", "fedrolex"])
@pytest.mark.slow
def test_budgets_are_respected_and_submodels_evaluated(tmp_path, monkeypatch, method):
    config = small_config(method={"name": method}, model={"name": "preresnet20"}, budgets={"scenario": "fair"},
                          fl={"rounds": 2, "clients": 8, "fraction": 1.0})
    summary, env, checkpoint = run_with_env(config, tmp_path, monkeypatch)
    assert summary["budget_violations"] == 0
    widths = {c["tier"]: c["submodel"]["width"] for r in read_metrics(tmp_path) for c in r["clients"]}
    assert widths["w1"] == 1.0 and widths["w1_6"] < widths["w1_3"] < widths["w1_2"] < 1.0
    accuracy = summary["submodel_accuracy"]
    assert set(accuracy) == {"x0.0625", "x0.125", "x0.25", "x0.5", "x1"}
    # Each width is scored as its own sub-model (not the global model five times).
    assert_submodels_scored_on_final_weights(summary, env, checkpoint)
    assert accuracy["x1"] == summary["final_accuracy"] and len(set(accuracy.values())) > 1


def fedrolex_windows(roll, rounds, width=0.25, model="cnn", group_name="block0"):
    """The channels of a coupled group (the cnn's block0: Q = 32) a width-`width` FedRolex client
    holds in each of `rounds`."""
    config = small_config(method={"name": "fedrolex", "widths": [width], "roll": roll})
    method = method_for(config.method, model, in_channels=3, input_size=32) if model != "cnn" else method_for(config.method)
    group = next(g for g in method.model.channel_groups() if g.name == group_name)
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


def test_fedrolex_window_of_ceil_s_q_channels_rolls_and_wraps():
    """PreResNet-20's first stage, Q = 16 at s = 1/6: sQ = 2.67, so the window holds ceil = 3
    channels (floor would hold 2), rolling by one per round and wrapping past channel 15."""
    rounds = (1, 2, 14, 15, 16, 17)
    windows = fedrolex_windows("forward", rounds, width=1 / 6, model="preresnet20", group_name="stage1")
    for r, held in zip(rounds, windows):
        start = (r - 1) % 16
        assert held == [(start + k) % 16 for k in range(3)], r  # Eq. 8, wrapping per Eq. 9
    assert windows[3] == [14, 15, 0] and windows[5] == [0, 1, 2]
    backward = fedrolex_windows("backward", (1, 2, 17), width=1 / 6, model="preresnet20", group_name="stage1")
    assert backward == [torch.roll(torch.arange(16), r - 1)[:3].tolist() for r in (1, 2, 17)]


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
