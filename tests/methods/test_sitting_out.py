"""A client whose budget no sub-model fits sits the round out, and the run records it: the README's
claim, for the width methods derived from HeteroFL, which trained their smallest width over budget
before the Method API refactor."""

import pytest
import torch

from hfl.accounting.amounts import ClientBudget
from hfl.loggers import read_metrics
from hfl.methods.base import MethodState
from hfl.server import run_experiment
from hfl.types import RoundContext, TrainSettings
from tests.conftest import level_cost, method_for, small_config

WIDTH_METHODS = {  # name: extra method fields, extra data fields
    "heterofl": ({}, {}),
    "fedrolex": ({}, {}),
    "feddf": ({"distill_steps": 2}, {"server_fraction": 0.1}),
    "decoupled": ({}, {}),
}
SETTINGS = TrainSettings(0.05, 0.9, 0.0, 1, 16)


def context(client: int, budget_bytes: int) -> RoundContext:
    return RoundContext(1, client, 0, 200, SETTINGS, ClientBudget("t", budget_bytes, None, None))


@pytest.mark.parametrize("name", list(WIDTH_METHODS))
def test_one_byte_below_the_smallest_level_plans_nothing(name):
    fields, _ = WIDTH_METHODS[name]
    method = method_for({"name": name, **fields}, "cnn", unlabelled_x=torch.zeros(4, 1, 8, 8))
    smallest = method.ladder.levels[0].name
    cost = level_cost(method, smallest, 16, num_samples=200)
    assert method.plan(context(0, cost), MethodState()).level == smallest
    assert method.plan(context(0, cost - 1), MethodState()) is None


@pytest.mark.parametrize("name", list(WIDTH_METHODS))
def test_a_run_records_the_client_that_sits_out_and_keeps_every_budget(name, tmp_path):
    fields, data = WIDTH_METHODS[name]
    # Client 0's 1000 bytes fit no width; client 1's gibibyte fits the whole model.
    config = small_config(method={"name": name, **fields}, data=data, fl={"rounds": 1, "clients": 2, "fraction": 1.0},
                          budgets={"scenario": "per_client", "memory": ["1000", "1GiB"]})
    summary = run_experiment(config, tmp_path)
    [record] = read_metrics(tmp_path)
    assert record["skipped_clients"] == [{"id": 0, "reason": "no sub-model of the method fits the budget"}]
    assert [c["id"] for c in record["clients"]] == [1]
    assert summary["skipped_client_rounds"] == 1 and summary["client_rounds"] == 1
    assert summary["budget_violations"] == 0
