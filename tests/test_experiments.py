"""The experiment configs in experiments/ load, and the ScaleFL comparison runs in its reduced form."""

from pathlib import Path

import pytest

from hfl.config import load_config
from hfl.server import run_experiment
from tests.conftest import ROOT

EXPERIMENTS = sorted((ROOT / "experiments").rglob("*.yaml"))
COMPARISON = sorted((ROOT / "experiments" / "scalefl_cifar10").glob("*.yaml"))
# What compare.sh's reduced digits variant sets, cut to 2 rounds for CI.
REDUCED = ["data.name=digits", "model.name=preresnet20", "fl.clients=8", "fl.fraction=0.5", "fl.rounds=2",
           "fl.batch_size=16", "fl.local_epochs=1"]


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_experiment_config_loads(path: Path):
    load_config(path, [])


@pytest.mark.slow
@pytest.mark.parametrize("path", COMPARISON, ids=lambda p: p.stem)
def test_the_reduced_scalefl_comparison_runs_every_method_within_budget(tmp_path, path: Path):
    overrides = REDUCED + (["method.distill_steps=5"] if path.stem == "feddf" else [])
    summary = run_experiment(load_config(path, overrides), tmp_path)
    assert summary["budget_violations"] == 0 and summary["client_rounds"] > 0
    assert 0 <= summary["final_accuracy"] <= 1
