"""What simulating time costs with 10,000 clients on a trace, against what the quickstart's round
costs (issue 48: at most 5 %).

    python benchmarks/simulation_scale.py [--clients 10000] [--rounds 20] [--cohort 10]

1. The quickstart (digits, CNN, 20 clients, 10 a round, 3 local epochs) runs `--rounds` rounds here:
   its mean round wall time is the reference for the synchronous policies, and the mean
   client-round's own seconds times FedBuff's buffer (5 arrivals) the reference for one async step
   (training only, no evaluation: the smaller reference, so the larger ratio). Its recorded
   client-rounds (FLOPs, bytes, samples) are the counts the simulation is fed.
2. A trace of `--clients` devices, made with the shipped trace's recipe
   (`hfl.simulation.devices.synthetic_trace`: three classes, log-normal spread, online and offline
   stretches over a day, about 2/3 online at a time), is written as JSON and read back by
   `assign_devices` (devices.mapping=by_id, spread 0.3): the run's device assignment, once per run.
3. Each policy runs `--rounds` rounds of `--cohort` clients over those devices, through the classes
   the server calls (`SyncRounds.cohort` and `.settle`; `FedBuffRounds.step` with `saved()`, the
   checkpoint's event queue): cohort drawn among the devices online, client times, deadline or first
   K, the event queue. Training is replaced by the quickstart's recorded client-rounds (async: updates
   holding the CNN's real state, so the deltas and staleness weights cost what they do in a run).
   Only the simulation's own calls are timed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
BUFFER = 5
"""FedBuff's arrivals per server step here (the time_to_accuracy comparison's)."""


def quickstart_reference(rounds: int, out: Path) -> tuple[float, float, list[dict[str, Any]], dict[str, Any]]:
    """(mean round seconds, mean client-round seconds, the recorded client-rounds, the final global state)."""
    import torch

    from hfl.checkpoint import load_checkpoint
    from hfl.config import load_config
    from hfl.loggers import read_metrics
    from hfl.server import run_experiment

    run_experiment(load_config(QUICKSTART, [f"fl.rounds={rounds}"]), out)
    records = read_metrics(out)
    clients = [c for r in records for c in r["clients"]]
    global_state = load_checkpoint(out, torch.device("cpu"))[0].global_state
    return (sum(r["wall_seconds"] for r in records) / len(records), sum(c["seconds"] for c in clients) / len(clients),
            clients, global_state)


def simulated_config(trace: Path, clients: int, cohort: int, policy: str, rounds: int) -> Any:
    from hfl.config import load_config

    overrides = [f"fl.clients={clients}", f"fl.fraction={cohort / clients}", f"fl.rounds={rounds}", f"fl.round_policy={policy}",
                 "devices.source=trace", f"devices.trace={trace}", "devices.mapping=by_id", "devices.spread=0.3"]
    if policy == "deadline":
        overrides.append("fl.deadline_s=1.0")  # a quickstart client-round takes 0.1 to 2 s on these devices: some straggle
    if policy == "async":
        overrides += [f"fl.async_concurrency={cohort}", f"fl.async_buffer={BUFFER}"]
    return load_config(QUICKSTART, overrides)


def time_sync(config: Any, devices: list, recorded: list[dict[str, Any]]) -> float:
    """Seconds the sync/deadline/overselect clock takes over the config's rounds."""
    from hfl.simulation.policy import SyncRounds

    clock, spent, k = SyncRounds(config, devices), 0.0, 0
    for r in range(1, config.fl.rounds + 1):
        began = time.perf_counter()
        cohort, start = clock.cohort(r)
        spent += time.perf_counter() - began
        updates = []
        for c in cohort:  # training, stood in for by the quickstart's client-rounds
            updates.append(SimpleNamespace(client_id=c, metrics={**recorded[k % len(recorded)], "id": c}))
            k += 1
        began = time.perf_counter()
        clock.settle(start, updates)
        clock.saved()
        spent += time.perf_counter() - began
    return spent


def time_async(config: Any, devices: list, recorded: list[dict[str, Any]], global_state: dict) -> tuple[float, int]:
    """(seconds FedBuff's event queue takes over the config's steps, client-rounds it dispatched)."""
    from hfl.simulation.fedbuff import FedBuffRounds
    from hfl.submodel.spec import full_spec
    from hfl.types import ClientUpdate

    fedbuff, spec, trained = FedBuffRounds(config, devices), full_spec(), [0.0]
    counter = iter(range(10**9))

    def train(state: dict, tasks: list) -> tuple[list, list]:
        began = time.perf_counter()
        updates = [ClientUpdate(t.client, global_state, 1.0, spec, {**recorded[next(counter) % len(recorded)], "id": t.client})
                   for t in tasks]
        trained[0] += time.perf_counter() - began  # the stand-in's own time is training's, not the simulation's
        return updates, []

    began = time.perf_counter()
    for _ in range(config.fl.rounds):
        fedbuff.step(global_state, lambda c: SimpleNamespace(client=c), train)
        fedbuff.saved()
    return time.perf_counter() - began - trained[0], fedbuff.dispatched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--cohort", type=int, default=10, help="clients a round (the quickstart's 10 of 20)")
    args = parser.parse_args()

    from hfl.simulation.devices import assign_devices, synthetic_trace

    with tempfile.TemporaryDirectory(prefix="hfl-simscale-") as folder:
        folder = Path(folder)
        round_s, client_round_s, recorded, global_state = quickstart_reference(args.rounds, folder / "quickstart")
        trace = folder / "trace.json"
        data = synthetic_trace(count=args.clients)
        trace.write_text(json.dumps(data))
        online = sum(1 for d in data["devices"] if any(a <= 0 < b for a, b in d["online"]))
        print(f"quickstart here: {round_s:.3f} s a round (10 client-rounds, evaluation, aggregation), "
              f"{client_round_s:.4f} s a client-round's training; {args.rounds} rounds")
        print(f"trace: {args.clients} devices, {online} online at 0 s, written {trace.stat().st_size / 1e6:.1f} MB")
        rows = []
        for policy in ("sync", "deadline", "overselect", "async"):
            config = simulated_config(trace, args.clients, args.cohort, policy, args.rounds)
            began = time.perf_counter()
            devices = assign_devices(config)
            assign_s = time.perf_counter() - began
            if policy == "async":
                spent, dispatched = time_async(config, devices, recorded, global_state)
                reference = client_round_s * BUFFER
            else:
                spent, dispatched = time_sync(config, devices, recorded), None
                reference = round_s
            per_round = spent / args.rounds
            run_share = (assign_s + spent) / (reference * args.rounds)  # the devices are assigned once a run
            rows.append((policy, per_round / reference, run_share))
            unit = "step" if policy == "async" else "round"
            extra = f" ({dispatched} client-rounds dispatched)" if dispatched is not None else ""
            print(f"{policy:10s} {per_round * 1e3:6.2f} ms a {unit}{extra} = {100 * per_round / reference:.2f} % of the {unit}'s "
                  f"{reference:.3f} s; devices assigned once in {assign_s:.3f} s: with it, {100 * run_share:.2f} % of {args.rounds} {unit}s")
        print(f"largest share of a round: {100 * max(r[1] for r in rows):.2f} % ({max(rows, key=lambda r: r[1])[0]}); "
              f"of a {args.rounds}-round run, the assignment included: {100 * max(r[2] for r in rows):.2f} % "
              f"({max(rows, key=lambda r: r[2])[0]}); issue 48's bound: 5 %")


if __name__ == "__main__":
    main()
