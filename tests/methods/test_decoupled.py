"""Decoupled: one model per level, trained only by that level's clients."""

import torch

from hfl.accounting.budgets import assign_budgets
from hfl.backends.base import ClientEnvironment
from hfl.methods.base import record_trained
from hfl.server import initial_state, run_experiment, train_settings
from hfl.types import RoundContext
from tests.conftest import small_config


def test_each_level_is_a_separate_model_trained_only_by_its_clients():
    config = small_config(method={"name": "decoupled", "widths": [1.0, 0.5]}, budgets={"scenario": "fair"})
    env = ClientEnvironment.from_config(config)
    start = initial_state(config, env).global_state
    assert {k.split(".")[0] for k in start} == {"x1", "x0"} and start["x0.5.head.fc.weight"].shape[1] == 32
    settings = train_settings(config.fl, 1)
    _, budgets = assign_budgets(config, env.accountant, [len(p) for p in env.partitions])
    narrow = next(c for c, b in enumerate(budgets) if b.tier == "w1_2")
    task = env.method.plan(RoundContext(1, narrow, config.seed, len(env.partitions[narrow]), settings, budgets[narrow]), env.method.init_state())
    assert task.spec.prefix == "x0.5." and task.level == "x0.5"
    update = env.train(start, task)
    new, state = env.method.aggregate(start, [update], env.method.init_state())
    state = record_trained(state, [update])
    for key in start:
        changed = not torch.equal(new[key], start[key])
        if key.startswith("x1."):
            assert not changed, key  # the other level's model is untouched
    assert any(not torch.equal(new[k], start[k]) for k in start if k.startswith("x0.5."))
    assert state.trained_levels == {"x0.5"}
    assert list(env.method.submodels(state)) == ["x0.5"]
    assert env.method.global_model_spec(state).prefix == "x1."  # the widest level's model, trained or not


def test_a_single_full_width_level_is_fedavg(tmp_path):
    fedavg = run_experiment(small_config(), tmp_path / "fedavg")
    decoupled = run_experiment(small_config(method={"name": "decoupled", "widths": [1.0]}), tmp_path / "decoupled")
    assert decoupled["final_accuracy"] == fedavg["final_accuracy"]
    assert decoupled["final_loss"] == fedavg["final_loss"]
