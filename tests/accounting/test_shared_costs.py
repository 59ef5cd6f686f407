"""Experiments of one process that build the same models share their measured costs (a sweep's
trials, a resumed run, the golden runs); experiments whose models differ do not."""

import dataclasses

import pytest

import hfl.accounting.accountant as accountant_module
from hfl.experiment import ClientEnvironment
from hfl.loggers import read_metrics
from hfl.server import run_experiment
from tests.conftest import small_config

FAIR = {"scenario": "fair"}


@pytest.fixture
def measured(fresh_process, monkeypatch):
    """The models measured from here on, in a process that has measured nothing yet (and finds
    nothing another process measured)."""
    monkeypatch.delenv("HFL_COST_STORE", raising=False)
    return fresh_process[1]


def heterofl(**fl):
    return small_config(method={"name": "heterofl"}, budgets=FAIR, fl={"rounds": 1, "clients": 4, "fraction": 1.0, **fl})


def test_a_run_differing_only_in_seed_rounds_and_learning_rate_measures_nothing_again(measured, tmp_path):
    run_experiment(heterofl(), tmp_path / "first")
    count = len(measured)
    assert count > 4  # the fair budgets' four widths and the clients' sub-models
    run_experiment(dataclasses.replace(heterofl(rounds=2, lr=0.01, lr_schedule="cosine"), seed=1), tmp_path / "again")
    assert len(measured) == count
    first, again = ({c["tier"]: c["estimated_peak_bytes"] for r in read_metrics(tmp_path / run) for c in r["clients"]} for run in ("first", "again"))
    assert {t: again[t] for t in first if t in again} == {t: first[t] for t in again if t in first} != {}


def test_a_method_shares_the_plain_models_budgets_measure_and_measures_its_own(measured):
    ClientEnvironment.from_config(heterofl())
    budgets = len(measured)
    assert budgets == 4  # the fair scenario's four widths, each trained plain
    ClientEnvironment.from_config(dataclasses.replace(heterofl(), method=small_config(method={"name": "fedrolex"}).method))
    assert len(measured) == budgets
    ClientEnvironment.from_config(small_config(method={"name": "heterofl"}, budgets=FAIR, model={"name": "cnn", "width": 0.5}))
    assert len(measured) == 2 * budgets  # another model: every width measured again


@pytest.mark.parametrize("changed", [{"fl": {"batch_size": 16}}, {"fl": {"optimizer": "adam"}}, {"model": {"name": "cnn", "norm": "none"}}])
def test_settings_that_change_what_is_trained_are_measured_again(measured, changed):
    ClientEnvironment.from_config(heterofl())
    count = len(measured)
    ClientEnvironment.from_config(small_config(method={"name": "heterofl"}, budgets=FAIR, **changed))
    assert len(measured) == 2 * count


def test_the_process_keeps_the_latest_measurements(measured, monkeypatch):
    monkeypatch.setattr(accountant_module, "SHARED_COSTS_KEPT", 2)
    env = ClientEnvironment.from_config(heterofl())  # measures the fair scenario's four widths, keeps the last two
    assert len(accountant_module._shared_costs) == 2
    count = len(measured)
    kept = [key[-4][1] for key in accountant_module._shared_costs]  # (..., ("plain", width), batch, flops, dtype)
    for width in kept:
        env.accountant.plain_cost(width, 32)
    assert len(measured) == count
    env.accountant.plain_cost(next(w for w in (1 / 6, 1 / 3, 1 / 2, 1.0) if w not in kept), 32)
    assert len(measured) == count + 1


def test_a_method_setting_that_changes_the_client_model_is_measured_again(measured, tmp_path):
    """FedMef's activation sparsity changes what a client's model saves, not the sub-model's shape:
    the method's own keys are shared only between equal method settings."""
    peaks = {}
    for sparsity in (0.0, 0.9):
        config = small_config(method={"name": "fedmef", "activation_sparsity": sparsity}, fl={"rounds": 1, "clients": 2, "fraction": 1.0})
        count = len(measured)
        run_experiment(config, tmp_path / str(sparsity))
        assert len(measured) > count
        peaks[sparsity] = {c["estimated_peak_bytes"] for c in read_metrics(tmp_path / str(sparsity))[0]["clients"]}
    assert max(peaks[0.9]) < min(peaks[0.0])
