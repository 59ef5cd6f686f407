"""ScaleFL: Algorithm 3 on a hand-made example, the grid search, the self-distillation loss, exits at
the level cuts, budgets, and the level table of `hfl budget`."""

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hfl.accounting.analytic import AnalyticCosts
from hfl.accounting.budgets import assign_budgets
from hfl.backends.base import ClientEnvironment
from hfl.cli import main
from hfl.errors import ConfigError
from hfl.loggers import read_metrics
from hfl.methods.base import MethodState
from hfl.methods.scalefl import held_exits, self_distillation_loss
from hfl.models import build_model
from hfl.server import run_experiment, train_settings
from hfl.submodel.ladder import kmeans_1d
from hfl.submodel.scaling import most_uniform_split
from hfl.submodel.spec import SubmodelSpec, extract
from hfl.types import ClientUpdate, RoundContext
from tests.conftest import QUICKSTART, method_for, small_config


def scalefl(model_name="preresnet20", **fields):
    return method_for({"name": "scalefl", **fields}, model_name, norm="static_bn")


def table(method):
    return method.level_table(None)


def upper_left(rows, cols=None):
    """Indices of the first `rows` (and `cols`) entries along dims 0 (and 1)."""
    dims = {0: torch.arange(rows)}
    if cols is not None:
        dims[1] = torch.arange(cols)
    return dims


def test_aggregation_divides_each_entry_by_its_client_count():
    # Prepare: three clients hold upper-left slices of different sizes; their sample counts differ
    # (10, 50, 100) and must not matter; `exit` is held only by the two deeper clients.
    old = {"w": torch.full((3, 3), 100.0), "b": torch.full((3,), 100.0), "exit": torch.full((2,), 100.0)}
    updates = [
        ClientUpdate(0, {"w": torch.tensor([[1.0]]), "b": torch.tensor([10.0])}, 10.0,
                     SubmodelSpec(indices={"w": upper_left(1, 1), "b": upper_left(1)}, absent=frozenset({"exit"})), {}),
        ClientUpdate(1, {"w": torch.tensor([[2.0, 3.0], [4.0, 5.0]]), "b": torch.tensor([20.0, 30.0]), "exit": torch.tensor([7.0, 8.0])},
                     50.0, SubmodelSpec(indices={"w": upper_left(2, 2), "b": upper_left(2)}), {}),
        ClientUpdate(2, {"w": torch.tensor([[6.0, 7.0], [8.0, 9.0], [10.0, 11.0]]), "b": torch.tensor([40.0, 50.0, 60.0]),
                         "exit": torch.tensor([1.0, 2.0])}, 100.0, SubmodelSpec(indices={"w": upper_left(3, 2)}), {}),
    ]
    # Execute
    new, _ = scalefl("cnn").aggregate(old, updates, MethodState())
    # Assert: every entry by hand; column 2 of w was held by nobody and keeps its value.
    expected_w = torch.tensor([[(1 + 2 + 6) / 3, (3 + 7) / 2, 100.0],
                               [(4 + 8) / 2, (5 + 9) / 2, 100.0],
                               [10.0, 11.0, 100.0]])
    torch.testing.assert_close(new["w"], expected_w)
    torch.testing.assert_close(new["b"], torch.tensor([(10 + 20 + 40) / 3, (30 + 50) / 2, 60.0]))
    torch.testing.assert_close(new["exit"], torch.tensor([4.0, 5.0]))


def brute_force(ratio, widths, blocks, window, min_depth=1):
    feasible = [(i, d) for i in range(len(widths)) for d in range(min_depth, blocks + 1) if window[0] <= ratio(i, d) <= window[1]]
    if not feasible:
        return None
    return min(feasible, key=lambda c: (abs(widths[c[0]] - c[1] / blocks), abs(ratio(*c) - 1)))


def test_grid_search_finds_the_uniform_split_of_a_cubic_cost():
    widths = [k / 10 for k in range(1, 11)]
    def ratio(i, d):  # cost s_w^2 s_d against a target of 1/8: the diagonal hits it at s = 1/2
        return widths[i] ** 2 * (d / 10) / 0.125
    assert most_uniform_split(ratio, widths, 10, (0.95, 1.05)) == (4, 5)
    assert most_uniform_split(ratio, widths, 10, (0.999, 1.001)) == (4, 5)
    assert most_uniform_split(lambda i, d: 5.0, widths, 10, (0.9, 1.1)) is None


@pytest.mark.parametrize("min_depth", [1, 4])
@pytest.mark.parametrize("window", [(0.95, 1.05), (0.9, 1.1), (0.9, 1.0), (0.99, 1.01)])
def test_grid_search_equals_brute_force_on_real_costs(window, min_depth):
    model = build_model("preresnet20", 3, 10)
    costs = AnalyticCosts(model, "linear", (3, 32, 32))
    widths = [round(k * 0.01, 2) for k in range(1, 101)]
    full_params, full_flops = costs.params(1.0, 9, frozenset()), costs.flops(1.0, 9, frozenset())
    for measure, full in ((costs.params, full_params), (costs.flops, full_flops)):
        for target in (0.05, 0.125, 0.2, 0.25, 0.4, 0.5, 0.8):
            def ratio(i, d, measure=measure, full=full, target=target):
                return measure(widths[i], d, held_exits((2,), d, 9)) / full / target
            expected = brute_force(ratio, widths, 9, window, min_depth)
            assert most_uniform_split(ratio, widths, 9, window, min_depth) == expected


def test_exits_are_the_authors_three_conv_classifiers():
    """Default exits: three conv3x3 layers keeping the features' channels, each with a norm and ReLU,
    then pooling and a linear layer (the authors' `Classifier`); they are costed into the levels."""
    method = scalefl()
    assert method.model.exits
    for exit_ in method.model.exits.values():
        convs = [m for m in exit_.modules() if isinstance(m, torch.nn.Conv2d)]
        channels = exit_.classifier.fc.in_features
        assert [(c.kernel_size, c.in_channels, c.out_channels) for c in convs] == [((3, 3), channels, channels)] * 3
        assert sum(isinstance(m, torch.nn.ReLU) for m in exit_.convs.modules()) == 3
    assert [(r["s_w"], r["depth"]) for r in table(method)] == [(0.63, 5), (0.72, 6), (0.68, 7), (1.0, 9)]
    assert [(r["s_w"], r["depth"]) for r in table(scalefl(exit_kind="linear"))] != [(0.63, 5), (0.72, 6), (0.68, 7), (1.0, 9)]


def test_levels_are_the_most_uniform_splits_within_epsilon():
    method = scalefl(epsilon=0.1, exit_kind="linear")
    rows = table(method)
    assert [(r["s_w"], r["depth"]) for r in rows] == [(0.67, 6), (0.75, 7), (0.85, 8), (1.0, 9)]
    for row in rows[:-1]:
        assert abs(row["r_l"] / row["target"] - 1) <= 0.1
        assert abs(row["s_w"] - row["s_d"]) < 1 / 9  # a one-block step of depth would not be more uniform
    assert rows[-1]["s_d"] == rows[-1]["s_w"] == 1.0


def test_unreachable_epsilon_names_the_level_and_the_closest_ratio():
    with pytest.raises(ConfigError, match=r"level 1 .*target cost ratio is 0.125, the closest split found costs 0\.\d+"):
        scalefl("cnn", width_step=0.25, epsilon=0.01)


def softmax(row, t=1.0):
    e = [math.exp(v / t) for v in row]
    return [v / sum(e) for v in e]


def hand_kl(student, teacher, t):
    total = 0.0
    for s_row, t_row in zip(student, teacher):
        p, q = softmax(t_row, t), softmax(s_row, t)
        total += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q)) * t * t
    return total / len(student)


def hand_ce(logits, y):
    return sum(-math.log(softmax(row)[label]) for row, label in zip(logits, y)) / len(y)


@pytest.mark.parametrize("j", [1, 2, 3])
def test_distillation_loss_equals_hand_computation(j):
    exits = [[[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]],
             [[2.0, 0.0, 1.0], [1.5, 0.5, -0.5]],
             [[0.3, 2.5, -1.0], [-2.0, 1.0, 1.0]]][:j]
    y, alpha, tau = [1, 2], 0.3, 2.0
    logits = [torch.tensor(e) for e in exits]
    slides = sum(i * (alpha * hand_kl(exits[i - 1], exits[-1], tau) + (1 - alpha) * hand_ce(exits[i - 1], y))
                 for i in range(1, j + 1)) / (j * (j + 1))
    terms = self_distillation_loss(logits, torch.tensor(y), alpha, tau, form="slides", kl_reduction="batchmean")
    assert terms["loss"].item() == pytest.approx(slides, rel=1e-6)
    # The authors' code: full CE at every exit, KLDivLoss's mean over batch and classes, divided by j(j+1)/2.
    classes = len(exits[0][0])
    authors = sum(i * (hand_ce(exits[i - 1], y) + alpha * hand_kl(exits[i - 1], exits[-1], tau) / classes)
                  for i in range(1, j + 1)) / (j * (j + 1) / 2)
    assert self_distillation_loss(logits, torch.tensor(y), alpha, tau)["loss"].item() == pytest.approx(authors, rel=1e-6)


def test_authors_kl_is_kldivloss_mean():
    student, teacher, tau = torch.randn(4, 10), torch.randn(4, 10), 3.0
    # nn.KLDivLoss()'s default reduction, 'mean', is the sum over every element / their number.
    kldiv = F.kl_div(F.log_softmax(student / tau, 1), F.softmax(teacher / tau, 1), reduction="sum") / student.numel() * tau * tau
    y = torch.tensor([0, 1, 2, 3])
    ce = [F.cross_entropy(z, y) for z in (student, teacher)]
    expected = (ce[0] + 0.5 * kldiv + 2 * ce[1]) / 3
    assert self_distillation_loss([student, teacher], y, 0.5, tau)["loss"].item() == pytest.approx(expected.item(), rel=1e-6)


def test_distillation_switches_on_after_a_quarter_of_the_rounds(monkeypatch):
    import hfl.methods.scalefl as module

    method = scalefl(alpha=0.5)
    method.resources = replace(method.resources, rounds=8)
    seen = []
    monkeypatch.setattr(module, "self_distillation_loss", lambda outputs, y, alpha, *rest: seen.append(alpha) or {})
    level = method.splits[0]
    model = method.client_model(method.spec_for(level))
    for round_ in (1, 2, 3):
        ctx = RoundContext(round_, 0, 0, 10, train_settings(small_config().fl, round_))
        task = SimpleNamespace(ctx=ctx, options=method.ladder.levels[0].options)
        method.objective(SimpleNamespace(model=model, task=task), torch.randn(2, 1, 8, 8), torch.tensor([0, 1]))
    assert seen == [0.0, 0.0, 0.5]  # round > 8 / 4


def test_teacher_gradient_follows_detach_teacher():
    shallow, deep = torch.randn(4, 5, requires_grad=True), torch.randn(4, 5, requires_grad=True)
    y = torch.tensor([0, 1, 2, 3])
    for detach in (False, True):
        deep.grad = None
        self_distillation_loss([shallow, deep], y, alpha=1.0, temperature=3.0, detach_teacher=detach, form="slides")["loss"].backward()
        assert (deep.grad.abs().sum() == 0) == detach  # alpha = 1: the deep exit learns only through the KL


def test_exits_sit_at_the_level_cuts_and_clients_hold_those_before_theirs():
    method = scalefl()
    depths = [split.depth for split in method.splits]
    assert method.model.exit_blocks == tuple(d - 1 for d in depths if d < 9) == (4, 5, 6)
    global_state = method.model.state_dict()
    x = torch.randn(4, 1, 8, 8)
    for number, level in enumerate(method.splits, start=1):
        spec = method.spec_for(level)
        client = method.client_model(spec)
        client.load_state_dict(extract(global_state, spec), strict=True)
        assert client.exit_blocks == tuple(b for b in (4, 5, 6) if b < level.depth)
        assert (client.head is not None) == (level.depth == 9)
        assert len(client.forward_exits(x)) == number  # a level-j model holds exits 1..j


def test_analytic_costs_match_the_built_models():
    env = ClientEnvironment.from_config(small_config(method={"name": "scalefl"}, model={"name": "preresnet20"}))
    method = env.method
    for row, split in zip(table(method), method.splits):
        client = method.client_model(method.spec_for(split))
        assert row["params"] == sum(p.numel() for p in client.parameters())
        assert row["flops"] == env.accountant.measure(client, 8).forward_flops_per_sample  # torch's FLOP counter


def levels_without_budgets(clients: int) -> dict[int, list[int]]:
    """Every client's level in rounds 1 and 2 of a run with `clients` unbudgeted clients."""
    method = method_for({"name": "scalefl"}, "preresnet20", norm="static_bn", budgets=[None] * clients)
    settings = train_settings(small_config().fl, 1)
    return {r: [method.plan(RoundContext(r, c, 7, 50, settings), MethodState()).options.level for c in range(clients)] for r in (1, 2)}


def test_clients_without_budgets_get_a_level_each_a_quarter_of_them_for_the_run():
    """The slides: "Client level distribution is uniform (25% each level)", exactly."""
    levels = levels_without_budgets(100)
    assert levels[1] == levels[2]
    assert levels[1] == [1] * 25 + [2] * 25 + [3] * 25 + [4] * 25  # the other methods' tiers without budgets
    assert levels_without_budgets(10)[1] == [1, 1, 2, 2, 3, 3, 3, 4, 4, 4]  # the extra clients at the top levels


def levels_of_run(run_dir):
    """The levels of the method a finished run used (rebuilt from its config)."""
    from hfl.backends.base import ClientEnvironment
    from hfl.config import load_config

    return ClientEnvironment.from_config(load_config(run_dir / "config.yaml", [])).method.splits


def run_fair(tmp_path, **method):
    config = small_config(method={"name": "scalefl", **method}, model={"name": "preresnet20"}, budgets={"scenario": "fair"},
                          fl={"rounds": 2, "clients": 8, "fraction": 1.0})
    return run_experiment(config, tmp_path)


@pytest.mark.slow
def test_fair_budgets_are_respected_and_every_level_scored(tmp_path):
    summary = run_fair(tmp_path)
    assert summary["budget_violations"] == 0
    assert summary["client_rounds"] + summary["skipped_client_rounds"] == 16
    trained = {c["tier"]: c["submodel"] for r in read_metrics(tmp_path) for c in r["clients"]}
    widths = [trained[t]["width"] for t in ("w1_6", "w1_3", "w1_2", "w1") if t in trained]
    assert widths == sorted(widths)  # a larger budget never trains a smaller level
    # Only levels some client trained are scored; the global model is the highest of them.
    levels = sorted({f"level{n}" for n, lv in enumerate(levels_of_run(tmp_path), start=1)
                     if any(abs(lv.width - s["width"]) < 1e-9 and lv.depth == (s["depth"] or 9) for s in trained.values())})
    assert sorted(summary["submodel_accuracy"]) == levels
    assert summary["final_accuracy"] == summary["submodel_accuracy"][levels[-1]]


@pytest.mark.parametrize("scenario", ["fair", "lack"])
@pytest.mark.slow
def test_levels_from_budgets_fit_the_budget_clusters(scenario):
    config = small_config(method={"name": "scalefl", "levels_from": "budgets"}, model={"name": "preresnet20"},
                          budgets={"scenario": scenario}, fl={"clients": 8})
    env = ClientEnvironment.from_config(config)
    rows = table(env.method)
    assert len(rows) == 4 and rows[-1]["target"] == 1.0  # four tiers, the widest the whole plain model
    assert [r["depth"] for r in rows] == sorted(r["depth"] for r in rows)  # level j holds exits 1..j
    assert all(0.95 <= row["r_l"] / row["target"] <= 1.0 for row in rows)  # one-sided: a client at the centre fits
    _, budgets = assign_budgets(config, env.accountant, [len(p) for p in env.partitions])
    for client, budget in enumerate(budgets):  # every client trains its own tier's level, within budget
        task = env.method.plan(RoundContext(1, client, 0, len(env.partitions[client]), train_settings(config.fl, 1), budget), MethodState())
        assert task is not None and env.cost_metrics(task)["estimated_peak_bytes"] <= budget.memory_bytes
        assert rows[task.options.level - 1]["target"] == pytest.approx(budget.memory_bytes / env.method._plain_memory())


def test_kmeans_1d_by_hand():
    assert kmeans_1d([1, 1, 2, 2, 10, 11], 3) == [1.0, 2.0, 10.5]
    assert kmeans_1d([5, 5, 5], 4) == [5.0]
    assert np.allclose(kmeans_1d([1, 2, 3, 10, 11, 12], 2), [2.0, 11.0])


@pytest.mark.slow
def test_budget_prints_the_level_table(tmp_path, capsys):
    out_json = tmp_path / "budget.json"
    assert main(["budget", str(QUICKSTART), "method.name=scalefl", "model.name=preresnet20", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    table = out[out.index("Sub-models of scalefl (ScaleFL's Table 1"):].splitlines()
    assert table[1].split() == ["level", "s_d", "s_w", "blocks", "#params", "#FLOPs", "r_l", "target", "train", "memory", "MiB"]
    rows = [line.split() for line in table[3:7]]
    assert [r[0] for r in rows] == ["1", "2", "3", "4"]
    assert rows[0][1:4] == ["0.556", "0.630", "5"]  # level 1: s_d, s_w, blocks kept
    levels = json.loads(out_json.read_text())["levels"]
    assert [lv["level"] for lv in levels] == [1, 2, 3, 4]
    assert all(lv["peak_bytes"] > 0 and lv["flops"] > 0 for lv in levels)
