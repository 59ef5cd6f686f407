"""FedMef: budget-aware extrusion's surrogate term and learning rate by hand, and scaled activation
pruning's lower peak memory (a budget FedTiny breaks, FedMef keeps) on CIFAR-shaped inputs."""

import math

import pytest
import torch
import torch.nn.functional as F

from hfl.backends.base import ClientEnvironment
from hfl.client import ClientBatches, train_client
from hfl.errors import ConfigError
from hfl.evaluation import Evaluator
from hfl.methods.fedtiny import Adjustment
from hfl.optim import ClientOptimizer
from hfl.pruning.nsconv import NSConv2d
from hfl.registry import METHODS
from hfl.server import initial_state, train_settings
from hfl.submodel.spec import full_spec
from hfl.types import RoundContext, TrainSettings
from tests.conftest import method_for, small_config


def adjustment_task(method, num_samples, settings, round_=1):
    state = method.init_state()
    ctx = RoundContext(round_, 0, 0, num_samples, settings)
    task = method.plan(ctx, state)
    assert isinstance(task.options, Adjustment)
    return task


def smallest_kept_squares(weights, masks, counts):
    """Σ over layers of the ξ smallest squared kept weights, by sorting; ξ at most the layer's pruned
    entries (none in a dense layer), as the server drops them."""
    total = 0.0
    for key, mask in masks.items():
        kept = weights[key].detach().flatten()[mask.flatten()].abs().sort().values
        total += float((kept[: min(counts[key], int((~mask).sum()))] ** 2).sum())
    return total


def test_surrogate_term_is_lambda_times_the_smallest_kept_weights_squared():
    method = method_for({"name": "fedmef", "bae_lambda": 0.5, "adjust_every": 1}, "cnn", norm="none", input_size=8)
    task = adjustment_task(method, 4, TrainSettings(0.1, 0.0, 0.0, 1, 4))
    model = method.client_model(task.spec)
    model.load_state_dict(method.initial_global_state())
    optimizer = ClientOptimizer(model.parameters(), "sgd", lr=0.1)
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])
    client = type("Client", (), {"model": model, "task": task, "steps": 0, "optimizer": optimizer})()
    terms = method.objective(client, x, y)
    by_hand = smallest_kept_squares(dict(model.named_parameters()), task.spec.masks, task.options.counts)
    assert by_hand > 0
    assert math.isclose(float(terms["extrusion"]), by_hand, rel_tol=1e-5)
    assert math.isclose(float(terms["loss"].detach() - F.cross_entropy(model(x), y).detach()), 0.5 * by_hand, rel_tol=1e-4)


@pytest.mark.parametrize("bae", [True, False])
def test_each_step_of_an_adjustment_round_uses_the_budgeted_rate(monkeypatch, bae):
    """μ_t = max(η, p(t)(2σ(‖θ_low‖) − 1)η₀) with p(t) = (2T − 2t)/(2T − t), at every step t of a client
    trained by the real client loop (T = 3 batches); outside adjustment rounds the rate is η. With
    `bae=false` (the paper's "without BaE") an adjustment round has neither the term nor μ_t."""
    method = method_for({"name": "fedmef", "adjust_every": 2, "bae": bae}, "cnn", norm="none", input_size=8)
    lr, initial_lr = 0.001, 0.5
    settings = TrainSettings(lr, 0.0, 0.0, 1, 4, "sgd", initial_lr)
    used, norms = [], []
    step = ClientOptimizer.step

    def recording_step(self, *args, **kwargs):
        used.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    objective = type(method).objective

    def recording_objective(self, client, x, y):
        terms = objective(self, client, x, y)
        norms.append(math.sqrt(float(terms["extrusion"])) if "extrusion" in terms else None)
        return terms

    assert method.relu_masks is False  # measured now: the accountant's own optimiser steps are not the client's
    monkeypatch.setattr(ClientOptimizer, "step", recording_step)
    monkeypatch.setattr(type(method), "objective", recording_objective)
    x, y = torch.randn(12, 1, 8, 8), torch.arange(12) % 10
    for round_ in (2, 1):
        ctx = RoundContext(round_, 0, 0, 12, settings)
        task = method.plan(ctx, method.init_state())
        assert isinstance(task.options, Adjustment) == (round_ == 2)  # the masks are adjusted either way
        batches = ClientBatches(x, y, torch.arange(12), 4, None, torch.Generator().manual_seed(0))
        train_client(method.client_model(task.spec), method, task, method.initial_global_state(), batches)
    T = 3
    if not bae:
        assert used == [lr] * 2 * T and norms == [None] * 2 * T
        return
    for t in range(T):
        p = (2 * T - 2 * t) / (2 * T - t)
        beta = p * (2 / (1 + math.exp(-norms[t])) - 1) * initial_lr
        assert math.isclose(used[t], max(lr, beta), rel_tol=1e-9), t
    assert used[0] > lr  # the budgeted rate took over
    assert used[T:] == [lr] * T and norms[T:] == [None] * T  # round 1 adjusts nothing


def cifar_config(method, memory=None):
    budgets = {"scenario": "tiers", "memory": [str(memory)]} if memory else {}
    return small_config(method={"name": method}, model={"name": "cnn"}, data={"name": "synthetic", "partition": "iid"},
                        budgets=budgets, fl={"rounds": 1, "clients": 20, "fraction": 0.1})


def estimated_peak(method):
    config = cifar_config(method)
    env = ClientEnvironment.from_config(config)
    assert env.data.train_x.shape[1:] == (3, 32, 32)
    ctx = RoundContext(1, 0, config.seed, len(env.partitions[0]), train_settings(config.fl, 1))
    task = env.method.plan(ctx, env.method.init_state())
    return env.method.training_cost(task, min(config.fl.batch_size, ctx.num_samples)).peak_bytes


@pytest.mark.slow
def test_activation_pruning_keeps_a_budget_that_fedtiny_breaks(tmp_path):
    from hfl.server import run_experiment

    fedtiny, fedmef = estimated_peak("fedtiny"), estimated_peak("fedmef")
    assert fedmef < fedtiny
    budget = (fedmef + fedtiny) // 2
    tiny = run_experiment(cifar_config("fedtiny", budget), tmp_path / "fedtiny")
    mef = run_experiment(cifar_config("fedmef", budget), tmp_path / "fedmef")
    assert tiny["client_rounds"] == mef["client_rounds"] == 2
    assert tiny["budget_violations"] == 2 and mef["budget_violations"] == 0
    assert mef["max_estimated_peak_bytes"] == fedmef


def test_first_round_state_is_the_masked_initial_model():
    config = cifar_config("fedmef")
    env = ClientEnvironment.from_config(config)
    weights, state = initial_state(config, env).global_state, env.method.init_state()
    for key, mask in state.masks.items():
        assert not weights[key][~mask].any() and weights[key][mask].all(), key


def test_nsconv_needs_a_model_without_norms():
    with pytest.raises(ConfigError, match="model.norm='bn'.*method.nsconv"):
        method_for({"name": "fedmef"}, "cnn", norm="bn")
    assert method_for({"name": "fedmef", "nsconv": False}, "cnn", norm="bn").model.norm == "bn"
    assert small_config(method={"name": "fedmef"}, model={"name": "cnn"}).model.norm == "auto"  # auto builds none for FedMef
    assert METHODS.get("fedmef").preferred_norm == "none"


def nsconv_layers(model):
    return {name: m for name, m in model.named_modules() if isinstance(m, NSConv2d)}


def test_clients_and_evaluation_standardise_over_the_global_masks():
    """The client model is reused across clients and rounds: train_client and the evaluator load the
    task's masks into its NSConvs with the weights (with all entries kept the forward would differ)."""
    config = cifar_config("fedmef")
    env = ClientEnvironment.from_config(config)
    method, state = env.method, env.method.init_state()
    weights = initial_state(config, env).global_state
    ctx = RoundContext(1, 0, config.seed, len(env.partitions[0]), train_settings(config.fl, 1))
    task = method.plan(ctx, state)
    model = env.model(task.spec)
    assert nsconv_layers(model)
    env.train(weights, task)
    for name, layer in nsconv_layers(model).items():
        assert torch.equal(layer.mask.cpu(), state.masks[f"{name}.weight"]), name
    evaluator = Evaluator(env)
    masked = evaluator(weights, method.global_model_spec(state))
    all_kept = evaluator(weights, full_spec())
    assert masked["loss"] != all_kept["loss"]
    evaluator(weights, method.global_model_spec(state))
    for name, layer in nsconv_layers(evaluator._model(full_spec())).items():
        assert torch.equal(layer.mask.cpu(), state.masks[f"{name}.weight"]), name


def test_each_filters_gain_and_bias_start_neutral_and_train():
    config = cifar_config("fedmef")
    env = ClientEnvironment.from_config(config)
    method, state = env.method, env.method.init_state()
    weights = initial_state(config, env).global_state
    layers = nsconv_layers(method.model)
    assert layers and all(f"{name}.gain" in weights and f"{name}.bias" in weights for name in layers)
    for name in layers:
        assert torch.equal(weights[f"{name}.gain"], torch.ones_like(weights[f"{name}.gain"])), name
    ctx = RoundContext(1, 0, config.seed, len(env.partitions[0]), train_settings(config.fl, 1))
    update = env.train(weights, method.plan(ctx, state))
    for name in layers:
        assert not torch.equal(update.state[f"{name}.gain"], weights[f"{name}.gain"]), name
        assert not torch.equal(update.state[f"{name}.bias"], weights[f"{name}.bias"]), name
    plain = method_for({"name": "fedmef", "ns_affine": False}, "cnn", norm="none").model
    assert nsconv_layers(plain) and not any(k.endswith(".gain") for k in plain.state_dict())


def branch_to_stream_variance(method, x):
    """Per residual block of the method's client model (its masks loaded), Var(s·F(Y)) / Var(Y) at
    initialisation: how much of the block's output its residual branch carries."""
    from hfl.models.base import ResidualBlock

    from hfl.pruning.nsconv import load_masks
    from hfl.submodel.spec import extract

    spec = method.plan(RoundContext(1, 0, 0, 64, train_settings(small_config().fl, 1)), method.init_state()).spec
    model = method.client_model(spec)
    model.load_state_dict(extract(method.initial_global_state(), spec))
    load_masks(model, spec.masks)  # as a client does: NSConv standardises over the kept entries
    ratios, inputs = [], {}
    blocks = [b for b in model.body if isinstance(b, ResidualBlock)]
    for block in blocks:
        block.register_forward_pre_hook(lambda b, args: inputs.__setitem__(b, args[0]))
        block.conv2.register_forward_hook(
            lambda conv, args, out, block=block: ratios.append(float((block.scaled(out, block.step)).var() / inputs[block].var())))
    with torch.no_grad():
        model(x)
    return ratios


@pytest.mark.parametrize(("residual_scale", "low", "high"), [(0.2, 0.03, 0.3), (0.0, 0.5, 5.0)])
@pytest.mark.slow
def test_every_residual_branch_of_the_sparse_norm_free_model_carries_signal(residual_scale, low, high):
    """At s = 0.9 on a ResNet-18 without norms, each branch's variance over its block input's: with
    NSConv scaled by each filter's kept entries, 1.6-2.8 (0.06-0.11 with NF-ResNets' α = 0.2); scaled
    by the whole filter, 0.005 in the last block (0.0002 with α)."""
    method = method_for({"name": "fedmef", "residual_scale": residual_scale}, "resnet18", in_channels=3, norm="none", input_size=32)
    assert all((b.step is not None) == (residual_scale > 0) for b in method.model.body)
    assert not any(k.endswith("step") for k in method.initial_global_state())  # a constant: nothing to send or average
    ratios = branch_to_stream_variance(method, torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(0)))
    assert len(ratios) == 8 and all(low < r < high for r in ratios), [round(r, 4) for r in ratios]


def test_extrusion_alone_shrinks_the_marked_weights_tenfold_within_the_round(monkeypatch):
    """Section 3.3's point: the weights the server will drop approach zero before it drops them. The
    real client loop, an adjustment round of T = 6 steps at the calibrated λ, the data's loss zeroed
    so that the term acts alone: ‖θ_low‖ falls tenfold (λ = 0.01 moved it by about 1 %). With the
    data's gradient too, weights at 10x the initial scale fell 67 % (2.69 to 0.89): the term pulls in
    proportion to the weights, so they settle where it balances one step's gradient. Plain SGD: with
    momentum 0.9 they fell 38 % in the same 6 steps (heavy ball contracts by at most √0.9 a step)."""
    from hfl.methods.fedtiny import FedTiny

    monkeypatch.setattr(FedTiny, "objective", lambda self, client, x, y: {"loss": 0 * client.model(x).sum()})
    method = method_for({"name": "fedmef", "adjust_every": 1}, "cnn", norm="none", input_size=8)
    settings = TrainSettings(0.1, 0.0, 0.0, 1, 4)
    x, y = torch.randn(24, 1, 8, 8, generator=torch.Generator().manual_seed(1)), torch.arange(24) % 10
    task = adjustment_task(method, 24, settings, round_=1)
    start = method.initial_global_state()
    update = train_client(method.client_model(task.spec), method, task, start,
                          ClientBatches(x, y, torch.arange(24), 4, None, torch.Generator().manual_seed(0)))
    masks = task.spec.masks
    from hfl.pruning.selection import lowest_magnitude

    low = lowest_magnitude({k: start[k] for k in masks}, masks, task.options.counts)
    assert sum(int(m.sum()) for m in low.values()) > 0
    before = math.sqrt(sum(float(start[k][low[k]].square().sum()) for k in masks))
    after = math.sqrt(sum(float(update.state[k][low[k]].square().sum()) for k in masks))
    assert after == pytest.approx(0.1 * before, rel=1e-4), (before, after)


def test_a_grown_entry_starts_at_zero_in_the_weight_each_nsconv_applies(tmp_path, monkeypatch):
    """FedTiny grows entries at 0. Under NSConv a stored 0 would apply −μ/σ of its filter, so FedMef
    stores a grown entry at its filter's mean over the entries kept through the adjustment: after a
    real adjustment round every grown entry's standardised weight is 0, and the survivors keep theirs."""
    from tests.conftest import run_with_env

    config = small_config(method={"name": "fedmef", "sparsity": 0.8, "adjust_every": 1, "stop_round": 10}, model={"name": "cnn"},
                          fl={"rounds": 1, "clients": 3, "fraction": 1.0})
    _, env, final = run_with_env(config, tmp_path, monkeypatch)
    before, after, weights = env.method.init_state().masks, final["method_state"].masks, final["global_state"]
    grown_somewhere = False
    for key, new in after.items():
        if weights[key].dim() != 4:
            continue
        flat, kept = weights[key].flatten(1), new.flatten(1)
        mean = (flat * kept).sum(1, keepdim=True) / kept.sum(1, keepdim=True)
        sigma = ((flat - mean) * kept).square().sum(1, keepdim=True).div(kept.sum(1, keepdim=True)).sqrt()
        standardised = (flat - mean) / sigma
        grown = (new & ~before[key]).flatten(1)
        grown_somewhere |= bool(grown.any())
        assert not grown.any() or standardised[grown].abs().max() < 1e-5, key
        assert standardised[kept & ~grown].abs().max() > 0.1, key
    assert grown_somewhere
