"""Every registered method runs 2 rounds on digits with 4 clients, on the CNN and on PreResNet-20,
and every method that fits clients to their budgets keeps every client-round within it."""

import pytest

from hfl.registry import METHODS
from hfl.server import run_experiment
from tests.conftest import small_config

TRAINS_THE_FULL_MODEL_REGARDLESS = {"fedavg", "fedprox"}
NEEDS_A_SERVER_SPLIT = {"feddf"}
SHORTER = {"feddf": {"distill_steps": 5}}  # seconds matter here; the method's own tests cover its defaults


@pytest.mark.parametrize("model", ["cnn", "preresnet20"])
@pytest.mark.parametrize("method", METHODS.names())
def test_every_method_runs_two_rounds(tmp_path, method, model):
    data = {"server_fraction": 0.1} if method in NEEDS_A_SERVER_SPLIT else {}
    config = small_config(method={"name": method, **SHORTER.get(method, {})}, model={"name": model}, budgets={"scenario": "fair"}, data=data,
                          fl={"rounds": 2, "clients": 4, "fraction": 1.0})
    summary = run_experiment(config, tmp_path)
    assert summary["rounds"] == 2 and 0 <= summary["final_accuracy"] <= 1
    assert summary["client_rounds"] + summary["skipped_client_rounds"] == 8
    assert summary["client_rounds"] > 0
    if method not in TRAINS_THE_FULL_MODEL_REGARDLESS:
        assert summary["budget_violations"] == 0
