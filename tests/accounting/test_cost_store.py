"""Processes of one session share measured training costs through HFL_COST_STORE: a process that
finds a measurement there makes none and plans with the same numbers; another torch or hfl source,
or a key that is not plain values, measures afresh."""

import torch

from hfl.accounting import cost_store
from hfl.experiment import ClientEnvironment
from hfl.loggers import read_metrics
from hfl.server import run_experiment
from tests.conftest import small_config

CONFIG = {"method": {"name": "heterofl"}, "budgets": {"scenario": "fair"}, "fl": {"rounds": 1, "clients": 4, "fraction": 1.0}}


def estimates(out):
    return [(c["id"], c["estimated_peak_bytes"], c["flops"]) for r in read_metrics(out) for c in r["clients"]]


def test_a_process_finds_what_another_measured_and_plans_with_the_same_numbers(fresh_process, monkeypatch, tmp_path):
    start, calls = fresh_process
    monkeypatch.delenv("HFL_COST_STORE", raising=False)
    run_experiment(small_config(**CONFIG), tmp_path / "alone")
    alone = len(calls)
    assert alone > 4  # the fair budgets' widths and the clients' sub-models

    monkeypatch.setenv("HFL_COST_STORE", str(tmp_path / "store"))
    start()
    run_experiment(small_config(**CONFIG), tmp_path / "first")
    assert len(calls) == alone and len(list((tmp_path / "store").glob("*.json"))) == alone
    start()  # another process of the session
    run_experiment(small_config(**CONFIG), tmp_path / "second")
    assert calls == []
    assert estimates(tmp_path / "second") == estimates(tmp_path / "first") == estimates(tmp_path / "alone")


def test_another_torch_or_hfl_source_measures_again(fresh_process, monkeypatch, tmp_path):
    start, calls = fresh_process
    monkeypatch.setenv("HFL_COST_STORE", str(tmp_path / "store"))
    ClientEnvironment.from_config(small_config(**CONFIG))
    measured = len(calls)
    start()
    monkeypatch.setattr(cost_store, "code_digest", lambda: "an edited hfl")
    ClientEnvironment.from_config(small_config(**CONFIG))
    assert len(calls) == measured > 0


def test_only_plain_keys_are_filed_and_their_text_is_the_same_in_every_process():
    assert cost_store.plain_text(("a", 1, 0.5, None, torch.float32, frozenset({"y", "x"}))) == "('a',1,0.5,None,torch.float32,{'x','y'})"
    assert cost_store.plain_text(frozenset({"x", "y"})) == cost_store.plain_text(frozenset({"y", "x"}))
    assert len({cost_store.plain_text(v) for v in (1, 1.0, True, "1")}) == 4
    assert cost_store.plain_text(("masks", torch.ones(3))) is None  # a tensor's repr can elide its values
    assert cost_store.plain_text(object()) is None


def test_a_key_that_is_not_plain_is_measured_and_not_filed(monkeypatch, tmp_path):
    monkeypatch.setenv("HFL_COST_STORE", str(tmp_path))
    calls = []
    cost_store.stored_cost(("sap", torch.ones(2)), lambda: calls.append(1))
    cost_store.stored_cost(("sap", torch.ones(2)), lambda: calls.append(1))
    assert calls == [1, 1] and not list(tmp_path.iterdir())
