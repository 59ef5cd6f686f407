"""FjORD: the masked forward is the narrow network, seeded per-batch widths, a batch norm per width,
budgets kept, untrained widths untouched by aggregation, self-distillation."""

import math
from dataclasses import replace

import pytest
import torch

from hfl.accounting.amounts import ClientBudget
from hfl.accounting.cost import cross_entropy_step, measure_training_cost
from hfl.backends.base import ClientEnvironment
from hfl.client import ClientModule
from hfl.errors import ConfigError
from hfl.loggers import read_metrics
from hfl.methods.base import MethodState
from hfl.methods.fjord import UNIFORM_6, FjORDOptions
from hfl.models import build_model
from hfl.server import initial_state, run_experiment, train_settings
from hfl.submodel.copies import NormCopies
from hfl.submodel.spec import extract
from hfl.types import ClientTask, RoundContext, TrainSettings
from tests.conftest import method_for, small_config

SIXTH = UNIFORM_6[0]


def fjord(model="cnn", **method):
    """The FjORD method over a width-1 global model, and that model's state with every batch-norm
    copy given its own random affine weights and running statistics (so the copy in use matters)."""
    method = method_for({"name": "fjord", **method}, model)
    gen = torch.Generator().manual_seed(0)
    state = {}
    for key, value in method.model.state_dict().items():
        if value.is_floating_point():
            value = torch.randn(value.shape, generator=gen) * 0.5
            value = value.abs() + 0.5 if key.endswith("running_var") else value
        state[key] = value
    return method, state


def client_model(method, state, p, name="preresnet20"):
    """The model a client at p_max = p trains, loaded from the global state."""
    model = method.adapt_model(build_model(name, 1, 10, width=p))
    model.load_state_dict(extract(state, method.spec_for(p)), strict=True)
    return model


@pytest.mark.parametrize("name", ["cnn", "preresnet20"])
@pytest.mark.parametrize(("p_max", "p"), [(1.0, SIXTH), (1.0, 0.5), (UNIFORM_6[4], UNIFORM_6[1])])
def test_masked_forward_is_the_narrow_network(name, p_max, p):
    method, state = fjord(name)
    wide = client_model(method, state, p_max, name)
    narrow = client_model(method, state, p, name)
    x = torch.randn(6, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    for train in (False, True):  # running statistics, then batch statistics
        wide.train(train), narrow.train(train)
        with torch.no_grad(), method.at_width(wide, p):
            masked = wide(x)
        torch.testing.assert_close(masked, narrow(x).detach(), rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # the context restored the full width and its batch norms
        torch.testing.assert_close(wide.eval()(x), client_model(method, state, p_max, name).eval()(x))


TRANSFORMER_INPUTS = {
    "gpt": lambda gen: torch.randint(0, 81, (3, 10), generator=gen),
    "vit": lambda gen: torch.randn(3, 3, 32, 32, generator=gen),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMER_INPUTS))
@pytest.mark.parametrize(("p_max", "p"), [(1.0, SIXTH), (1.0, 0.5), (UNIFORM_6[4], UNIFORM_6[1])])
def test_masked_forward_is_the_narrow_transformer(name, p_max, p):
    """Inside a transformer's blocks channels run last, a LayerNorm's statistics span every channel,
    and a ViT's position embedding has no batch dimension: the masked forward must give the narrow
    model's outputs all the same."""
    in_channels, classes = (1, 81) if name == "gpt" else (3, 10)
    method = method_for({"name": "fjord"}, name, in_channels=in_channels, num_classes=classes, input_size=32)
    gen = torch.Generator().manual_seed(0)
    state = {k: torch.randn(v.shape, generator=gen) for k, v in method.model.state_dict().items()}

    def transformer(width):
        model = method.adapt_model(build_model(name, in_channels, classes, width=width)).eval()
        model.load_state_dict(extract(state, method.spec_for(width)), strict=True)
        return model

    wide, narrow = transformer(p_max), transformer(p)
    x = TRANSFORMER_INPUTS[name](gen)
    with torch.no_grad(), method.at_width(wide, p):
        masked = wide(x)
    torch.testing.assert_close(masked, narrow(x).detach(), rtol=1e-4, atol=1e-4)


def test_each_width_uses_its_own_batch_norm():
    method, state = fjord("preresnet20")
    narrow = client_model(method, state, 0.5).eval()
    norms = [m for m in narrow.modules() if isinstance(m, NormCopies)]
    assert norms and all(n.names() == ["w0", "w1", "w2"] and n.active == "w2" for n in norms)
    x = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        own = narrow(x)
        for n in norms:  # the narrow model's own width, but the batch norms of width 1/6
            n.active = "w0"
        assert not torch.allclose(own, narrow(x))


def test_masked_forward_saves_what_the_accountant_counts():
    method, _ = fjord("preresnet20")
    model = method.adapt_model(build_model("preresnet20", 1, 10, width=0.5))
    plain = measure_training_cost(model, (1, 8, 8), 10, 16)

    def narrow_step(m, x, y):
        with method.at_width(m, SIXTH):
            return cross_entropy_step(m, x, y)

    assert measure_training_cost(model, (1, 8, 8), 10, 16, step=narrow_step).activation_bytes == plain.activation_bytes


def cost(method, p, batch):
    """What training with p_max = p costs at `batch`."""
    ctx = RoundContext(1, 0, 0, batch, TrainSettings(0.05, 0.9, 0.0, 1, batch))
    return method.training_cost(ClientTask(ctx, method.spec_for(p), FjORDOptions(p)), batch)


def context(method, p_max, seed=0, num_samples=200):
    """A client-round whose budget is exactly the training memory of p_max."""
    settings = TrainSettings(0.05, 0.9, 0.0, 1, 16)
    return RoundContext(1, 0, seed, num_samples, settings, ClientBudget("t", cost(method, p_max, 16).peak_bytes, None, None))


def test_widths_drawn_per_batch_are_allowed_and_seeded():
    config = small_config(method={"name": "fjord"})
    env = ClientEnvironment.from_config(config)
    method, start = env.method, initial_state(config, env).global_state
    drawn = []
    at_width = method.at_width
    method.at_width = lambda model, p: drawn.append(p) or at_width(model, p)

    def one_round(seed):
        drawn.clear()
        ctx = context(method, 0.5, seed, len(env.partitions[0]))
        task = method.plan(ctx, MethodState())
        assert task.options.p_max == 0.5 and task.spec.width == 0.5
        update = env.train(start, task)
        return list(drawn), update

    first, update = one_round(seed=0)
    assert len(first) == -(-len(env.partitions[0]) // 16)  # one draw per mini-batch
    assert set(first) <= set(UNIFORM_6[:3]) and len(set(first)) > 1
    again, repeat = one_round(seed=0)
    assert again == first
    assert all(torch.equal(update.state[k], repeat.state[k]) for k in update.state)
    assert one_round(seed=1)[0] != first
    many = [method.draw_width(context(method, 0.5), 0.5, step) for step in range(300)]
    assert set(many) == set(UNIFORM_6[:3])


def test_client_spec_marks_wider_batch_norms_absent():
    method, state = fjord("preresnet20")
    spec = method.spec_for(0.5)
    norms = [name for name, m in method.model.named_modules() if isinstance(m, NormCopies)]
    suffixes = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
    assert spec.absent == {f"{n}.w{i}.{s}" for n in norms for i in (3, 4, 5) for s in suffixes}
    assert method.spec_for(1.0).absent == frozenset()
    client_model(method, state, 0.5)  # loads strictly: the client holds exactly the copies 1/6..1/2


@pytest.mark.slow
def test_budgets_are_respected_and_every_width_evaluated(tmp_path):
    config = small_config(method={"name": "fjord"}, model={"name": "preresnet20"}, budgets={"scenario": "fair"},
                          fl={"rounds": 2, "clients": 8, "fraction": 1.0})
    summary = run_experiment(config, tmp_path)
    assert summary["budget_violations"] == 0 and summary["skipped_client_rounds"] == 0
    widths = {c["tier"]: c["submodel"]["width"] for r in read_metrics(tmp_path) for c in r["clients"]}
    # The smallest tier fits width 1/6 exactly; the others hold a batch norm per width besides the
    # plain model that defines their budget, so each fits one ladder width less (see the module doc).
    assert widths["w1_6"] == SIXTH and widths["w1_6"] <= widths["w1_3"] < widths["w1_2"] < widths["w1"] < 1.0
    # Every trained width is scored; the widest (5/6 here) is the global model, not the untrained full width.
    assert set(summary["submodel_accuracy"]) == {"x0.167", "x0.333", "x0.5", "x0.667", "x0.833"}
    assert summary["final_accuracy"] == summary["submodel_accuracy"]["x0.833"]


def test_static_bn_fits_the_fair_tiers_exactly():
    config = small_config(method={"name": "fjord"}, model={"name": "preresnet20", "norm": "static_bn"},
                          budgets={"scenario": "fair"}, fl={"clients": 8})
    from hfl.accounting.budgets import assign_budgets

    env = ClientEnvironment.from_config(config)
    _, budgets = assign_budgets(config, env.accountant, [len(p) for p in env.partitions])
    tier_width = {"w1_6": SIXTH, "w1_3": UNIFORM_6[1], "w1_2": 0.5, "w1": 1.0}
    for c, budget in enumerate(budgets):
        ctx = RoundContext(1, c, 0, len(env.partitions[c]), train_settings(config.fl, 1), budget)
        assert env.method.plan(ctx, MethodState()).options.p_max == tier_width[budget.tier]
    assert not any(isinstance(m, NormCopies) for m in env.method.model.modules())


def test_widths_no_client_trained_stay_unchanged_after_aggregation():
    config = small_config(method={"name": "fjord"}, model={"name": "preresnet20"}, fl={"local_epochs": 2})
    env = ClientEnvironment.from_config(config)
    method, start = env.method, initial_state(config, env).global_state
    update = env.train(start, method.plan(context(method, 0.5, num_samples=len(env.partitions[0])), MethodState()))
    new, _ = method.aggregate(start, [update], MethodState())
    wider = method.spec_for(0.5).absent
    assert wider and all(torch.equal(new[k], start[k]) for k in wider)
    trained = [k for k in start if k.endswith(("w0.running_mean", "w2.weight"))]
    assert any(not torch.equal(new[k], start[k]) for k in trained)
    conv = "body.0.conv1.weight"  # 16 -> 16 channels at width 1, 8 -> 8 held at width 1/2
    assert torch.equal(new[conv][8:], start[conv][8:]) and torch.equal(new[conv][:, 8:], start[conv][:, 8:])
    assert not torch.equal(new[conv][:8, :8], start[conv][:8, :8])


def test_self_distillation_loss_is_finite_and_trains_both_widths():
    method, state = fjord("preresnet20", self_distillation=True, kd_alpha=0.5, kd_temperature=2.0)
    model = client_model(method, state, 0.5).train()
    ctx = context(method, 0.5)
    client = ClientModule(model, method, ClientTask(ctx, method.spec_for(0.5), FjORDOptions(0.5)))
    client.steps = next(s for s in range(100) if method.draw_width(ctx, 0.5, s) < 0.5)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    terms = method.objective(client, x, y)
    assert all(torch.isfinite(t) for t in terms.values()) and terms["kd"] > 0
    terms["loss"].backward()
    norm = next(m for m in model.modules() if isinstance(m, NormCopies))
    p = method.draw_width(ctx, 0.5, client.steps)
    assert norm.w2.weight.grad is not None and getattr(norm, f"w{UNIFORM_6.index(p)}").weight.grad is not None


def test_self_distillation_run_fits_teacher_and_student_in_the_budget(tmp_path):
    config = small_config(method={"name": "fjord", "self_distillation": True},
                          budgets={"scenario": "fair"}, fl={"rounds": 1, "clients": 4, "fraction": 1.0})
    env = ClientEnvironment.from_config(config)
    single = env.accountant.plain_cost(0.5, 32).peak_bytes
    # Both graphs are alive at the backward pass: nearly twice the activations of one forward.
    assert single < cost(env.method, 0.5, 32).peak_bytes < single + env.accountant.plain_cost(0.5, 32).activation_bytes * 1.01
    assert cost(env.method, SIXTH, 32).peak_bytes == env.accountant.plain_cost(SIXTH, 32).peak_bytes  # no narrower student
    summary = run_experiment(config, tmp_path)
    assert summary["client_rounds"] + summary["skipped_client_rounds"] == 4
    # The distillation term changes what the clients train (without budgets, so both runs train the same widths).
    free = replace(config, budgets=replace(config.budgets, scenario="none"))
    distilled = run_experiment(free, tmp_path / "distilled")
    plain = run_experiment(replace(free, method=replace(config.method, self_distillation=False)), tmp_path / "plain")
    assert distilled["final_loss"] != plain["final_loss"]
    assert summary["budget_violations"] == 0
    clients = [c for r in read_metrics(tmp_path) for c in r["clients"]]
    assert all(math.isfinite(c["train_loss"]) for c in clients)
    # What each client-round reports (and budgets are checked against) is the two-graph step's memory.
    for c in clients:
        assert c["estimated_peak_bytes"] == cost(env.method, c["submodel"]["width"], min(32, c["num_samples"])).peak_bytes


def test_the_ladder_must_hold_the_global_width():
    with pytest.raises(ConfigError, match="widths"):
        small_config(method={"name": "fjord", "widths": [0.25, 0.5]})
