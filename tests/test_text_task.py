"""Shakespeare end to end on the fixture corpus with a tiny GPT: FedAvg trains and is scored per
token with perplexity; the width methods train their half-width sub-models; the default-objective
methods run a round."""

from __future__ import annotations

import json
import math

import pytest

from hfl.cli import main
from hfl.loggers import read_metrics
from hfl.server import run_experiment
from tests.conftest import QUICKSTART
from tests.data.test_tokens import SEQ, text_config

TEXT = ["data.name=shakespeare", "data.partition=natural", f"data.seq_len={SEQ}", "model.name=gpt", "model.depth=1", "model.width=0.5",
        "fl.clients=6", "fl.fraction=0.5", "fl.batch_size=16", "fl.local_epochs=1"]


def test_fedavg_runs_two_rounds_and_logs_token_accuracy_and_perplexity(tmp_path, capsys):
    config = text_config(tmp_path)  # writes the corpus
    out = tmp_path / "run"
    paths = [f"data.root={config.data.root}", f"data.cache_dir={config.data.cache_dir}"]
    assert main(["run", str(QUICKSTART), *TEXT, *paths, "fl.rounds=2", "--out", str(out)]) == 0
    records = read_metrics(out)
    assert [r["round"] for r in records] == [1, 2]
    for r in records:
        assert 0 < r["accuracy"] < 1 and r["perplexity"] == pytest.approx(math.exp(r["loss"]))
        assert all(c["flops"] > 0 and c["estimated_peak_bytes"] > 0 for c in r["clients"])
    assert records[-1]["loss"] < math.log(81)  # better than uniform over LEAF's 81 characters
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_perplexity"] == records[-1]["perplexity"]
    assert "ppl=" in capsys.readouterr().err


@pytest.mark.parametrize(("method", "extra"), [("heterofl", {"masked_ce": True}), ("fjord", {})])
def test_width_methods_train_half_width_gpts(tmp_path, method, extra):
    budgets = {"scenario": "tiers", "memory": ["width:1/2"]}  # every client can afford the half-width model, no more
    config = text_config(tmp_path, method={"name": method, **extra}, model={"width": 1.0}, budgets=budgets, fl={"rounds": 1, "fraction": 0.5})
    summary = run_experiment(config, tmp_path / "run")
    (record,) = read_metrics(tmp_path / "run")
    assert record["clients"] and all(c["estimated_peak_bytes"] <= c["budget_bytes"] for c in record["clients"])
    assert {c["submodel"]["width"] for c in record["clients"]} == {0.5}
    assert 0 < record["accuracy"] < 1 and record["perplexity"] > 1 and summary["submodel_accuracy"]


@pytest.mark.parametrize(("method", "scenario"), [("fedprox", "none"), ("fedrolex", "fair"), ("fedepth", "fair")])
def test_default_objective_methods_run_a_round(tmp_path, method, scenario):
    """FedProx trains the whole model whatever the budget; the others fit theirs."""
    config = text_config(tmp_path, method={"name": method}, budgets={"scenario": scenario}, fl={"rounds": 1})
    summary = run_experiment(config, tmp_path / "run")
    assert summary["client_rounds"] > 0 and summary["budget_violations"] == 0 and summary["final_perplexity"] > 1
