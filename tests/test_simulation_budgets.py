"""Deadlines as a time budget (`fl.deadline_plans`: the largest sub-model that ends in time) and
devices' energy (hfl.simulation, docs/time.md)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from conftest import small_config
from hfl.accounting.amounts import ClientBudget, TimeBudget
from hfl.accounting.cost import TrainingCost
from hfl.cli import main
from hfl.simulation.clock import client_time, record_energy
from hfl.simulation.devices import Device, read_trace
from hfl.submodel.ladder import Ladder, Level
from hfl.submodel.spec import SubmodelSpec
from hfl.types import ClientTask, RoundContext, TrainSettings

SETTINGS = TrainSettings(lr=0.1, momentum=0.0, weight_decay=0.0, local_epochs=2, batch_size=10)
FLOPS_PER_SAMPLE = {0.25: 1e6, 0.5: 4e6, 1.0: 1.6e7}
"""Training FLOPs per sample of three levels by width; the client trains 50 samples for 2 epochs."""
UPLOAD_BYTES = {0.25: 1e4, 0.5: 4e4, 1.0: 1.6e5}
"""Bytes each level sends (and, nothing being frozen, receives)."""


def hand_ladder() -> Ladder:
    def cost(task: ClientTask, batch: int) -> TrainingCost:
        return TrainingCost(batch, 0, 0, 0, 0, 0, 1, int(FLOPS_PER_SAMPLE[task.spec.width]), 0)

    levels = [Level(f"x{w}", SubmodelSpec(width=w)) for w in FLOPS_PER_SAMPLE]
    return Ladder(levels, cost, upload=lambda spec: int(UPLOAD_BYTES[spec.width]))


def ctx_with(budget: ClientBudget | None) -> RoundContext:
    return RoundContext(1, 0, 0, 50, SETTINGS, budget)


def test_a_deadline_gives_the_largest_level_that_ends_in_time_and_without_it_the_full_one():
    # By hand, on 1e9 FLOP/s with 1e6 bytes/s both ways, 50 samples x 2 epochs: x0.25 takes
    # 0.01 + 1e8/1e9 + 0.01 = 0.12 s, x0.5 0.04 + 0.4 + 0.04 = 0.48 s, x1 0.16 + 1.6 + 0.16 = 1.92 s.
    device = Device(1e9, 1e6, 1e6)
    ladder = hand_ladder()
    times = {w: sum(device.durations(UPLOAD_BYTES[w], FLOPS_PER_SAMPLE[w] * 100, 50, 2, UPLOAD_BYTES[w])) for w in FLOPS_PER_SAMPLE}
    assert times == pytest.approx({0.25: 0.12, 0.5: 0.48, 1.0: 1.92})
    unlimited = ClientBudget("all", None, None, None)
    assert ladder.task(ctx_with(None)).level == ladder.task(ctx_with(unlimited)).level == "x1.0"
    assert ladder.task(ctx_with(ClientBudget("all", None, None, None, TimeBudget(1.0, device)))).level == "x0.5"
    assert ladder.task(ctx_with(ClientBudget("all", None, None, None, TimeBudget(0.48, device)))).level == "x0.5"  # ending at the deadline is in time
    assert ladder.task(ctx_with(ClientBudget("all", None, None, None, TimeBudget(0.2, device)))).level == "x0.25"
    assert ladder.task(ctx_with(ClientBudget("all", None, None, None, TimeBudget(0.1, device)))) is None  # nothing ends in time: sits out
    # time and memory together: the smaller of what each allows
    assert ladder.task(ctx_with(ClientBudget("all", None, 2e8, None, TimeBudget(5.0, device)))).level == "x0.25"


def test_the_clock_times_a_run_client_round_as_the_deadline_budget_timed_its_plan():
    device = Device(1e9, 1e6, 5e5)
    metrics = {"id": 0, "flops": 4e8, "bytes_down": 4e4, "bytes_up": 4e4, "num_samples": 50}
    t = client_time(device, metrics, 0.0, local_epochs=2)
    assert (t.down_s, t.compute_s, t.up_s) == (0.04, 0.4, 0.08)
    assert TimeBudget(t.finish, device).admits(4e4, 4e8, 50, 2, 4e4)
    assert not TimeBudget(0.5, device).admits(4e4, 4e8, 50, 2, 4e4)


HETEROFL_TIERS = {"scenario": "tiers", "memory": ["width:1/4", "width:1"], "names": ["slow", "fast"]}
TIER_DEVICES = {"source": "tiers", "speed": ["1e8", "2e9"], "down": ["250kB", "4MB"], "up": ["100kB", "2MB"]}


def test_a_run_with_deadline_plans_trains_the_largest_sub_model_in_time_and_without_them_the_budgets_own(tmp_path):
    from hfl.budget import round_one
    from hfl.experiment import ClientEnvironment
    from hfl.loggers import read_metrics
    from hfl.server import initial_state, run_experiment
    from hfl.simulation.estimate import expected_time

    # the slow tier's client takes 0.113 s at x0.125 and 0.390 s at x0.25 (its memory's width), the
    # fast tier's 0.279 s at x1 (`hfl budget` prints these): a 0.3 s deadline admits x0.125 and x1
    fl = {"rounds": 1, "fraction": 1.0, "round_policy": "deadline", "deadline_s": 0.3}
    plain = small_config(method={"name": "heterofl"}, fl=fl, budgets=HETEROFL_TIERS, devices=TIER_DEVICES)
    timed = small_config(method={"name": "heterofl"}, fl={**fl, "deadline_plans": True}, budgets=HETEROFL_TIERS, devices=TIER_DEVICES)
    run_experiment(plain, tmp_path / "plain")
    run_experiment(timed, tmp_path / "timed")
    (without,), (with_,) = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "timed")
    # without: the memory budgets' widths (1/4 and 1), and the clients that end late are stragglers
    assert {c["tier"]: c["level"] for c in without["clients"]} == {"slow": "x0.25", "fast": "x1"}
    assert without["stragglers"] == sorted(c["id"] for c in without["clients"] if c["tier"] == "slow")
    # with: every client trains the largest width that ends by the deadline, so none straggles
    env = ClientEnvironment.from_config(timed)
    ladder, state = env.method.ladder, initial_state(timed, env)
    levels = [lv.name for lv in ladder.levels]
    assert not with_["stragglers"] and {c["tier"]: c["level"] for c in with_["clients"]} == {"slow": "x0.125", "fast": "x1"}
    for client in with_["clients"]:
        assert client["sim_finish_s"] <= 0.3  # round 1 starts at 0
        ctx = round_one(timed, env, client["id"])
        memory_only = replace(ctx, budget=replace(ctx.budget, time=None))
        wider = [lv for lv in levels[levels.index(client["level"]) + 1:] if ladder.fits(ladder[lv], memory_only)]
        for level in wider:  # every wider level the memory budget allows would have ended late
            assert expected_time(env.method, ladder.task_for(ctx, ladder[level]), state.global_state, ctx.budget.time.device).finish > 0.3


@pytest.mark.parametrize("method", ["depthfl", "fjord", "fedrolex", "scalefl", "nefl", "splitmix", "decoupled"])
def test_every_ladder_method_plans_the_largest_sub_model_its_clock_ends_in_time(method):
    from hfl.budget import round_one
    from hfl.experiment import ClientEnvironment
    from hfl.simulation.devices import assign_devices
    from hfl.simulation.estimate import expected_time

    # The ladder estimates a level's seconds from its cost and upload bytes; the clock (expected_time)
    # from what the client receives: a deadline at a middle level's seconds must give that level.
    fl = {"rounds": 1, "clients": 4, "round_policy": "deadline"}
    devices = {"source": "tiers", "speed": ["1e9"], "down": ["1MB"], "up": ["5e5"]}
    probe = small_config(method={"name": method}, fl={**fl, "deadline_s": 1.0}, devices=devices)
    env = ClientEnvironment.from_config(probe)
    ladder, initial, device = env.method.ladder, env.method.initial_global_state(), assign_devices(probe)[0]
    seconds = [expected_time(env.method, ladder.task_for(round_one(probe, env, 0), lv), initial, device).finish for lv in ladder.levels]
    middle = seconds[len(seconds) // 2]
    timed = small_config(method={"name": method}, fl={**fl, "deadline_s": middle, "deadline_plans": True}, devices=devices)
    env = ClientEnvironment.from_config(timed)
    task = env.method.plan(round_one(timed, env, 0), env.method.init_state())
    # the largest level ending in time; under NeFL's dynamic tiers that is the tier, the top of what it draws among
    assert (task.choices or (task.level,))[-1] == ladder.levels[max(k for k, t in enumerate(seconds) if t <= middle)].name
    assert expected_time(env.method, task, initial, device).finish <= middle


def test_a_method_without_sub_models_skips_the_clients_that_cannot_end_in_time(tmp_path):
    from hfl.loggers import read_metrics
    from hfl.server import run_experiment

    # FedAvg's CNN on digits takes about 0.5 s at 1e9 FLOP/s and 1e6 bytes/s, 5 ms at 100x that
    devices = [{"id": c, "speed": 1e9 if c < 3 else 1e11, "down": 1e6 if c < 3 else 1e8, "up": 1e6 if c < 3 else 1e8} for c in range(6)]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"devices": devices}))
    fl = {"rounds": 1, "fraction": 1.0, "round_policy": "deadline", "deadline_s": 0.1}
    for plans in (False, True):
        run_experiment(small_config(fl={**fl, "deadline_plans": plans}, devices={"source": "trace", "trace": str(trace)}), tmp_path / str(plans))
    (late,), (skipping,) = read_metrics(tmp_path / "False"), read_metrics(tmp_path / "True")
    assert late["stragglers"] == [0, 1, 2] and "skipped_clients" not in late  # off: they train, and are dropped
    assert [c["id"] for c in skipping["clients"]] == [3, 4, 5] and not skipping["stragglers"]  # on: they sit out, spending nothing
    assert [s["id"] for s in skipping["skipped_clients"]] == [0, 1, 2]


def test_hfl_budget_prints_each_tiers_round_seconds_per_sub_model(tmp_path, capsys):
    from hfl.budget import budget_report, round_one
    from hfl.experiment import ClientEnvironment
    from hfl.simulation.estimate import expected_time

    config = small_config(method={"name": "heterofl"}, budgets=HETEROFL_TIERS, devices=TIER_DEVICES)
    env = ClientEnvironment.from_config(config)
    plans = budget_report(config, env)["plans"]
    ladder = env.method.ladder
    assert [p["tier"] for p in plans] == ["slow", "fast"]
    for plan in plans:
        assert list(plan["level_round_s"]) == [lv.name for lv in ladder.levels]
        device = Device(*{"slow": (1e8, 2.5e5, 1e5), "fast": (2e9, 4e6, 2e6)}[plan["tier"]])
        # the full model's seconds by hand: its bytes down and up over the bandwidths, its FLOPs over the speed
        ctx = round_one(config, env, plan["client"])
        task = ladder.task_for(ctx, ladder.levels[-1])
        params = env.method.upload_bytes(task.spec)
        flops = env.method.training_cost(task, min(32, ctx.num_samples)).train_flops_per_sample * ctx.num_samples
        assert plan["level_round_s"]["x1"] == pytest.approx(params / device.down + flops / device.speed + params / device.up, rel=1e-12)
        assert plan["level_round_s"]["x1"] == expected_time(env.method, task, env.method.initial_global_state(), device).finish
        assert sorted(plan["level_round_s"].values()) == list(plan["level_round_s"].values())  # wider takes longer
    main(["budget", "experiments/quickstart.yaml", "method.name=heterofl", "backend.device=cpu", "fl.clients=6", "budgets.scenario=tiers",
          "budgets.memory=[width:1/4,width:1]", "budgets.names=[slow,fast]", "devices.source=tiers", "devices.speed=[1e8,2e9]",
          "devices.down=[250kB,4MB]", "devices.up=[100kB,2MB]"])
    out = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(out) if line.startswith("Round seconds of each sub-model on each tier's device"))
    assert out[start + 1].split() == ["tier", *[lv.name for lv in ladder.levels]]
    assert [line.split()[0] for line in out[start + 3:start + 5]] == ["slow", "fast"]
    assert all(float(cell) > 0 for line in out[start + 3:start + 5] for cell in line.split()[1:])


def test_the_energy_of_a_hand_computed_client_round():
    # 2e9 FLOPs at 1e-9 J/FLOP = 2 J; 1e6 bytes down and 5e5 up at 2e-6 J/byte = 3 J
    metrics = {"id": 0, "flops": 2e9, "bytes_down": 1e6, "bytes_up": 5e5, "num_samples": 50}
    record_energy(metrics, Device(1e9, 1e6, 5e5, energy_per_flop=1e-9, energy_per_byte=2e-6))
    assert metrics["energy_j"] == pytest.approx(5.0)
    only_flops = dict(metrics)
    del only_flops["energy_j"]
    record_energy(only_flops, Device(1e9, 1e6, 5e5, energy_per_flop=1e-9))  # no byte figure: bytes cost nothing
    assert only_flops["energy_j"] == pytest.approx(2.0)
    silent = {k: v for k, v in metrics.items() if k != "energy_j"}
    record_energy(silent, Device(1e9, 1e6, 5e5))
    assert "energy_j" not in silent  # a device without figures records no energy


def test_trace_files_carry_energy_figures(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps({"devices": [{"id": 0, "speed": 1e9, "down": 1e6, "up": 1e6, "energy_per_flop": 1e-9},
                                                            {"id": 1, "speed": 1e9, "down": 1e6, "up": 1e6}]}))
    (tmp_path / "t.csv").write_text("id,speed,down,up,online,energy_per_flop,energy_per_byte\n0,1e9,1e6,1e6,,1e-9,2e-7\n1,1e9,1e6,1e6,,,\n")
    json_devices, csv_devices = read_trace(tmp_path / "t.json"), read_trace(tmp_path / "t.csv")
    assert (json_devices[0].energy_per_flop, json_devices[0].energy_per_byte, json_devices[1].energy_per_flop) == (1e-9, None, None)
    assert (csv_devices[0].energy_per_flop, csv_devices[0].energy_per_byte, csv_devices[1].energy_per_byte) == (1e-9, 2e-7, None)


def test_a_run_records_each_client_rounds_energy_and_the_total_counts_the_stragglers(tmp_path):
    from hfl.loggers import read_metrics
    from hfl.server import run_experiment

    devices = {"source": "tiers", "speed": ["1e9"], "down": ["1MB"], "up": ["5e5"], "spread": 1.0, "energy_per_flop": [1e-9], "energy_per_byte": [2e-7]}
    config = small_config(devices=devices, fl={"round_policy": "deadline", "deadline_s": 0.5, "rounds": 2, "clients": 10})
    summary = run_experiment(config, tmp_path / "run")
    clients = [c for r in read_metrics(tmp_path / "run") for c in r["clients"]]
    assert any(c.get("dropped") for c in clients)
    for c in clients:
        assert c["energy_j"] == pytest.approx(c["flops"] * 1e-9 + (c["bytes_down"] + c["bytes_up"]) * 2e-7, rel=1e-12)
    assert summary["total_energy_j"] == pytest.approx(sum(c["energy_j"] for c in clients), rel=1e-12)
    # asynchronous client-rounds too
    run_experiment(small_config(devices=devices, fl={"round_policy": "async", "rounds": 2, "clients": 6}), tmp_path / "async")
    clients = [c for r in read_metrics(tmp_path / "async") for c in r["clients"]]
    assert clients and all(c["energy_j"] == pytest.approx(c["flops"] * 1e-9 + (c["bytes_down"] + c["bytes_up"]) * 2e-7) for c in clients)
    # a trace without figures takes the config's one value for every device
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"devices": [{"id": c, "speed": 1e9, "down": 1e6, "up": 1e6} for c in range(6)]}))
    summary = run_experiment(small_config(fl={"rounds": 1}, devices={"source": "trace", "trace": str(trace), "energy_per_byte": [1e-6]}), tmp_path / "trace")
    (record,) = read_metrics(tmp_path / "trace")
    assert [c["energy_j"] for c in record["clients"]] == pytest.approx([(c["bytes_down"] + c["bytes_up"]) * 1e-6 for c in record["clients"]])


def run_cli(tmp_path, capsys, *overrides):
    code = main(["run", "experiments/quickstart.yaml", "fl.rounds=1", "fl.clients=3", "backend.device=cpu", *overrides, "--out", str(tmp_path / "run")])
    return code, capsys.readouterr().err.strip().splitlines()


def test_bad_energy_and_deadline_plan_input_exits_2_naming_the_field(tmp_path, capsys):
    tiers = ["devices.source=tiers", "devices.speed=[1e9]", "devices.down=[1MB]", "devices.up=[1MB]"]
    code, lines = run_cli(tmp_path, capsys, *tiers, "devices.energy_per_flop=[-1e-9]")
    assert code == 2 and lines[-1].startswith("hfl: error: devices.energy_per_flop=-1e-09") and "joules >= 0" in lines[-1]
    trace = tmp_path / "negative.json"
    trace.write_text(json.dumps({"devices": [{"id": c, "speed": 1e9, "down": 1e6, "up": 1e6, "energy_per_byte": -1 if c == 2 else 0} for c in range(3)]}))
    code, lines = run_cli(tmp_path, capsys, "devices.source=trace", f"devices.trace={trace}")
    assert code == 2 and "devices.trace energy_per_byte=-1" in lines[-1] and "device id 2" in lines[-1] and sum("error" in line for line in lines) == 1
    code, lines = run_cli(tmp_path, capsys, *tiers, "fl.deadline_plans=true")
    assert code == 2 and lines[-1].startswith("hfl: error: fl.deadline_plans=True") and "unless round_policy is deadline" in lines[-1]
    # digits' CNN on 1 GFLOP/s and 1 MB/s takes about half a second: 0.01 s admits no client's round
    code, lines = run_cli(tmp_path, capsys, *tiers, "fl.round_policy=deadline", "fl.deadline_s=0.01", "fl.deadline_plans=true")
    assert code == 2 and lines[-1].startswith("hfl: error: fl.deadline_s=0.01") and "fl.deadline_plans" in lines[-1] and sum("error" in line for line in lines) == 1
    assert not (tmp_path / "run").exists()
