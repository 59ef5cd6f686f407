"""The ladder of sub-models: NeFL's dynamic tiers (appendix B.7: equal tiers by client id, the
paper's windows, seeded draws kept within a memory budget), HeteroFL, FjORD and DepthFL drawing their
levels from them, budgets fitted in memory, FLOPs and upload, and what is evaluated."""

from collections import Counter

import pytest

from hfl.accounting.amounts import ClientBudget
from hfl.errors import ConfigError
from hfl.loggers import read_metrics
from hfl.methods.base import MethodState
from hfl.server import run_experiment
from hfl.submodel.ladder import DynamicTiers, Ladder, Level, equal_share
from hfl.submodel.spec import SubmodelSpec
from hfl.types import RoundContext, TrainSettings
from tests.conftest import level_cost, method_for, small_config

SETTINGS = TrainSettings(0.05, 0.9, 0.0, 1, 16)
PAPER_WINDOWS = [{0, 1, 2}, {0, 1, 2, 3}, {0, 1, 2, 3, 4}, {1, 2, 3, 4}, {2, 3, 4}]
"""NeFL's five tiers over five sub-models (0 = the smallest), window 2."""


def everything(_level: int) -> bool:
    return True


def context(client: int, round_: int = 1, budget_bytes: int | None = None, flops: int | None = None, upload: int | None = None) -> RoundContext:
    budget = None if budget_bytes is None and flops is None and upload is None else ClientBudget("t", budget_bytes, flops, upload)
    return RoundContext(round_, client, 0, 200, SETTINGS, budget)


def paper_tiers(clients: int = 100) -> DynamicTiers:
    return DynamicTiers(5, 2, clients)


def draw(tiers: DynamicTiers, ctx: RoundContext, fits) -> int | None:
    return tiers.pick(ctx, tiers.allowed(ctx, fits))


def test_clients_without_budgets_split_into_equal_tiers():
    tiers = paper_tiers()
    counts = Counter(tiers.tier(context(c), everything) for c in range(100))
    assert counts == {0: 20, 1: 20, 2: 20, 3: 20, 4: 20}
    assert [tiers.tier(context(c), everything) for c in (0, 19, 20, 99)] == [0, 0, 1, 4]


def test_unequal_tiers_give_the_extra_clients_to_the_top_tiers_as_table_3s():
    """Appendix B.7, Table 3: three sub-models over 10 clients, "tier 1 ... 3 ... tier 2 ... 3 ...
    tier 3 (4 out of 10)"; in general shares differ by one at most, larger at the top, by id."""
    tiers = DynamicTiers(3, 0, 10)
    assert [tiers.tier(context(c), everything) for c in range(10)] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    for clients in range(1, 40):
        for levels in range(1, 7):
            shares = [equal_share(c, clients, levels) for c in range(clients)]
            sizes = [shares.count(k) for k in range(levels)]
            assert shares == sorted(shares) and sizes == sorted(sizes) and max(sizes) - min(sizes) <= 1


def test_tier_windows_are_the_papers_sets():
    tiers = paper_tiers()
    assert [set(tiers.allowed(context(20 * t), everything)) for t in range(5)] == PAPER_WINDOWS


def test_draws_are_seeded_and_cover_exactly_the_window():
    tiers = paper_tiers()
    for t, window in enumerate(PAPER_WINDOWS):
        client = 20 * t + 7
        draws = [draw(tiers, context(client, r), everything) for r in range(1, 101)]
        assert draws == [draw(tiers, context(client, r), everything) for r in range(1, 101)]
        assert set(draws) == window


def test_a_memory_budget_sets_the_tier_and_bounds_the_draws():
    tiers = paper_tiers()
    fits = lambda k: k <= 3  # levels 0-3 fit the client's memory
    ctx = context(0, budget_bytes=1)  # client 0 would be tier 0 without a budget
    assert tiers.tier(ctx, fits) == 3
    assert tiers.allowed(ctx, fits) == [1, 2, 3]
    assert {draw(tiers, context(0, r, 1), fits) for r in range(1, 101)} == {1, 2, 3}
    gappy = lambda k: k in (0, 2)  # only what fits is drawn, even inside the window
    assert tiers.allowed(ctx, gappy) == [0, 2]
    assert {draw(tiers, context(0, r, 1), gappy) for r in range(1, 101)} == {0, 2}


def test_nothing_fits_draws_none():
    tiers = paper_tiers()
    nothing = lambda _k: False
    ctx = context(50, budget_bytes=1)
    assert tiers.tier(ctx, nothing) is None and tiers.allowed(ctx, nothing) == []
    assert draw(tiers, ctx, nothing) is None


LEVEL_OPTION = {"heterofl": "rate", "fjord": "p_max", "depthfl": "depth"}
METHODS = {  # name: (method fields, model)
    "heterofl": ({}, "cnn"),
    "fjord": ({"widths": [0.2, 0.4, 0.6, 0.8, 1.0]}, "cnn"),
    "depthfl": ({"exits": "blocks", "exit_kind": "linear"}, "preresnet20"),
}


def level_index(method, task) -> int:
    """The index, smallest first, of the ladder level a task trains."""
    return [level.name for level in method.ladder.levels].index(task.level)


@pytest.mark.parametrize("name", list(METHODS))
def test_each_baseline_draws_its_level_from_the_clients_tier_window(name):
    fields, model_name = METHODS[name]
    clients = 100
    method = method_for({"name": name, "tier_window": 2, **fields}, model_name, budgets=[None] * clients, batch_size=SETTINGS.batch_size)
    levels = len(method.ladder.levels)
    assert levels == {"heterofl": 5, "fjord": 5, "depthfl": 9}[name]
    for client in range(0, clients, 10):
        tier = client * levels // clients
        window = set(range(max(0, tier - 2), min(levels - 1, tier + 2) + 1))
        drawn = [level_index(method, method.plan(context(client, r), MethodState())) for r in range(1, 61)]
        assert set(drawn) == window, (client, tier)


@pytest.mark.parametrize("name", ["heterofl", "fjord"])
@pytest.mark.parametrize("window", [2, -1])
def test_budgets_are_kept_and_a_client_nothing_fits_sits_out(name, window):
    fields, model_name = METHODS[name]
    method = method_for({"name": name, "tier_window": window, **fields}, model_name, budgets=[None] * 10, batch_size=SETTINGS.batch_size)
    levels = method.ladder.levels
    budget = level_cost(method, levels[2].name, 16, num_samples=200)
    assert [method.ladder.fits(level, context(0, budget_bytes=budget)) for level in levels] == [True, True, True, False, False]
    drawn = {level_index(method, method.plan(context(9, r, budget), MethodState())) for r in range(1, 61)}
    # Client 9 would be tier 4 without a budget; its budget makes it tier 2. Without tiers: the largest that fits.
    assert drawn == ({0, 1, 2} if window == 2 else {2})
    assert method.plan(context(9, 1, level_cost(method, levels[0].name, 16, num_samples=200) - 1), MethodState()) is None


def test_flops_and_upload_budgets_are_fitted_too():
    method = method_for({"name": "heterofl"}, "cnn")
    levels = method.ladder.levels  # x0.0625 .. x1
    ctx = context(0)
    flops = [method.training_cost(method.ladder.task_for(ctx, lv), 16).train_flops_per_sample * 200 for lv in levels]
    uploads = [method.upload_bytes(lv.spec) for lv in levels]
    assert flops == sorted(flops) and uploads == sorted(uploads) and uploads[-1] == sum(t.numel() * 4 for t in method.model.state_dict().values())
    assert method.plan(context(0, flops=flops[2]), MethodState()).level == levels[2].name
    assert method.plan(context(0, upload=uploads[1]), MethodState()).level == levels[1].name
    assert method.plan(context(0, upload=uploads[0] - 1), MethodState()) is None


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


@pytest.mark.parametrize(("policy", "evaluated"), [("all", ["a", "b", "c"]), ("nested", ["a", "b"]), ("trained", ["b"]), ("none", [])])
def test_the_evaluated_policy_names_the_scored_levels(policy, evaluated):
    """'none' is CAFF's: its levels share one model's weights, so only the global model is scored."""
    levels = [Level(name, SubmodelSpec()) for name in "abc"]
    ladder = Ladder(levels, cost=lambda task, batch: None, evaluated=policy)

    assert list(ladder.evaluated(frozenset({"b"}))) == evaluated
