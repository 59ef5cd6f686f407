"""DepthFL: exits at stage ends, the deepest prefix that fits a budget, mutual self-distillation,
prefix-only updates, and a budgeted run that scores every exit and their ensemble."""

import math

import pytest
import torch
import torch.nn.functional as F

from hfl.accounting.amounts import ClientBudget
from hfl.backends.base import ClientEnvironment
from hfl.client import ClientModule
from hfl.errors import ConfigError
from hfl.loggers import read_metrics
from hfl.losses import mutual_distillation
from hfl.methods.base import MethodState, record_trained
from hfl.methods.depthfl import DepthOptions
from hfl.models import build_model
from hfl.server import initial_state, run_experiment, train_settings
from hfl.types import ClientTask, RoundContext
from tests.conftest import level_cost, method_for, small_config


def depthfl(model_name, **fields):
    """A DepthFL method over `model_name` for 8x8 one-channel inputs, with its accountant."""
    config = small_config(method={"name": "depthfl", **fields}, model={"name": model_name})
    return config, method_for(config.method, model_name)


def ladder_depths(method):
    return tuple(level.options.depth for level in method.ladder.levels)


@pytest.fixture(scope="module")
def preresnet20():
    """Shared across tests so that each sub-model's cost is measured once."""
    return depthfl("preresnet20")


def context(config, budget_bytes=None, num_samples=100):
    budget = None if budget_bytes is None else ClientBudget("t", budget_bytes, None, None)
    return RoundContext(1, 0, 0, num_samples, train_settings(config.fl, 1), budget)


@pytest.mark.parametrize(("model_name", "exits", "depths"), [
    ("preresnet20", (2, 5), (3, 6, 9)),
    ("resnet18", (1, 3, 5), (2, 4, 6, 8)),
])
def test_exits_follow_the_last_block_of_every_stage(model_name, exits, depths):
    _, method = depthfl(model_name)
    assert method.exit_after == exits and ladder_depths(method) == depths
    assert method.model.exit_blocks == exits
    outputs = method.model.forward_exits(torch.randn(2, 1, 8, 8))
    assert len(outputs) == len(depths) and all(o.shape == (2, 10) for o in outputs)
    # The submodels are the prefixes, the deepest being the whole model.
    assert list(method.submodels(MethodState())) == [f"depth{d}" for d in depths]
    assert method.submodels(MethodState())[f"depth{depths[-1]}"].depth is None


def test_block_placement_puts_an_exit_after_every_block_but_the_last():
    _, method = depthfl("preresnet20", exits="blocks", exit_kind="linear")
    assert method.exit_after == tuple(range(8)) and ladder_depths(method) == tuple(range(1, 10))


@pytest.mark.parametrize("field", [{"exits": "layers"}, {"exit_kind": "attention"}, {"temperature": 0.0}])
def test_bad_config_names_the_field(field):
    with pytest.raises(ConfigError, match=next(iter(field))):
        small_config(method={"name": "depthfl", **field})


def test_plan_picks_the_deepest_prefix_that_fits(preresnet20):
    config, method = preresnet20
    batch = min(config.fl.batch_size, 100)
    costs = [level_cost(method, f"depth{d}", batch) for d in ladder_depths(method)]
    assert costs == sorted(costs) and len(set(costs)) == 3
    for budget, depth in [((costs[0] + costs[1]) // 2, 3), ((costs[1] + costs[2]) // 2, 6), (costs[2], 9), (None, 9)]:
        task = method.plan(context(config, budget), MethodState())
        assert task.options.depth == depth and task.level == f"depth{depth}"
        assert task.spec.depth == (None if depth == 9 else depth)
        if depth < 9:
            assert "head.fc.weight" in task.spec.absent and f"body.{depth}.conv1.weight" in task.spec.absent
            assert f"body.{depth - 1}.conv1.weight" not in task.spec.absent
    assert method.plan(context(config, costs[0] - 1), MethodState()) is None


def test_plan_costs_the_batch_the_client_actually_runs(preresnet20):
    config, method = preresnet20
    small = level_cost(method, "depth9", 4)
    assert method.plan(context(config, small, num_samples=4), MethodState()).options.depth == 9
    assert method.plan(context(config, small, num_samples=100), MethodState()).options.depth < 9


def test_mutual_distillation_of_a_pair_and_a_triple_matches_a_hand_computation():
    a = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]])
    b = torch.tensor([[0.0, 1.0, 0.0], [1.0, -1.0, 2.0]])
    c = torch.tensor([[1.0, 1.0, 1.0], [3.0, 0.0, 0.0]])

    def kl(teacher, student, t=1.0):  # KL(p_teacher || p_student), mean over the batch
        p, q = (teacher / t).softmax(1), (student / t).softmax(1)
        return float(sum(sum(pk * math.log(pk / qk) for pk, qk in zip(pr.tolist(), qr.tolist())) for pr, qr in zip(p, q)) / 2)

    assert float(mutual_distillation([a, b])) == pytest.approx(kl(b, a) + kl(a, b), rel=1e-5)
    pairs = [(j, i) for i in range(3) for j in range(3) if i != j]
    logits = [a, b, c]
    expected = sum(kl(logits[j], logits[i]) for j, i in pairs) / 2
    assert float(mutual_distillation(logits)) == pytest.approx(expected, rel=1e-5)
    expected_t2 = 4 * sum(kl(logits[j], logits[i], 2.0) for j, i in pairs) / 2
    assert float(mutual_distillation(logits, temperature=2.0)) == pytest.approx(expected_t2, rel=1e-5)


def test_teachers_are_detached():
    student, teacher = torch.randn(4, 5, requires_grad=True), torch.randn(4, 5, requires_grad=True)
    loss = F.kl_div(F.log_softmax(student, 1), F.log_softmax(teacher, 1), reduction="batchmean", log_target=True)
    grads = torch.autograd.grad(mutual_distillation([student, teacher]), [student, teacher])
    # Each logit tensor gets only its own term's gradient as a student.
    torch.testing.assert_close(grads[0], torch.autograd.grad(loss, student)[0])


@pytest.mark.parametrize("distillation", [True, False])
def test_objective_sums_cross_entropy_over_exits_plus_distillation(distillation):
    config, method = depthfl("preresnet20", distillation=distillation)
    model = method.adapt_model(build_model("preresnet20", 1, 10))
    task = method.plan(context(config), MethodState())
    client = ClientModule(model, method, task)
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])
    terms = method.objective(client, x, y)
    outputs = model.forward_exits(x)
    ce = sum(F.cross_entropy(o, y) for o in outputs)
    expected = ce + mutual_distillation(outputs) if distillation else ce
    torch.testing.assert_close(terms["loss"], expected)
    assert ("distillation" in terms) == distillation


def test_a_client_update_holds_only_its_prefix_and_deeper_weights_keep_their_value():
    config = small_config(method={"name": "depthfl"}, model={"name": "preresnet20"}, fl={"clients": 2})
    env = ClientEnvironment.from_config(config)
    method = env.method
    global_state = initial_state(config, env).global_state
    ctx = RoundContext(1, 0, config.seed, len(env.partitions[0]), train_settings(config.fl, 1))
    update = env.train(global_state, ClientTask(ctx, method.spec_for(3), DepthOptions(3), level="depth3"))
    deeper = [k for k in update.state if k.startswith(("head.", "exits.5.")) or k.split(".")[:2] in [["body", str(i)] for i in range(3, 9)]]
    assert deeper == []
    assert any(k.startswith("exits.2.") for k in update.state) and any(k.startswith("body.2.") for k in update.state)
    new_state, state = method.aggregate(global_state, [update], MethodState())
    assert record_trained(state, [update]).trained_levels == {"depth3"}
    assert torch.equal(new_state["head.fc.weight"], global_state["head.fc.weight"])
    assert torch.equal(new_state["body.3.conv1.weight"], global_state["body.3.conv1.weight"])
    assert not torch.equal(new_state["body.0.conv1.weight"], global_state["body.0.conv1.weight"])


def test_fair_budget_run_respects_budgets_and_scores_every_exit(tmp_path):
    config = small_config(method={"name": "depthfl"}, model={"name": "preresnet20"}, budgets={"scenario": "fair"},
                          fl={"rounds": 2, "clients": 4, "fraction": 1.0})
    summary = run_experiment(config, tmp_path)
    assert summary["budget_violations"] == 0
    assert summary["client_rounds"] + summary["skipped_client_rounds"] == 8
    assert summary["client_rounds"] > 0
    records = read_metrics(tmp_path)
    last = records[-1]
    depths = {c["submodel"]["depth"] or 9 for r in records for c in r["clients"]}
    assert depths <= {3, 6, 9}
    # The global model is the deepest prefix trained so far, scored at each of its classifiers and
    # their ensemble; only trained prefixes count as sub-models.
    trained = [d for d in (3, 6, 9) if d <= max(depths)]
    exits = {3: "exit2", 6: "exit5", 9: "head"}
    assert set(last["exit_accuracy"]) == {exits[d] for d in trained}
    assert set(summary["submodel_accuracy"]) == {f"depth{d}" for d in trained}
    # A prefix is scored at its deepest classifier: the global model's exit of the same block.
    assert summary["submodel_accuracy"]["depth3"] == pytest.approx(last["exit_accuracy"]["exit2"])


def test_ensemble_accuracy_is_the_mean_of_the_exits_softmax_outputs(tmp_path):
    """The reported ensemble equals DepthFL's prediction computed here from the final weights: the
    argmax of the mean of the classifiers' softmax outputs. On this small run it differs from the
    mean of the logits and from every single exit, so a wrong ensemble would show."""
    config = small_config(method={"name": "depthfl"}, fl={"rounds": 2})
    run_experiment(config, tmp_path)
    last = read_metrics(tmp_path)[-1]
    env = ClientEnvironment.from_config(config)
    model = env.method.adapt_model(build_model("cnn", 1, 10))
    model.load_state_dict(torch.load(tmp_path / "checkpoint.pt", weights_only=False)["global_state"])
    with torch.no_grad():
        outputs = model.eval().forward_exits(env.test_x)
    y = env.test_y

    def accuracy(scores):
        return int((scores.argmax(1) == y).sum()) / len(y)

    ensemble = accuracy(torch.stack([o.softmax(1) for o in outputs]).mean(0))
    assert len(outputs) == 2 and last["ensemble_accuracy"] == pytest.approx(ensemble, abs=1e-12)
    assert last["exit_accuracy"] == pytest.approx({"exit0": accuracy(outputs[0]), "head": accuracy(outputs[1])}, abs=1e-12)
    assert ensemble != accuracy(torch.stack(outputs).mean(0)) and ensemble not in last["exit_accuracy"].values()


def test_distillation_weight_follows_the_authors_ramp_only_when_asked():
    _, plain = depthfl("cnn")
    _, ramped = depthfl("cnn", distill_rampup_rounds=300)
    assert plain.distill_weight(1) == 1.0
    assert ramped.distill_weight(1) == pytest.approx(math.exp(-5.0))
    assert ramped.distill_weight(151) == pytest.approx(math.exp(-1.25))
    assert ramped.distill_weight(301) == ramped.distill_weight(1000) == 1.0
