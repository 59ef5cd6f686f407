"""Every client-round reports its budget, estimated (and on CUDA measured) peak, FLOPs and bytes."""

import json

import pytest
import torch

from hfl.cli import main
from hfl.loggers import read_metrics
from hfl.server import run_experiment
from tests.conftest import QUICKSTART, small_config

FIELDS = {"tier", "budget_bytes", "estimated_peak_bytes", "measured_peak_bytes", "flops", "bytes_down", "bytes_up", "submodel"}


def test_client_entries_carry_accounting(tmp_path):
    summary = run_experiment(small_config(budgets={"scenario": "lack"}), tmp_path)
    clients = [c for r in read_metrics(tmp_path) for c in r["clients"]]
    for client in clients:
        assert FIELDS <= client.keys()
        assert client["estimated_peak_bytes"] > 0 and client["flops"] > 0 and client["budget_bytes"] > 0
        assert client["measured_peak_bytes"] is None  # no CUDA here
    assert summary["total_flops"] == sum(c["flops"] for c in clients)
    assert summary["total_bytes_up"] == sum(c["bytes_up"] for c in clients)
    assert sum(t["client_rounds"] for t in summary["tiers"].values()) == len(clients)


def test_budget_command_prints_tables_and_json(tmp_path, capsys):
    out = tmp_path / "budget.json"
    assert main(["budget", str(QUICKSTART), "model.name=preresnet20", "budgets.scenario=fair", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Training one block" in text and "x1/8" in text and "w1_6" in text
    report = json.loads(out.read_text())
    assert len(report["blocks"]) == 9 and [w["width"] for w in report["widths"]][-1] == "1"
    peaks = [w["peak_bytes"] for w in report["widths"]]
    assert peaks == sorted(peaks)
    assert sum(t["clients"] for t in report["tiers"]) == 20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", ["preresnet20", "resnet18"])
def test_estimate_within_ten_percent_of_cuda_measurement(tmp_path, model):
    config = small_config(model={"name": model}, backend={"device": "cuda"}, fl={"rounds": 1, "batch_size": 64})
    run_experiment(config, tmp_path)
    for client in read_metrics(tmp_path)[0]["clients"]:
        ratio = client["estimated_peak_bytes"] / client["measured_peak_bytes"]
        assert 0.9 <= ratio <= 1.1, f"estimate/measured = {ratio:.3f}"
