"""The numbers the README and benchmarks/RESULTS.md quote from `hfl budget`, pinned through the code
path `hfl budget` uses (`ClientEnvironment.from_config` and `hfl.budget`). The experiments' CIFAR-10
is replaced by the synthetic dataset of the same shape (3x32x32, 10 classes): costs depend only on
the input shape, the classes, the model, the batch and the optimiser. MiB, rounded as printed.

FeDepth's block groups per tier are deliberately not pinned (how groups are formed is still
changing); the tiers' budgets and the per-block costs they are formed from are."""

import pytest

from hfl.backends.base import ClientEnvironment
from hfl.budget import (
    block_rows,
    round_one,
    sparse_rows,
    table_method,
    tier_plans,
    tier_rows,
    width_rows,
)
from hfl.config import load_config
from tests.conftest import ROOT

CIFAR_SHAPED = ["data.name=synthetic", "fl.clients=8"]  # 8 clients: two per tier, every tier present


def mib(n: int | None) -> float | None:
    return None if n is None else round(n / 2**20, 2)


def environment(experiment: str, *overrides: str):
    config = load_config(ROOT / "experiments" / experiment, [*CIFAR_SHAPED, *overrides])
    return config, ClientEnvironment.from_config(config)


@pytest.fixture(scope="module")
def fedepth():
    """FeDepth's Table 2 setting: PreResNet-20, batch 128, plain SGD, `fair` budgets."""
    return environment("fedepth_table2/fedepth.yaml")


def test_fedepth_fair_tiers_have_the_readme_budgets(fedepth):
    config, env = fedepth
    rows = tier_rows(config, env)
    assert [(t["tier"], t["memory"], mib(t["memory_bytes"])) for t in rows] == [
        ("w1_6", "width:1/6", 36.35), ("w1_3", "width:1/3", 69.76), ("w1_2", "width:1/2", 95.77), ("w1", "width:1", 190.55)]
    assert [t["clients"] for t in rows] == [2, 2, 2, 2]


def test_blocks_and_widths_cost_what_the_table_1_comparison_says(fedepth):
    config, env = fedepth
    blocks = block_rows(config, env)
    assert [mib(b["activation_bytes"]) for b in blocks] == [32.0, 32.0, 32.0, 24.0, 16.0, 16.0, 12.0, 8.0, 8.0]
    assert [mib(b["block_training_bytes"]) for b in blocks] == [32.04, 32.04, 32.04, 24.11, 16.14, 16.14, 12.44, 8.57, 8.57]
    assert [mib(b["peak_bytes"]) for b in blocks] == [34.57, 34.57, 34.57, 26.60, 18.62, 18.62, 14.77, 10.83, 10.83]
    widths = {w["width"]: w for w in width_rows(config, env)}
    assert {k: mib(w["activation_bytes"]) for k, w in widths.items()} == {
        "1/8": 23.01, "1/6": 34.14, "1/4": 46.01, "1/3": 66.77, "1/2": 92.02, "1": 184.04}
    assert {k: mib(w["peak_bytes"]) for k, w in widths.items()} == {
        "1/8": 25.02, "1/6": 36.35, "1/4": 48.57, "1/3": 69.76, "1/2": 95.77, "1": 190.55}


def test_fedepth_block_1_alone_outgrows_the_smallest_tier(fedepth):
    """FeDepth trains a block with the frozen prefix running forward and the gradient flowing
    back through it: block 1 alone needs 58.6 MiB at batch 128, more than the 1/6 tier's 36.35, so
    that tier trains partially; blocks 5 to 9 need about 35 MiB each. At batch 32 no block fits the
    1/6 tier (9.11 MiB against at least 9.42)."""
    _, env = fedepth
    method, accountant = env.method, env.accountant
    alone = {batch: [mib(method.stage_cost((b, b), 1, batch).peak_bytes) for b in range(9)] for batch in (128, 32)}
    assert alone[128] == [58.56, 50.56, 50.56, 42.60, 34.55, 34.55, 34.55, 34.55, 34.55]
    assert alone[32] == [15.43, 13.43, 13.43, 11.48, 9.42, 9.42, 9.42, 9.42, 9.42]
    assert mib(accountant.plain_cost(1 / 6, 32).peak_bytes) == 9.11


@pytest.mark.parametrize(("scenario", "bases", "of"), [("fair", [1, 1, 2, 5], 6), ("lack", [1, 1, 4, 8], 8), ("surplus", [1, 1, 2, 6], 6)])
def test_splitmix_bases_per_tier(scenario, bases, of):
    config, env = environment("fedepth_table2/splitmix.yaml", f"budgets.scenario={scenario}")
    method = env.method
    assert method.num_bases == of
    rows = tier_plans(config, env)
    assert all(r["peak_bytes"] <= r["budget_bytes"] for r in rows)
    first = {b.tier: c for c, b in reversed(list(enumerate(env.budgets)))}
    planned = [method.plan(round_one(config, env, first[r["tier"]]), method.init_state()) for r in rows]
    assert [len(task.options.bases) for task in planned] == bases


@pytest.mark.slow
def test_scalefl_resnet110_levels_match_table_1():
    """ScaleFL's levels by the paper's parameter ratios 1/8, 1/4, 1/2, 1 on ResNet-110, with the
    authors' three-conv exits (the README quotes them against the paper's 0.21 / 0.46 / 0.86 / 1.73 M)
    and with linear exits."""
    config, env = environment("scalefl_cifar10/scalefl.yaml")
    rows = env.method.level_table(round_one(config, env, 0))
    assert [(round(r["s_d"], 2), round(r["s_w"], 2)) for r in rows] == [(0.67, 0.67), (0.72, 0.72), (0.81, 0.82), (1.0, 1.0)]
    assert [round(r["params"] / 1e6, 2) for r in rows] == [0.21, 0.42, 0.87, 1.98]
    # docs/methods.md: the paper's own Table 1 splits do not minimise |s_w - s_d| as its equation asks.
    # hfl's split of each level meets the cost equation (within epsilon) and is more uniform than the
    # paper's row for that level, so the paper's row is not the equation's minimiser.
    paper_table_1 = [(0.66, 0.70), (0.77, 0.70), (0.88, 0.75)]  # (s_d, s_w) of levels 1-3, ratios 1/8, 1/4, 1/2
    for row, (s_d, s_w) in zip(rows, paper_table_1, strict=False):
        assert abs(row["r_l"] / row["target"] - 1) <= env.method.config.epsilon
        assert abs(row["s_w"] - row["s_d"]) < abs(s_w - s_d), (row, (s_d, s_w))
    config, env = environment("scalefl_cifar10/scalefl.yaml", "method.exit_kind=linear")
    rows = env.method.level_table(round_one(config, env, 0))
    assert [(round(r["s_d"], 2), round(r["s_w"], 2)) for r in rows] == [(0.69, 0.68), (0.76, 0.75), (0.85, 0.85), (1.0, 1.0)]
    assert [round(r["params"] / 1e6, 2) for r in rows] == [0.22, 0.43, 0.85, 1.73]


@pytest.mark.slow
def test_sparse_table_in_fedmef_table_1_form():
    """`hfl budget` on FedMef's Table 1 setting (ResNet-18, batch 64, 32x32) at s = 0.8: the numbers
    benchmarks/RESULTS.md quotes, and the relations the appendix's formulas imply."""
    config, env = environment("fedmef_table1/fedmef.yaml")
    rows = {r["method"]: r for r in sparse_rows(config, env, (0.8,))}
    assert list(rows) == ["fedavg", "flpqsu", "feddst", "fedtiny", "fedtiny, no norms", "fedmef", "fedmef, no SAP"]
    printed = {m: (mib(r["param_bytes"]), mib(r["activation_bytes"]), mib(r["peak_bytes"]), mib(r["paper_memory_bytes"])) for m, r in rows.items()}
    assert printed["fedavg"] == (42.66, 286.16, 355.47, 657.65)
    assert printed["fedmef"] == (12.51, 66.58, 192.22, 277.14)  # NSConv's gains and biases: 0.04 MiB
    # Beside FedMef, on its own norm-free model: FedTiny (most of FedMef's saving over batch-norm FedTiny
    # is the removed norms) and FedMef without SAP (SAP cuts the saved activations 2.7x, not 4.3x).
    assert printed["fedtiny, no norms"] == (12.47, 136.13, 219.36, 304.0)
    assert printed["fedmef, no SAP"] == (12.51, 178.75, 261.67, 389.32)
    dense, tiny, dst, mef = rows["fedavg"], rows["fedtiny"], rows["feddst"], rows["fedmef"]
    assert dense["flops_ratio"] == dense["exchange_ratio"] == 1.0
    assert dense["bytes_up"] == dense["bytes_down"] == dense["param_bytes"]  # FedAvg: 2·O_d
    assert dst["bytes_up"] == dst["param_bytes"]  # FedDST: 2·O_s, no gradients uploaded
    ctx = round_one(config, env, 0, config.method.adjust_every)
    fedtiny = table_method(config, env, "fedtiny", 0.8)
    xi = sum(fedtiny.plan(ctx, fedtiny.init_state()).options.counts.values())
    assert tiny["bytes_up"] - tiny["param_bytes"] == 8 * xi  # FedTiny's top-ξ values and int32 positions
    assert tiny["train_flops"] == dst["train_flops"] and mef["train_flops"] > tiny["train_flops"]  # F_o
    assert mef["activation_bytes"] < tiny["activation_bytes"] / 4 and mef["peak_bytes"] < tiny["peak_bytes"]
    assert rows["flpqsu"]["param_bytes"] < dense["param_bytes"] * 0.3
