"""Simulated time: devices, the virtual clock, the sync / deadline / overselect policies, availability
and the errors of bad device input (hfl.simulation, docs/time.md)."""

from __future__ import annotations

import json
from pathlib import Path
import math

import numpy as np
import pytest

from conftest import small_config
from hfl.cli import main
from hfl.errors import ConfigError
from hfl.simulation.clock import available, client_time, sample_available, time_round
from hfl.simulation.devices import SYNTHETIC_TRACE, Device, assign_devices, read_trace, synthetic_trace

ALWAYS = (Device(1e9, 1e6, 5e5), Device(4e9, 4e6, 1e6), Device(None, 2e6, 2e6, seconds_per_sample=0.01))
"""Three devices: 1 GFLOP/s with 1 MB/s down and 0.5 MB/s up; 4 GFLOP/s, 4 MB/s, 1 MB/s; one
timed per sample (10 ms) with 2 MB/s both ways."""
COUNTS = ({"id": 0, "flops": 2e9, "bytes_down": 1e6, "bytes_up": 1e6, "num_samples": 50},
          {"id": 1, "flops": 2e9, "bytes_down": 2e6, "bytes_up": 1e6, "num_samples": 50},
          {"id": 2, "flops": 9e9, "bytes_down": 1e6, "bytes_up": 1e6, "num_samples": 100})
"""The three client-rounds' counts; client 2 trains 100 samples for 2 local epochs."""


def three_times(start=10.0, devices=ALWAYS):
    return [client_time(devices[m["id"]], m, start, local_epochs=2) for m in COUNTS]


def test_a_hand_computed_round_gives_each_client_its_seconds_and_each_policy_its_clients():
    # Prepare: by hand, client 0: 1e6/1e6 + 2e9/1e9 + 1e6/5e5 = 1 + 2 + 2 = 5 s (finishes at 15);
    # client 1: 2e6/4e6 + 2e9/4e9 + 1e6/1e6 = 0.5 + 0.5 + 1 = 2 s (12); client 2, per sample:
    # 1e6/2e6 + 0.01 * 100 * 2 + 1e6/2e6 = 0.5 + 2 + 0.5 = 3 s (13; its FLOPs play no part).
    times = three_times()
    # Assert: the printed times
    assert [(t.down_s, t.compute_s, t.up_s, t.finish) for t in times] == [(1, 2, 2, 15), (0.5, 0.5, 1, 12), (0.5, 2, 0.5, 13)]
    sync = time_round("sync", 10.0, times, ALWAYS)
    assert (sync.kept, sync.dropped, sync.end) == ((1, 2, 0), {}, 15)
    # deadline 4 s: client 0 (15 > 14) is the straggler, dropped at the deadline, which ends the round
    deadline = time_round("deadline", 10.0, times, ALWAYS, deadline_s=4.0)
    assert (deadline.kept, deadline.dropped, deadline.end) == ((1, 2), {0: ("deadline", 14.0)}, 14.0)
    # a deadline everybody meets ends the round with its last client
    assert time_round("deadline", 10.0, times, ALWAYS, deadline_s=6.0).end == 15
    # overselect, first 2 of 3: clients 1 and 2; the round ends when the second finishes (13)
    first = time_round("overselect", 10.0, times, ALWAYS, keep=2)
    assert (first.kept, first.dropped, first.end) == ((1, 2), {0: ("late", 13.0)}, 13.0)
    assert time_round("overselect", 10.0, times, ALWAYS, keep=1).kept == (1,)


def test_a_device_leaving_mid_round_drops_its_client_at_that_moment():
    # client 2's device is online until 12.5, but its round would end at 13
    leaving = (*ALWAYS[:2], Device(None, 2e6, 2e6, seconds_per_sample=0.01, online=((0.0, 12.5),)))
    timing = time_round("sync", 10.0, three_times(devices=leaving), leaving)
    assert (timing.kept, timing.dropped, timing.end) == ((1, 0), {2: ("offline", 12.5)}, 15)
    # under a deadline of 2 s (12) it would have been a straggler before it left: dropped at the deadline
    assert time_round("deadline", 10.0, three_times(devices=leaving), leaving, deadline_s=2.0).dropped == {0: ("deadline", 12.0), 2: ("deadline", 12.0)}


def test_an_offline_device_is_never_selected():
    devices = [Device(1e9, 1e6, 1e6, online=((0, 5), (20, 30))) if c % 2 else Device(1e9, 1e6, 1e6) for c in range(10)]
    assert available(devices, 10.0) == [0, 2, 4, 6, 8]
    assert available(devices, 25.0) == list(range(10))
    for seed in range(50):
        assert set(sample_available(np.random.default_rng(seed), 10, available(devices, 10.0), 4)) <= {0, 2, 4, 6, 8}
    # every client online: the draw is the cohort sampler's own, so devices change no cohort
    assert sample_available(np.random.default_rng(3), 10, list(range(10)), 4) == sorted(np.random.default_rng(3).choice(10, 4, replace=False).tolist())


def test_online_intervals_repeat_with_the_period_and_run_on_across_its_boundary():
    device = Device(1e9, 1e6, 1e6, online=((0, 10), (50, 100)), period=100)
    assert device.online_until(5) == 10
    assert device.online_until(20) is None
    assert device.online_until(160) == 210  # 50-100 runs on into the next period's 0-10
    assert device.next_online(20) == 50
    assert device.next_online(120) == 150
    assert Device(1e9, 1e6, 1e6, online=((0, 10),)).next_online(11) is None
    assert Device(1e9, 1e6, 1e6).online_until(1e12) == math.inf
    # online the whole period (a trace's device that never went offline that day): never leaves
    assert Device(1e9, 1e6, 1e6, online=((0, 100),), period=100).online_until(150) == math.inf


def test_the_shipped_synthetic_trace_is_its_stated_recipe():
    assert json.loads(SYNTHETIC_TRACE.read_text()) == synthetic_trace()
    devices = read_trace(SYNTHETIC_TRACE)
    assert len(devices) == 100
    online = [len(available(list(devices.values()), t)) for t in range(0, 86400, 3600)]
    assert 50 <= np.mean(online) <= 85  # about two thirds online at any time, as its recipe says



def test_availability_of_every_device_at_once_agrees_with_each_devices_own_intervals():
    """The vectorised test the clocks use (10,000 clients) against Device.online_until, device by device:
    the shipped trace (periodic), intervals without a period, one running across the period's end, always online."""
    from hfl.simulation.clock import Availability

    devices = [*read_trace(SYNTHETIC_TRACE).values(), Device(1e9, 1e6, 1e6, online=((5, 10), (20, 30))),
               Device(1e9, 1e6, 1e6, online=((0, 10), (50, 100)), period=100), Device(1e9, 1e6, 1e6)]
    availability = Availability(devices)
    for t in [0.0, 5.0, 9.999, 10.0, 29.0, 30.0, 100.0, 150.5, *np.linspace(0, 3 * 86400, 97)]:
        assert availability.clients(t) == [c for c, d in enumerate(devices) if d.online_until(t) is not None]
    assert availability.next_online(31.0) == 31.0 and Availability(devices[100:101]).next_online(31.0) is None


def test_tier_devices_follow_budget_tiers_and_the_spread_is_seeded():
    tiers = {"scenario": "tiers", "memory": ["64MB", "1GB"], "names": ["small", "large"]}
    devices = {"source": "tiers", "speed": ["1e9", "4e9"], "down": ["1MB", "4MB"], "up": ["5e5", "1MB"]}
    config = small_config(budgets=tiers, devices=devices)
    from hfl.simulation.devices import client_tiers

    plain = assign_devices(config)
    assert [d.speed for d in plain] == [[1e9, 4e9][t] for t in client_tiers(config)]
    spread = assign_devices(small_config(budgets=tiers, devices={**devices, "spread": 0.5}))
    assert spread == assign_devices(small_config(budgets=tiers, devices={**devices, "spread": 0.5}))  # seeded
    assert len({d.speed for d in spread}) == len(spread)
    ratios = [s.down / p.down for s, p in zip(spread, plain)]
    assert ratios == pytest.approx([s.up / p.up for s, p in zip(spread, plain)])  # one factor for both bandwidths


def drop_wall(records):
    """Records without the host's timings (wall_seconds, each client's seconds)."""
    return [{k: v for k, v in r.items() if k != "wall_seconds"} | {"clients": [{k: v for k, v in c.items() if k != "seconds"} for c in r["clients"]]}
            for r in records]


def drop_time(records):
    """Records without any timing, simulated or measured."""
    return [{k: v for k, v in r.items() if not k.startswith("sim_") and k not in ("stragglers", "dropped_clients")}
            | {"clients": [{k: v for k, v in c.items() if not k.startswith("sim_")} for c in r["clients"]]} for r in drop_wall(records)]


def write_trace(path, devices, period=None):
    path.write_text(json.dumps({"devices": devices, **({"period": period} if period else {})}))
    return str(path)


def run_cli(tmp_path, capsys, *overrides):
    code = main(["run", "experiments/quickstart.yaml", "fl.rounds=1", "fl.clients=3", "backend.device=cpu", *overrides,
                 "--out", str(tmp_path / "run")])
    return code, capsys.readouterr().err.strip().splitlines()


def test_bad_device_input_exits_2_with_one_line_naming_field_value_and_allowed(tmp_path, capsys):
    good = [{"id": c, "speed": 1e9, "down": 1e6, "up": 1e6} for c in range(3)]
    trace = ["devices.source=trace", f"devices.trace={write_trace(tmp_path / 'unknown.json', [*good, {**good[0], 'id': 7}])}"]
    code, lines = run_cli(tmp_path, capsys, *trace)
    assert code == 2 and "devices.trace=" in lines[-1] and "[7]" in lines[-1] and "client ids 0..2" in lines[-1]
    negative = write_trace(tmp_path / "negative.json", [*good[:2], {**good[2], "speed": -5e8}])
    code, lines = run_cli(tmp_path, capsys, "devices.source=trace", f"devices.trace={negative}")
    assert code == 2 and "devices.trace speed=-500000000.0" in lines[-1] and "a positive number" in lines[-1] and "device id 2" in lines[-1]
    code, lines = run_cli(tmp_path, capsys, "devices.source=tiers", "devices.speed=[-1e9]", "devices.down=[1MB]", "devices.up=[1MB]")
    assert code == 2 and lines[-1].startswith("hfl: error: devices.speed='-1e9'") and "a positive amount" in lines[-1]
    # digits' CNN on a 1 GFLOP/s device with 1 MB/s: the fastest client takes about half a second
    code, lines = run_cli(tmp_path, capsys, "devices.source=tiers", "devices.speed=[1e9]", "devices.down=[1MB]", "devices.up=[1MB]",
                          "fl.round_policy=deadline", "fl.deadline_s=0.01")
    assert code == 2 and "fl.deadline_s=0.01" in lines[-1] and "a deadline some client can meet" in lines[-1]
    code, lines = run_cli(tmp_path, capsys, "fl.round_policy=deadline", "fl.deadline_s=1")
    assert code == 2 and "fl.round_policy='deadline'" in lines[-1] and "unless devices are set" in lines[-1]
    code, lines = run_cli(tmp_path, capsys, "fl.time_limit_s=60")
    assert code == 2 and "fl.time_limit_s=60" in lines[-1] and "unless devices are set" in lines[-1]
    code, lines = run_cli(tmp_path, capsys, "fl.time_limit_s=-1")
    assert code == 2 and "fl.time_limit_s=-1" in lines[-1] and "simulated seconds >= 0" in lines[-1]
    assert not (tmp_path / "run").exists()


def test_devices_under_sync_change_no_recorded_number_and_time_every_round(tmp_path):
    from hfl.loggers import read_metrics
    from hfl.server import run_experiment

    learns = {"lr": 0.1, "local_epochs": 3}  # accuracy changes every round (0.14, 0.48, 0.79 here)
    plain = run_experiment(small_config(fl=learns), tmp_path / "plain")
    devices = {"source": "tiers", "speed": ["1e9"], "down": ["1MB"], "up": ["5e5"], "spread": 0.5}
    timed = run_experiment(small_config(devices=devices, fl={**learns, "time_targets": [0.3, 0.99], "time_points": [0.05, 100.0]}), tmp_path / "timed")
    without, with_ = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "timed")
    assert drop_time(without) == drop_time(with_)
    assert not any(k.startswith("sim_") for r in without for k in r) and "simulated_seconds" not in plain
    # each round starts when the last ended, and lasts until its slowest client's upload arrives
    for before, record in zip([{"sim_end_s": 0.0}, *with_], with_):
        assert record["sim_start_s"] == before["sim_end_s"]
        assert record["sim_end_s"] == max(c["sim_finish_s"] for c in record["clients"])
        for c in record["clients"]:
            assert c["sim_compute_s"] > 0 and c["sim_comm_s"] == c["sim_down_s"] + c["sim_up_s"]
    assert timed["simulated_seconds"] == with_[-1]["sim_end_s"]
    reached = [r["sim_end_s"] for r in with_ if r["accuracy"] >= 0.3]
    assert timed["time_to_accuracy"] == {"0.3": reached[0] if reached else None, "0.99": None}
    by_one_second = [r["accuracy"] for r in with_ if r["sim_end_s"] <= 100.0]
    assert len(by_one_second) == 3 and with_[0]["sim_end_s"] > 0.05 and timed["accuracy_at_time"] == {"0.05": None, "100.0": by_one_second[-1]}


def test_a_deadline_aggregates_only_the_clients_in_time_and_counts_the_stragglers_work(tmp_path, monkeypatch):
    from hfl.loggers import read_metrics
    from hfl.methods.base import Method
    from hfl.server import run_experiment

    aggregated = []
    aggregate = Method.aggregate
    monkeypatch.setattr(Method, "aggregate", lambda self, g, updates, s: aggregated.append(sorted(u.client_id for u in updates)) or aggregate(self, g, updates, s))

    devices = {"source": "tiers", "speed": ["1e9"], "down": ["1MB"], "up": ["5e5"], "spread": 1.0}
    config = small_config(devices=devices, fl={"round_policy": "deadline", "deadline_s": 0.5, "rounds": 2, "clients": 10})
    summary = run_experiment(config, tmp_path / "run")
    records = read_metrics(tmp_path / "run")
    stragglers = [c for r in records for c in r["clients"] if c.get("dropped")]
    assert stragglers and all(c["dropped"] == "deadline" and c["sim_finish_s"] > c["dropped_at_s"] for c in stragglers)
    for r in records:
        assert r["stragglers"] == sorted(c["id"] for c in r["clients"] if c.get("dropped"))
        assert r["sim_end_s"] == r["sim_start_s"] + 0.5  # a straggler holds the round to its deadline
    assert aggregated == [sorted(c["id"] for c in r["clients"] if not c.get("dropped")) for r in records]
    assert summary["total_flops"] == sum(c["flops"] for r in records for c in r["clients"])  # stragglers' work is spent


def test_a_run_never_selects_an_offline_device_and_drops_one_that_leaves_mid_round(tmp_path):
    from hfl.loggers import read_metrics
    from hfl.server import run_experiment

    # clients 0-2 come online only at 1e6 s; client 3 leaves at 0.05 s, before any download of the CNN (78 kB at 1 MB/s) ends
    devices = [{"id": c, "speed": 1e9, "down": 1e6, "up": 1e6, "online": [[1e6, 2e6]] if c < 3 else [[0, 0.05]] if c == 3 else []} for c in range(6)]
    trace = write_trace(tmp_path / "trace.json", devices)
    run_experiment(small_config(fl={"rounds": 1, "fraction": 1.0}, devices={"source": "trace", "trace": trace}), tmp_path / "run")
    (record,) = read_metrics(tmp_path / "run")
    assert sorted(c["id"] for c in record["clients"]) == [3, 4, 5]
    assert record["dropped_clients"] == [{"id": 3, "reason": "offline", "at_s": 0.05}]
    assert record["sim_end_s"] == max(c["sim_finish_s"] for c in record["clients"] if c["id"] != 3)


@pytest.mark.slow
def test_overselect_keeps_the_first_to_finish_and_the_report_and_progress_show_simulated_time(tmp_path, capsys):
    from hfl.cli import RoundProgress
    from hfl.loggers import read_metrics
    from hfl.report import write_report
    from hfl.server import run_experiment

    devices = {"source": "tiers", "speed": ["1e9"], "down": ["1MB"], "up": ["5e5"], "spread": 1.0}
    config = small_config(fl={"rounds": 2, "clients": 10, "fraction": 0.3, "round_policy": "overselect", "overselect": 0.5, "time_targets": [0.1]},
                          devices=devices)
    run_experiment(config, tmp_path / "run")
    for record in read_metrics(tmp_path / "run"):
        finishes = sorted((c["sim_finish_s"], c["id"]) for c in record["clients"])
        assert len(finishes) == 5  # 3 clients, and half as many again, rounded up
        assert [c["id"] for c in record["clients"] if not c.get("dropped")] == sorted(i for _, i in finishes[:3])
        assert {c.get("dropped") for c in record["clients"] if c["id"] not in {i for _, i in finishes[:3]}} == {"late"}
        assert record["sim_end_s"] == finishes[2][0]
    RoundProgress(2, 0).on_round(record)
    assert f"sim={record['sim_end_s']:.1f}s" in capsys.readouterr().err
    report = write_report([str(tmp_path / "run")], tmp_path / "report").read_text()
    assert "| run | method | seeds | simulated s | time to 0.1 |" in report and (tmp_path / "report" / "accuracy_by_time.png").is_file()


def test_the_time_to_accuracy_comparison_runs_each_policy_and_method_once_per_seed_on_the_same_devices(tmp_path):
    from tests.conftest import ROOT
    from tests.test_compare_scripts import calls_of

    calls = calls_of(ROOT / "experiments" / "time_to_accuracy" / "compare.sh", tmp_path, "--seeds", "0,1,2", "fl.rounds=2")
    runs, report = calls[:-1], calls[-1]
    names = ["fedavg_sync", "fedavg_deadline", "heterofl", "fedepth", "depthfl", "fedbuff_fedavg", "fedbuff_heterofl"]
    assert [c[-1] for c in runs] == [str(tmp_path / "out" / f"{n}-seed{s}") for n in names for s in (0, 1, 2)]
    devices = {c for c in runs[0] if c.startswith(("devices.", "budgets."))}
    for call in runs:
        assert {c for c in call if c.startswith(("devices.", "budgets."))} == devices and "fl.rounds=2" in call
        name = Path(call[-1]).name.rsplit("-", 1)[0]
        policy = "async" if name.startswith("fedbuff") else "deadline" if name.endswith("deadline") else "sync"
        assert ("fl.round_policy=" + policy in call) == (policy != "sync")
        assert f"method.name={name.split('_')[-1] if name.startswith('fedbuff') else name.split('_')[0]}" in call
    assert report[0] == "report" and len(report[1:-2]) == 21
    (tmp_path / "trace").mkdir()
    on_trace = calls_of(ROOT / "experiments" / "time_to_accuracy" / "compare.sh", tmp_path / "trace", env={"TTA_DEVICES": "synthetic"})[:-1]
    assert len(on_trace) == 7 and all({c for c in call if c.startswith("devices.")} == {"devices.source=trace", "devices.trace=synthetic"}
                                      and "budgets.memory=[width:1/4,width:1/2,width:1]" in call for call in on_trace)


def test_hfl_budget_gives_each_tier_the_seconds_its_round_one_takes(tmp_path):
    from hfl.budget import budget_report
    from hfl.experiment import ClientEnvironment
    from hfl.loggers import read_metrics
    from hfl.server import run_experiment

    config = small_config(method={"name": "heterofl"}, fl={"rounds": 1, "fraction": 1.0},
                          budgets={"scenario": "tiers", "memory": ["width:1/4", "width:1"], "names": ["slow", "fast"]},
                          devices={"source": "tiers", "speed": ["1e8", "2e9"], "down": ["250kB", "4MB"], "up": ["100kB", "2MB"]})
    plans = budget_report(config, ClientEnvironment.from_config(config))["plans"]
    run_experiment(config, tmp_path / "run")
    recorded = {c["id"]: c for c in read_metrics(tmp_path / "run")[0]["clients"]}
    assert [p["tier"] for p in plans] == ["slow", "fast"] and plans[0]["round_s"] > plans[1]["round_s"]
    for plan in plans:
        client = recorded[plan["client"]]
        assert (plan["down_s"], plan["compute_s"]) == (client["sim_down_s"], client["sim_compute_s"])
        assert plan["up_s"] >= client["sim_up_s"]  # HeteroFL sends back only the classifier rows of the classes the client holds


def test_fedscale_traces_give_seconds_per_sample_bandwidth_and_availability_and_refuse_objects(tmp_path, capsys):
    import datetime
    import pickle

    from hfl.simulation.devices import read_fedscale

    # FedScale's units: inference ms per sample (training: 3x), kbit/s of 1024 bits; behaviour: active/inactive pairs, period finish_time
    capacity, behaviour = tmp_path / "client_device_capacity", tmp_path / "client_behave_trace"
    capacity.write_bytes(pickle.dumps({7: {"computation": 20.0, "communication": 800.0}, 3: {"computation": 100.0, "communication": 8000.0}}))
    behaviour.write_bytes(pickle.dumps({1: {"active": [0, 50], "inactive": [10, 100], "finish_time": 100, "duration": 60, "model": "x"}}))
    devices = read_fedscale(capacity, behaviour)
    # ids in order (3, 7) become devices 0 and 1; both take the one behaviour trace
    assert devices[0] == Device(None, 8000 * 128, 8000 * 128, 0.3, ((0, 10), (50, 100)), 100.0)
    assert devices[1].seconds_per_sample == pytest.approx(0.06) and devices[1].down == 800 * 128
    t = client_time(devices[1], {"id": 1, "flops": 1e9, "bytes_down": 102400, "bytes_up": 51200, "num_samples": 50}, 0.0, local_epochs=2)
    assert (t.down_s, t.compute_s, t.up_s) == (1.0, pytest.approx(6.0), 0.5)  # 100 kB at 100 kB/s; 0.06 s x 50 x 2; 50 kB
    assert devices[0].online_until(60) == 110 and devices[0].online_until(120) is None
    # a pickle naming any class could run code: refused in one line naming the field
    capacity.write_bytes(pickle.dumps({1: {"computation": datetime.timedelta(1), "communication": 1.0}}))
    code, lines = run_cli(tmp_path, capsys, "devices.source=fedscale", f"devices.trace={capacity}")
    assert code == 2 and lines[-1].startswith("hfl: error: devices.trace=") and "only dicts, lists, numbers and strings" in lines[-1]


def test_a_time_limit_ends_a_run_at_the_first_round_reaching_it_and_a_resume_may_extend_it(tmp_path):
    import dataclasses

    from hfl.loggers import read_metrics
    from hfl.report import load_run, run_status
    from hfl.server import run_experiment

    devices = {"source": "tiers", "speed": ["1e9"], "down": ["1MB"], "up": ["5e5"], "spread": 0.5}
    config = small_config(devices=devices, fl={"rounds": 4})
    run_experiment(config, tmp_path / "full")
    full = read_metrics(tmp_path / "full")

    def limited(limit, rounds=4):
        return dataclasses.replace(config, fl=dataclasses.replace(config.fl, time_limit_s=limit, rounds=rounds))

    # a limit between round 1's end and round 2's: round 2 is the first to reach it, and the last
    summary = run_experiment(limited((full[0]["sim_end_s"] + full[1]["sim_end_s"]) / 2), tmp_path / "cut")
    assert drop_wall(read_metrics(tmp_path / "cut")) == drop_wall(full[:2])
    assert (summary["rounds"], summary["simulated_seconds"]) == (2, full[1]["sim_end_s"])
    assert run_status(load_run(tmp_path / "cut")).startswith("completed (")
    # resumed with a later limit, exactly round 3's end: it goes on as the uninterrupted run did, and stops there
    run_experiment(limited(full[2]["sim_end_s"]), tmp_path / "cut", resume=True)
    assert drop_wall(read_metrics(tmp_path / "cut")) == drop_wall(full[:3])
    # resumed with the same limit: nothing more runs; `rounds` stays the most a limited run goes to
    assert run_experiment(limited(full[2]["sim_end_s"], rounds=10), tmp_path / "cut", resume=True)["rounds"] == 3
    assert len(read_metrics(tmp_path / "cut")) == 3
    assert run_experiment(limited(1e9), tmp_path / "long")["rounds"] == 4


def test_a_time_limit_ends_an_async_run_at_its_first_server_step_reaching_it(tmp_path):
    import dataclasses

    from hfl.loggers import read_metrics
    from hfl.server import run_experiment

    devices = {"source": "tiers", "speed": ["1e9"], "down": ["1MB"], "up": ["5e5"], "spread": 0.5}
    config = small_config(devices=devices, fl={"rounds": 3, "round_policy": "async", "async_concurrency": 3, "async_buffer": 2})
    run_experiment(config, tmp_path / "full")
    full = read_metrics(tmp_path / "full")
    limit = math.nextafter(full[0]["sim_end_s"], math.inf)  # just after step 1 ends: step 2 is the last
    run_experiment(dataclasses.replace(config, fl=dataclasses.replace(config.fl, time_limit_s=limit)), tmp_path / "cut")
    assert drop_wall(read_metrics(tmp_path / "cut")) == drop_wall(full[:2])


@pytest.mark.slow
def test_a_resumed_deadline_run_keeps_its_clock(tmp_path):
    import dataclasses

    from hfl.loggers import read_metrics
    from hfl.server import run_experiment

    config = small_config(fl={"rounds": 4, "clients": 10, "round_policy": "deadline", "deadline_s": 2000.0},
                          devices={"source": "trace", "trace": "synthetic"})
    run_experiment(config, tmp_path / "full")
    run_experiment(dataclasses.replace(config, fl=dataclasses.replace(config.fl, rounds=2)), tmp_path / "cut")
    run_experiment(config, tmp_path / "cut", resume=True)
    full, cut = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    assert drop_wall(cut) == drop_wall(full) and full[2]["sim_start_s"] > 0
