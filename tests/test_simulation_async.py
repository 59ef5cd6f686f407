"""The async policy (FedBuff, hfl.simulation.fedbuff): staleness-weighted updates by hand in float64,
a sub-model's partial update, the event order, refusals, and resume after SIGKILL."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, cli_env, small_config
from hfl.simulation.devices import Device
from hfl.simulation.fedbuff import FedBuffRounds, delta, stale_update
from hfl.submodel.aggregate import masked_weighted_mean
from hfl.submodel.spec import SubmodelSpec, full_spec
from hfl.types import ClientTask, ClientUpdate, RoundContext, TrainSettings

HALF = SubmodelSpec(width=0.5, indices={"w": {0: torch.tensor([0, 1])}})
"""A sub-model holding the first two of w's four entries."""


def update(client, state, weight, spec=full_spec(), **metrics):
    return ClientUpdate(client, state, weight, spec, {"id": client, **metrics})


def test_fedbuff_by_hand_in_float64_with_a_sub_models_partial_update():
    # Prepare: both clients started from g0 = [1, 2, 3, 4]; A (weight 2, the whole model) trained to
    # [2, 2, 2, 2]: change [1, 0, -1, -2], staleness 1; B (weight 1, entries 0 and 1) trained to
    # [3, 5]: change [2, 3], staleness 3. The global model has meanwhile moved to [10, 20, 30, 40].
    g0 = {"w": torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)}
    a = delta(update(0, {"w": torch.full((4,), 2.0, dtype=torch.float64)}, 2.0), g0)
    b = delta(update(1, {"w": torch.tensor([3.0, 5.0], dtype=torch.float64)}, 1.0, HALF), {"w": g0["w"][:2]})
    now = {"w": torch.tensor([10.0, 20.0, 30.0, 40.0], dtype=torch.float64)}
    # Execute
    new = masked_weighted_mean(now, [stale_update(a, now, 1), stale_update(b, now, 3)])
    # Assert: entry e moves by sum_i w_i d_i / sqrt(1 + s_i) / sum_i w_i over the clients holding e
    r2 = math.sqrt(2)
    expected = [10 + (2 * 1 / r2 + 1 * 2 / 2) / 3, 20 + (2 * 0 / r2 + 1 * 3 / 2) / 3, 30 + 2 * -1 / r2 / 2, 40 + 2 * -2 / r2 / 2]
    assert new["w"].tolist() == pytest.approx(expected, rel=0, abs=1e-12)
    # no staleness: the method's own mean of the trained weights
    fresh = masked_weighted_mean(g0, [stale_update(a, g0, 0), stale_update(b, g0, 0)])
    assert fresh["w"].tolist() == pytest.approx([(2 * 2 + 3) / 3, (2 * 2 + 5) / 3, 2, 2], abs=1e-12)


def fake_rounds(durations, concurrency, buffer):
    """FedBuffRounds over devices of 1 FLOP/s whose clients' rounds count `durations` FLOPs and no
    bytes; each trained state is what it received plus one."""
    config = small_config(fl={"clients": len(durations), "round_policy": "async", "async_concurrency": concurrency, "async_buffer": buffer},
                          devices={"source": "tiers", "speed": ["1"], "down": ["1"], "up": ["1"]})
    rounds = FedBuffRounds(config, [Device(1.0, 1.0, 1.0)] * len(durations))
    settings = TrainSettings(0.1, 0.0, 0.0, 1, 32)

    def plan(client):
        return ClientTask(RoundContext(rounds.version + 1, client, 0, 1, settings), full_spec())

    def train(global_state, tasks):
        return [update(t.ctx.client_id, {"w": global_state["w"] + 1}, 1.0, flops=durations[t.ctx.client_id], bytes_down=0, bytes_up=0,
                       num_samples=1) for t in tasks], []

    return rounds, plan, train


def test_fedbuff_event_order_staleness_and_state_by_hand():
    # Prepare: three clients of 1, 3 and 2 simulated seconds, all training at once, a server step per
    # arrival. By hand: t=1 client 0 (from v0, s=0); it restarts from v1 and arrives at 2 together
    # with client 2 (from v0): client 0 first (lower id, s=0), then client 2 (s=2); client 0 restarts
    # at 2 from v2 and arrives at 3 with client 1 (from v0): client 0 (s=1), then client 1 (s=4).
    rounds, plan, train = fake_rounds([1.0, 3.0, 2.0], concurrency=3, buffer=1)
    state = {"w": torch.zeros(1, dtype=torch.float64)}
    seen = []
    for _ in range(5):
        arrivals, ended, fields, _, _ = rounds.step(state, plan, train)
        state = masked_weighted_mean(state, arrivals)
        seen.append((ended[0].client_id, fields["staleness"], fields["sim_end_s"]))
    assert seen == [(0, [0], 1.0), (0, [0], 2.0), (2, [2], 2.0), (0, [1], 3.0), (1, [4], 3.0)]
    assert state["w"].item() == pytest.approx(1 + 1 + 1 / math.sqrt(3) + 1 / math.sqrt(2) + 1 / math.sqrt(5), abs=1e-12)


def test_async_refuses_methods_whose_server_step_cannot_be_stale_in_one_line(tmp_path, capsys):
    from hfl.cli import main

    code = main(["run", "experiments/quickstart.yaml", "method.name=feddf", "data.server_fraction=0.1", "fl.rounds=1", "fl.clients=3",
                 "devices.source=tiers", "devices.speed=[1e9]", "devices.down=[1MB]", "devices.up=[1MB]", "fl.round_policy=async",
                 "backend.device=cpu", "--out", str(tmp_path / "run")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "fl.round_policy='async'" in lines[-1] and "method feddf" in lines[-1] and "FedDF.aggregate" in lines[-1]


KILL_AFTER_ROUND_3 = """
import os, signal, sys
from hfl.config import load_config
from hfl.server import run_experiment

class Kill:
    def on_round(self, record):
        if record["round"] == 3:
            os.kill(os.getpid(), signal.SIGKILL)
    def on_end(self, summary):
        pass

run_experiment(load_config(sys.argv[1], sys.argv[3:]), sys.argv[2], callbacks=[Kill()])
"""


@pytest.mark.slow
def test_async_resumed_after_sigkill_equals_the_uninterrupted_run_event_queue_included(tmp_path):
    from hfl.loggers import read_metrics
    from hfl.server import run_experiment
    from tests.test_simulation import drop_wall

    overrides = ["fl.rounds=5", "fl.clients=8", "fl.local_epochs=1", "backend.device=cpu", "devices.source=trace", "devices.trace=synthetic",
                 "method.name=heterofl", "budgets.scenario=fair", "fl.round_policy=async", "fl.async_concurrency=4", "fl.async_buffer=2"]
    from hfl.config import load_config

    config = load_config(ROOT / "experiments/quickstart.yaml", overrides)
    run_experiment(config, tmp_path / "full")
    killed = subprocess.run([sys.executable, "-c", KILL_AFTER_ROUND_3, str(ROOT / "experiments/quickstart.yaml"), str(tmp_path / "killed"), *overrides],
                            cwd=ROOT, env=cli_env(), capture_output=True)
    assert killed.returncode == -9 and len(read_metrics(tmp_path / "killed")) == 3
    checkpoint = torch.load(tmp_path / "killed" / "checkpoint.pt", weights_only=False)
    assert checkpoint["simulation"]["in_flight"]  # clients were training when it died
    run_experiment(config, tmp_path / "killed", resume=True)
    full, resumed = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "killed")
    assert drop_wall(resumed) == drop_wall(full)
    assert max(s for r in full for s in r["staleness"]) > 0
    a = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=False)["global_state"]
    b = torch.load(tmp_path / "killed" / "checkpoint.pt", weights_only=False)["global_state"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_async_on_ray_equals_async_locally(tmp_path):
    """The clock reads only the recorded counts, so the timeline, the arrivals and the numbers agree."""
    import ray

    from hfl.loggers import read_metrics
    from hfl.server import run_experiment

    fl = {"rounds": 3, "clients": 6, "round_policy": "async", "async_concurrency": 3, "async_buffer": 2}
    devices = {"source": "tiers", "speed": ["1e9"], "down": ["1MB"], "up": ["5e5"], "spread": 1.0}
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        run_experiment(small_config(fl=fl, devices=devices), tmp_path / "local")
        run_experiment(small_config(fl=fl, devices=devices, backend={"name": "ray", "device": "cpu"}), tmp_path / "ray")
    finally:
        if started:
            ray.shutdown()
    from tests.test_simulation import drop_wall

    local = drop_wall(read_metrics(tmp_path / "local"))
    remote = [r | {"clients": [{k: v for k, v in c.items() if not k.startswith("ray_")} for c in r["clients"]]} for r in drop_wall(read_metrics(tmp_path / "ray"))]
    assert remote == local and any(s for r in local for s in r["staleness"])


def test_a_step_in_which_every_online_client_sits_out_ends_instead_of_waiting_forever():
    rounds, _, train = fake_rounds([1.0, 2.0], concurrency=2, buffer=1)
    arrivals, ended, fields, skipped, _ = rounds.step({"w": torch.zeros(1)}, lambda client: None, train)
    assert (arrivals, ended, fields["staleness"], rounds.version) == ([], [], [], 1)
    assert sorted(s["id"] for s in skipped) == [0, 1]
