"""Every registered method runs 2 rounds on digits with 4 clients, on the CNN and on PreResNet-20."""

import pytest

from hfl.registry import METHODS
from hfl.server import run_experiment
from tests.conftest import small_config


@pytest.mark.parametrize("model", ["cnn", "preresnet20"])
@pytest.mark.parametrize("method", METHODS.names())
def test_every_method_runs_two_rounds(tmp_path, method, model):
    config = small_config(method={"name": method}, model={"name": model}, budgets={"scenario": "fair"},
                          fl={"rounds": 2, "clients": 4, "fraction": 1.0})
    summary = run_experiment(config, tmp_path)
    assert summary["rounds"] == 2 and 0 <= summary["final_accuracy"] <= 1
    assert summary["client_rounds"] == 8
