"""Budget parsing, scenarios and assignment; violations end to end."""

from collections import Counter

import numpy as np
import pytest

from hfl.accounting.amounts import SCENARIOS, absolute_amount, parse_width
from hfl.accounting.budgets import (
    BudgetResolver,
    assign_budgets,
    assign_tiers,
    tiers_of,
)
from hfl.backends.base import ClientEnvironment
from hfl.config import load_config
from hfl.errors import ConfigError
from hfl.server import run_experiment
from tests.conftest import QUICKSTART, small_config


def test_absolute_amounts():
    assert absolute_amount("256MB") == 256 * 10**6
    assert absolute_amount("1.5GiB") == int(1.5 * 2**30)
    assert absolute_amount("3e9") == 3 * 10**9
    assert absolute_amount("1024") == 1024


@pytest.mark.parametrize("override", ["budgets.scenario=tiers budgets.memory=[12XB]", "budgets.scenario=tiers budgets.memory=[width:0]",
                                       "budgets.scenario=fair budgets.memory=[1MB]", "budgets.scenario=tiers budgets.memory=[1MB,2MB] budgets.shares=[0.5,0.6]",
                                       "budgets.scenario=per_client budgets.memory=[1MB]", "budgets.scenario=generous"])
def test_bad_budgets_name_the_field(override):
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, override.split())
    assert info.value.field.startswith("budgets.")


@pytest.mark.parametrize("clients, counts", [(100, [25, 25, 25, 25]), (10, [3, 3, 2, 2])])
def test_scenarios_give_each_width_a_quarter_of_the_clients(clients, counts):
    tiers = tiers_of("fair", (), (), (), (), ())
    assert [t.memory for t in tiers] == [f"width:{w}" for w in SCENARIOS["fair"]]
    tier_of = assign_tiers(tiers, clients, np.random.default_rng(0))
    assert [Counter(tier_of)[i] for i in range(4)] == counts
    assert tier_of == assign_tiers(tiers, clients, np.random.default_rng(0))
    assert tier_of != assign_tiers(tiers, clients, np.random.default_rng(1))


def test_tier_shares():
    tiers = tiers_of("tiers", ("width:1/4", "1GB"), (), (), (0.2, 0.8), ())
    assert Counter(assign_tiers(tiers, 10, np.random.default_rng(0))) == {0: 2, 1: 8}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_scenario_budgets_are_the_memory_of_training_at_each_width(scenario):
    config = small_config(budgets={"scenario": scenario}, fl={"clients": 8})
    env = ClientEnvironment.from_config(config)
    tiers, budgets = assign_budgets(config, env.accountant, [len(p) for p in env.partitions])
    by_tier = {b.tier: b.memory_bytes for b in budgets}
    expected = [env.accountant.plain_cost(parse_width(w), config.fl.batch_size).peak_bytes for w in SCENARIOS[scenario]]
    assert [by_tier[t.name] for t in tiers] == expected
    assert expected == sorted(expected)
    assert Counter(b.tier for b in budgets) == {t.name: 2 for t in tiers}


def test_relative_flops_and_upload_budgets():
    config = small_config(budgets={"scenario": "tiers", "memory": ["width:1/2"], "flops": ["width:1/2"], "upload": ["width:1/2"]})
    env = ClientEnvironment.from_config(config)
    _, budgets = assign_budgets(config, env.accountant, [len(p) for p in env.partitions])
    cost = env.accountant.plain_cost(0.5, config.fl.batch_size)
    assert budgets[0].upload_bytes == cost.param_bytes
    assert budgets[0].flops == cost.train_flops_per_sample * len(env.partitions[0]) * config.fl.local_epochs
    resolver = BudgetResolver(env.accountant, config.fl.batch_size, 1)
    assert resolver.memory("1MB") == 10**6


def test_a_flops_budget_per_batch_bounds_each_batch_whatever_the_clients_data():
    """CAFF counts a FLOPs budget per mini-batch: a model fits a client exactly when one batch of it
    costs at most the budget, whatever the client's data. Per client-round, the same model fits a
    client with little data and not one with much."""
    config = small_config(fl={"batch_size": 8, "local_epochs": 2})
    env = ClientEnvironment.from_config(config)
    per_sample = env.accountant.plain_cost(1.0, 8).train_flops_per_sample  # 1.85 MFLOPs: 14.8M a batch of 8
    per_batch, per_round = BudgetResolver(env.accountant, 8, 2, "batch"), BudgetResolver(env.accountant, 8, 2, "round")
    for amount in (10**7, 2 * 10**7):
        for n in (5, 8, 100, 239):
            assert (per_sample * n * 2 <= per_batch.flops(str(amount), n)) == (per_sample * min(8, n) <= amount)
    assert [per_sample * n * 2 <= per_round.flops("2e7", n) for n in (5, 239)] == [True, False]
    tiered = small_config(budgets={"scenario": "tiers", "memory": ["1GB"], "flops": ["2e7"], "flops_per": "batch"}, fl={"batch_size": 8})
    _, budgets = assign_budgets(tiered, env.accountant, [239] * tiered.fl.clients)
    assert budgets[0].flops == 2 * 10**7 * 239 * tiered.fl.local_epochs // 8


def test_an_unknown_flops_unit_names_the_field():
    with pytest.raises(ConfigError, match=r"budgets\.flops_per.*'sample'.*round, batch"):
        small_config(budgets={"scenario": "tiers", "memory": ["1GB"], "flops_per": "sample"})


@pytest.mark.parametrize("width, violations", [(1.0, True), (0.1667, False)])
def test_fedavg_violates_fair_budgets_only_at_full_width(tmp_path, width, violations):
    config = small_config(model={"width": width}, budgets={"scenario": "fair"}, fl={"rounds": 2, "clients": 8, "fraction": 1.0})
    summary = run_experiment(config, tmp_path)
    assert (summary["budget_violations"] > 0) == violations
    if violations:  # exactly the clients below the full-width tier
        assert summary["budget_violations"] == 2 * 6 and summary["tiers"]["w1"]["budget_violations"] == 0
    assert set(summary["tiers"]) == {"w1_6", "w1_3", "w1_2", "w1"}
