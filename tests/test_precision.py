"""Mixed precision (`fl.precision`): what the accountant measures under it, the sub-model a budget
buys with it, and the fast driver's gradient scaler (the drivers' equality: tests/test_server.py)."""

import pytest
import torch
from torch import nn

from hfl.backends.base import ClientEnvironment
from hfl.client import Precision
from hfl.errors import ConfigError
from hfl.optim import ClientOptimizer
from hfl.server import train_settings
from hfl.types import RoundContext, TrainSettings
from tests.conftest import small_config


def heterofl_environment(precision: str, memory: str = "") -> ClientEnvironment:
    budgets = {"scenario": "tiers", "memory": [memory]} if memory else {"scenario": "none"}
    return ClientEnvironment.from_config(small_config(
        data={"name": "synthetic", "partition": "iid"}, model={"name": "preresnet20"}, method={"name": "heterofl"},
        budgets=budgets, fl={"clients": 4, "batch_size": 32, "momentum": 0.9, "precision": precision}))


def test_bf16_saves_activations_in_half_the_bytes_and_keeps_float32_weights():
    fp32, bf16 = (heterofl_environment(p).accountant.plain_cost(1.0, 32) for p in ("32-true", "bf16-mixed"))
    assert (bf16.param_bytes, bf16.grad_bytes, bf16.optimizer_bytes) == (fp32.param_bytes, fp32.grad_bytes, fp32.optimizer_bytes)
    # Batch norm keeps a float32 statistic copy per channel, and the first convolution saves its
    # float32 input besides its bfloat16 cast: a little over half.
    assert 0.5 <= bf16.activation_bytes / fp32.activation_bytes <= 0.6
    assert bf16.peak_bytes < 0.75 * fp32.peak_bytes


@pytest.mark.slow  # an end-to-end run of 3-5 s: CI runs it, the fast lane does not
def test_a_budget_between_the_two_peaks_gives_the_whole_model_only_in_bf16():
    peaks = {p: heterofl_environment(p).accountant.plain_cost(1.0, 32).peak_bytes for p in ("32-true", "bf16-mixed")}
    between = f"{(peaks['32-true'] + peaks['bf16-mixed']) // 2}"
    levels = {}
    for precision in peaks:
        env = heterofl_environment(precision, between)
        config = env.config
        ctx = RoundContext(1, 0, config.seed, len(env.partitions[0]), train_settings(config.fl, 1), env.budgets[0])
        levels[precision] = env.method.plan(ctx, {}).level
    assert levels == {"bf16-mixed": "x1", "32-true": "x0.5"}


def test_float16_on_the_cpu_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="fl.precision.*16-mixed.*CUDA"):
        ClientEnvironment.from_config(small_config(fl={"precision": "16-mixed"}))
    with pytest.raises(ConfigError, match="precision"):
        small_config(fl={"precision": "bf16"})


def scaled_step(precision: Precision, model: nn.Module, x: torch.Tensor, scale_loss: float = 1.0) -> None:
    optimizer = ClientOptimizer(model.parameters(), "sgd", lr=0.1)
    with precision.autocast():
        loss = nn.functional.cross_entropy(model(x), torch.arange(len(x)) % 2) * scale_loss
    precision.backward(loss)
    precision.step(optimizer, TrainSettings(0.1, 0.0, 0.0, 1, len(x)))


def test_the_gradient_scaler_unscales_before_the_step_and_skips_overflowing_steps():
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    plain, scaled = nn.Linear(4, 2), nn.Linear(4, 2)
    scaled.load_state_dict(plain.state_dict())
    scaled_step(Precision("32-true", torch.device("cpu")), plain, x)
    scaler = Precision("16-mixed", torch.device("cpu"))
    scaled_step(scaler, scaled, x)
    # float16's forward against float32's: the update agrees to float16's rounding, unscaled.
    for a, b in zip(plain.parameters(), scaled.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-3)
    before = [p.detach().clone() for p in scaled.parameters()]
    scaled_step(scaler, scaled, x, scale_loss=float("inf"))  # gradients overflow: no step, a smaller scale
    assert all(torch.equal(a, b) for a, b in zip(before, scaled.parameters(), strict=True))
    assert scaler.scaler.get_scale() < 2.0**16
