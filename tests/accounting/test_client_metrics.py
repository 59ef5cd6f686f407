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
@pytest.mark.parametrize(("model", "batch", "precision"), [("preresnet20", 32, "32-true"), ("preresnet20", 128, "32-true"),
                                                        ("resnet18", 32, "32-true"), ("vit", 128, "32-true"),
                                                        ("preresnet20", 128, "bf16-mixed"), ("resnet18", 32, "bf16-mixed"),
                                                        ("vit", 128, "bf16-mixed")])
def test_estimate_within_five_percent_of_cuda_measurement(tmp_path, model, batch, precision):
    # cuDNN off: its workspace is no tensor the estimate could count (budgeted clients cap it instead).
    config = small_config(data={"name": "synthetic", "partition": "iid"}, model={"name": model}, backend={"device": "cuda", "cudnn": "off"},
                          fl={"rounds": 1, "clients": 4, "fraction": 0.5, "batch_size": batch, "weight_decay": 5e-4, "precision": precision})
    run_experiment(config, tmp_path)
    for client in read_metrics(tmp_path)[0]["clients"]:
        ratio = client["estimated_peak_bytes"] / client["measured_peak_bytes"]
        assert 0.95 <= ratio <= 1.05, f"estimate/measured = {ratio:.3f}"


def live_tensor_peak(env, state, task) -> int:
    """Peak bytes of the tensors a real client-round holds on the CPU: what it creates (a live-storage
    tracker) plus its model's resident weights."""
    from hfl.accounting.memory import LiveStorageTracker

    model = env.model(task.spec)
    resident = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    with LiveStorageTracker() as tracker:
        env.train(state, task)
    return tracker.peak_bytes + resident


@pytest.mark.slow
@pytest.mark.parametrize(("case", "batch", "precision"), [("whole", 4, "32-true"), ("frozen prefix", 4, "32-true"), ("fedepth stages", 8, "32-true"),
                                                       ("whole", 16, "bf16-mixed"), ("fedepth stages", 8, "bf16-mixed")])
def test_estimate_matches_what_a_cpu_client_round_holds(case, batch, precision):
    """The estimate against the real client path (data batches, the client module, the optimiser,
    stage after stage): within 1 % of the tensors it holds at its peak. ResNet-18 at small batches,
    where weights dominate: the optimiser's temporaries and every stage's gradients matter."""
    import dataclasses

    from hfl.backends.base import ClientEnvironment
    from hfl.server import initial_state, train_settings
    from hfl.submodel.spec import freeze
    from hfl.types import RoundContext

    fedepth = case == "fedepth stages"
    config = small_config(data={"name": "synthetic", "partition": "iid"}, model={"name": "resnet18", "width": 0.5},
                          method={"name": "fedepth" if fedepth else "fedavg"}, budgets={"scenario": "fair" if fedepth else "none"},
                          fl={"clients": 32, "batch_size": batch, "weight_decay": 5e-4, "precision": precision})
    env = ClientEnvironment.from_config(config)
    state = initial_state(config, env).global_state
    settings = train_settings(config.fl, 1)
    tasks = [env.method.plan(RoundContext(1, c, config.seed, len(env.partitions[c]), settings, env.budgets[c]), {}) for c in range(8)]
    if fedepth:
        task = max((t for t in tasks if t is not None), key=lambda t: len(t.options.groups))
        assert len(task.options.groups) >= 2
    else:
        task = tasks[0]
    if case == "frozen prefix":
        model = env.method.model
        prefix = {id(t) for m in (model.stem, *list(model.body)[:4]) for t in (*m.parameters(), *m.buffers())}
        names = [k for k, t in model.state_dict(keep_vars=True).items() if id(t) in prefix]
        task = dataclasses.replace(task, spec=freeze(task.spec, names))
    estimated = env.cost_metrics(task)["estimated_peak_bytes"]
    assert 0.99 <= estimated / live_tensor_peak(env, state, task) <= 1.01
