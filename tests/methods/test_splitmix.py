"""SplitMix: n independent bases of width r, as many per client as its budget fits, updates that
touch only the client's bases, the mix as the mean of logits, and one full-width base as FedAvg."""

import pytest
import torch
import torch.nn.functional as F

from hfl.accounting.amounts import ClientBudget
from hfl.accounting.cost import measure_training_cost
from hfl.backends.base import ClientEnvironment
from hfl.errors import ConfigError
from hfl.methods.splitmix import ensemble_loss
from hfl.models import build_model
from hfl.models.ensemble import BaseEnsemble
from hfl.server import initial_state, run_experiment, train_settings
from hfl.types import ClientTask, RoundContext
from tests.conftest import small_config


@pytest.fixture(scope="module")
def fair():
    """A digits + CNN environment with the `fair` budgets (auto base width: 1/6), and its start state."""
    config = small_config(method={"name": "splitmix"}, budgets={"scenario": "fair"})
    env = ClientEnvironment.from_config(config)
    return config, env, initial_state(config, env).global_state


def context(config, env, client, budget=None, round_=1):
    budget = env.budgets[client] if budget is None else budget
    return RoundContext(round_, client, config.seed, len(env.partitions[client]), train_settings(config.fl, round_), budget)


def test_the_global_state_holds_n_independent_bases_and_a_client_touches_only_its_own(fair):
    config, env, start = fair
    method = env.method
    assert method.base_ratio == pytest.approx(1 / 6) and method.num_bases == 6
    base = build_model("cnn", 1, 10, 1 / 6).state_dict()
    assert {k.split(".")[1] for k in start} == {str(i) for i in range(6)}
    for i in range(6):
        assert {k[len(f"bases.{i}.") :]: v.shape for k, v in start.items() if k.startswith(f"bases.{i}.")} == {
            k: v.shape for k, v in base.items()}
    assert not torch.equal(start["bases.0.head.fc.weight"], start["bases.1.head.fc.weight"])  # initialised apart

    client = next(c for c, b in enumerate(env.budgets) if b.tier == "w1_3")
    task = method.plan(context(config, env, client), method.init_state())
    trained = list(task.options.bases)
    assert 1 <= len(trained) < 6 and [g for _, g in task.spec.places] == [f"bases.{b}." for b in trained]
    update = env.train(start, task)
    assert set(update.state) == {f"bases.{i}.{k}" for i in range(len(trained)) for k in base}
    new, _ = method.aggregate(start, [update], method.init_state())
    for key in start:
        if int(key.split(".")[1]) not in trained:
            assert torch.equal(new[key], start[key]), key  # another base: untouched
    for i, b in enumerate(trained):  # the client's i-th base went back to global base b
        assert torch.allclose(new[f"bases.{b}.head.fc.weight"], update.state[f"bases.{i}.head.fc.weight"])
        assert not torch.equal(new[f"bases.{b}.head.fc.weight"], start[f"bases.{b}.head.fc.weight"])


def test_the_number_of_bases_grows_with_the_budget_and_fits_it(fair):
    config, env, _ = fair
    method = env.method
    planned = []
    for client, budget in enumerate(env.budgets):
        task = method.plan(context(config, env, client), method.init_state())
        batch = min(config.fl.batch_size, len(env.partitions[client]))
        assert method.training_cost(task, batch).peak_bytes <= budget.memory_bytes
        planned.append((budget.memory_bytes, len(task.spec.places)))
    counts = [k for _, k in sorted(planned)]
    assert counts == sorted(counts) and counts[0] == 1 and counts[-1] == 6
    assert method.plan(context(config, env, 0, ClientBudget("tiny", 1000, None, None)), method.init_state()) is None


def test_the_cost_of_k_bases_is_what_training_them_together_measures(fair):
    config, env, _ = fair
    method, acc = env.method, env.accountant
    three = BaseEnsemble([acc.build(method.base_width) for _ in range(3)])
    measured = measure_training_cost(three, acc.input_shape, acc.num_classes, 32, acc.optimizer, step=ensemble_loss)
    assert method.training_cost(ClientTask(context(config, env, 0), method.spec_for([0, 2, 5])), 32) == measured


def test_base_choice_is_seeded_and_spreads_the_first_bases_over_a_round(fair):
    config, env, _ = fair
    method = env.method
    def choose(ctx, k):
        return method.choose_bases(method.ladder.levels[k - 1], ctx)[1].bases

    firsts = [choose(context(config, env, c), 1)[0] for c in range(6)]
    assert sorted(firsts) == list(range(6))  # one client per base among clients 0..n-1
    assert [choose(context(config, env, c), 1)[0] for c in range(6)] == firsts
    assert [choose(context(config, env, c, round_=2), 1)[0] for c in range(6)] != firsts
    bases = choose(context(config, env, 3), 4)
    assert len(set(bases)) == 4 and firsts[3] in bases


def test_the_mix_is_the_mean_of_the_bases_logits():
    torch.manual_seed(0)
    bases = [build_model("cnn", 1, 10, 0.25) for _ in range(3)]
    mix = BaseEnsemble(bases).eval()
    x = torch.randn(5, 1, 8, 8)
    by_hand = (bases[0](x) + bases[1](x) + bases[2](x)) / 3
    assert torch.allclose(mix(x), by_hand, atol=1e-6)
    assert torch.equal(mix.forward_exits(x)[0], mix(x)) and mix.exit_blocks == () and mix.head is not None
    assert {k.split(".")[1] for k in mix.state_dict()} == {"0", "1", "2"}
    y = torch.tensor([0, 1, 2, 3, 4])
    assert torch.allclose(ensemble_loss(mix, x, y), sum(F.cross_entropy(b(x), y) for b in bases))


@pytest.mark.slow  # an end-to-end run of 3-5 s: CI runs it, the fast lane does not
def test_every_width_of_the_mix_is_scored_with_static_batch_norm(tmp_path):
    config = small_config(method={"name": "splitmix", "base_width": 0.5}, model={"name": "preresnet20", "norm": "static_bn"},
                          fl={"rounds": 1, "clients": 2, "fraction": 1.0})
    summary = run_experiment(config, tmp_path)
    assert set(summary["submodel_accuracy"]) == {"x0.5", "x1"} and summary["submodel_accuracy"]["x1"] == summary["final_accuracy"]


@pytest.mark.parametrize("width", [0.0, 0.4, 1.5])
def test_a_base_width_that_is_not_one_over_n_names_the_field(width):
    with pytest.raises(ConfigError, match="base_width"):
        small_config(method={"name": "splitmix", "base_width": width})


def test_a_single_full_width_base_is_fedavg(tmp_path):
    fedavg = run_experiment(small_config(), tmp_path / "fedavg")
    splitmix = run_experiment(small_config(method={"name": "splitmix", "base_width": 1.0}), tmp_path / "splitmix")
    assert splitmix["final_accuracy"] == fedavg["final_accuracy"]
    assert splitmix["final_loss"] == fedavg["final_loss"]
