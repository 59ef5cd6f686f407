"""NeFL's dynamic tiers (appendix B.7): equal tiers by client id, the paper's windows, seeded draws
kept within a memory budget, and HeteroFL, FjORD and DepthFL drawing their levels from them."""

from collections import Counter

import pytest

from hfl.accounting import Accountant
from hfl.accounting.budgets import ClientBudget
from hfl.errors import ConfigError
from hfl.loggers import read_metrics
from hfl.methods import build_method
from hfl.methods.tiers import DynamicTiers
from hfl.models import build_model
from hfl.server import run_experiment
from hfl.types import RoundContext, TrainSettings
from tests.conftest import small_config

SETTINGS = TrainSettings(0.05, 0.9, 0.0, 1, 16)
PAPER_WINDOWS = [{0, 1, 2}, {0, 1, 2, 3}, {0, 1, 2, 3, 4}, {1, 2, 3, 4}, {2, 3, 4}]
"""NeFL's five tiers over five sub-models (0 = the smallest), window 2."""


def everything(_level: int) -> bool:
    return True


def context(client: int, round_: int = 1, budget_bytes: int | None = None) -> RoundContext:
    budget = None if budget_bytes is None else ClientBudget("t", budget_bytes, None, None)
    return RoundContext(round_, client, 0, 200, SETTINGS, budget)


def paper_tiers(clients: int = 100) -> DynamicTiers:
    tiers = DynamicTiers(5, 2)
    tiers.use_budgets([None] * clients)
    return tiers


def test_clients_without_budgets_split_into_equal_tiers():
    tiers = paper_tiers()
    counts = Counter(tiers.tier(context(c), everything) for c in range(100))
    assert counts == {0: 20, 1: 20, 2: 20, 3: 20, 4: 20}
    assert [tiers.tier(context(c), everything) for c in (0, 19, 20, 99)] == [0, 0, 1, 4]


def test_tier_windows_are_the_papers_sets():
    tiers = paper_tiers()
    assert [set(tiers.allowed(context(20 * t), everything)) for t in range(5)] == PAPER_WINDOWS


def test_draws_are_seeded_and_cover_exactly_the_window():
    tiers = paper_tiers()
    for t, window in enumerate(PAPER_WINDOWS):
        client = 20 * t + 7
        draws = [tiers.draw(context(client, r), everything) for r in range(1, 101)]
        assert draws == [tiers.draw(context(client, r), everything) for r in range(1, 101)]
        assert set(draws) == window


def test_a_memory_budget_sets_the_tier_and_bounds_the_draws():
    tiers = paper_tiers()
    fits = lambda k: k <= 3  # levels 0-3 fit the client's memory
    ctx = context(0, budget_bytes=1)  # client 0 would be tier 0 without a budget
    assert tiers.tier(ctx, fits) == 3
    assert tiers.allowed(ctx, fits) == [1, 2, 3]
    assert {tiers.draw(context(0, r, 1), fits) for r in range(1, 101)} == {1, 2, 3}
    gappy = lambda k: k in (0, 2)  # only what fits is drawn, even inside the window
    assert tiers.allowed(ctx, gappy) == [0, 2]
    assert {tiers.draw(context(0, r, 1), gappy) for r in range(1, 101)} == {0, 2}


def test_nothing_fits_draws_none():
    tiers = paper_tiers()
    nothing = lambda _k: False
    ctx = context(50, budget_bytes=1)
    assert tiers.tier(ctx, nothing) is None and tiers.allowed(ctx, nothing) == []
    assert tiers.draw(ctx, nothing) is None


METHODS = {
    # name: (method fields, model, the planned level of a task)
    "heterofl": ({}, "cnn", lambda m, task: sorted(m.config.widths).index(task.options["rate"])),
    "fjord": ({"widths": [0.2, 0.4, 0.6, 0.8, 1.0]}, "cnn", lambda m, task: m.ladder.index(task.options["p_max"])),
    "depthfl": ({"exits": "blocks", "exit_kind": "linear"}, "preresnet20", lambda m, task: m.depths.index(task.options["depth"])),
}


@pytest.mark.parametrize("name", list(METHODS))
def test_each_baseline_draws_its_level_from_the_clients_tier_window(name):
    fields, model_name, level = METHODS[name]
    config = small_config(method={"name": name, "tier_window": 2, **fields}, model={"name": model_name})
    clients = 100
    method = build_method(config.method, build_model(model_name, 1, 10), None, [None] * clients, SETTINGS.batch_size)
    levels = method.tiers.levels
    assert levels == {"heterofl": 5, "fjord": 5, "depthfl": 9}[name]
    for client in range(0, clients, 10):
        tier = client * levels // clients
        window = set(range(max(0, tier - 2), min(levels - 1, tier + 2) + 1))
        drawn = [level(method, method.plan(context(client, r), {})) for r in range(1, 61)]
        assert set(drawn) == window, (client, tier)


def ladder_and_cost(name, method):
    """The method's levels, smallest first, and what training one of them costs a 16-sample batch."""
    if name == "heterofl":
        return sorted(method.config.widths), lambda r: method.accountant.cost(method.model.width * r, 16).peak_bytes
    return list(method.ladder), lambda p: method.training_cost(method.spec_for(p), 16).peak_bytes


@pytest.mark.parametrize(("name", "fits"), [("heterofl", "rate_fits"), ("fjord", "width_fits")])
def test_tiers_keep_budgets_and_a_client_nothing_fits_sits_out(name, fits):
    fields, model_name, level = METHODS[name]
    config = small_config(method={"name": name, "tier_window": 2, **fields}, model={"name": model_name})
    accountant = Accountant(build=lambda w: build_model(model_name, 1, 10, w), input_shape=(1, 8, 8), num_classes=10)
    method = build_method(config.method, build_model(model_name, 1, 10), accountant, [None] * 10, SETTINGS.batch_size)
    accountant.adapt = method.adapt_model
    ladder, cost = ladder_and_cost(name, method)
    budget = cost(ladder[2])
    assert [getattr(method, fits)(x, context(0, budget_bytes=budget)) for x in ladder] == [True, True, True, False, False]
    drawn = {level(method, method.plan(context(9, r, budget), {})) for r in range(1, 61)}
    assert drawn == {0, 1, 2}  # client 9 would be tier 4 without a budget; its budget makes it tier 2
    assert method.plan(context(9, 1, cost(ladder[0]) - 1), {}) is None


def test_heterofl_without_tiers_still_falls_back_to_its_smallest_rate():
    config = small_config(method={"name": "heterofl"})
    accountant = Accountant(build=lambda w: build_model("cnn", 1, 10, w), input_shape=(1, 8, 8), num_classes=10)
    method = build_method(config.method, build_model("cnn", 1, 10), accountant)
    assert method.tiers is None
    assert method.plan(context(0, budget_bytes=1), {}).options["rate"] == min(config.method.widths)


def test_a_run_with_tiers_trains_several_levels(tmp_path):
    config = small_config(method={"name": "heterofl", "tier_window": 2}, fl={"rounds": 2, "clients": 4, "fraction": 1.0})
    summary = run_experiment(config, tmp_path)
    assert summary["client_rounds"] == 8 and summary["skipped_client_rounds"] == 0
    widths = [c["submodel"]["width"] for r in read_metrics(tmp_path) for c in r["clients"]]
    assert len(widths) == 8 and len(set(widths)) > 1  # without tiers (and budgets) every client trains width 1


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("window", [-2, 1.5, True])
def test_a_bad_window_names_the_field(name, window):
    with pytest.raises(ConfigError, match="tier_window"):
        small_config(method={"name": name, "tier_window": window})
