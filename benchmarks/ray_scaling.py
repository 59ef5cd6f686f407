"""hfl's RayBackend against the plain PyTorch loop of throughput.py on the same FedAvg work.

Reports, measured in one run: the whole process (interpreter start to exit, Ray's start-up
included) and a steady round (median of rounds 3..20), each as ray/plain, the resident memory of
each client actor, and the processes each side ran (plain: one; Ray: the driver, the client actors,
and everything else the driver started: raylet, GCS, dashboard, idle workers).

A round is the same span on both sides: from its start to the next round's start, so it holds all
of a round's work (planning, training, aggregation, evaluation, and on hfl's side the metrics line
and the checkpoint). On hfl's side the start of round r + 1 is the moment round r's callbacks run
(the last thing a round does before the loop starts the next), taken as a timestamp.

    python benchmarks/ray_scaling.py [--repeats 3] [--actors 2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def actor_rss() -> list[int]:
    """Resident bytes of every Ray client-actor process on this machine (Linux /proc)."""
    sizes = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if b"ClientActor" in (proc / "cmdline").read_bytes():
                kb = next(line for line in (proc / "status").read_text().splitlines() if line.startswith("VmRSS"))
                sizes.append(int(kb.split()[1]) * 1024)
        except (OSError, StopIteration):
            continue
    return sizes


def descendants(pid: int) -> list[int]:
    """Every live process started, directly or not, by `pid` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(proc.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def child_plain() -> dict:
    sys.path.insert(0, str(HERE))
    import torch

    from plain_fedavg import run_plain

    torch.set_num_threads(1)
    _, accuracy, rounds = run_plain()  # each round from its start to the next round's start
    return {"accuracy": accuracy, "steady_round": statistics.median(rounds[2:]), "processes": 1 + len(descendants(os.getpid()))}


def child_ray(actors: int) -> dict:
    sys.path.insert(0, str(HERE))
    import dataclasses

    from throughput import hfl_config

    from hfl.loggers import read_metrics
    from hfl.server import run_experiment

    config = hfl_config("fast")
    config = dataclasses.replace(config, backend=dataclasses.replace(config.backend, name="ray", actors_per_pool=actors))
    rss: list[int] = []
    processes: list[int] = []
    next_starts: list[float] = []  # next_starts[k]: when round k + 1 ended, i.e. round k + 2 starts

    class RoundClock:
        def on_round(self, record: dict) -> None:
            next_starts.append(time.perf_counter())
            if record["round"] == 5:
                rss.extend(actor_rss())
                processes.append(1 + len(descendants(os.getpid())))

        def on_end(self, summary: dict) -> None:
            pass

    with tempfile.TemporaryDirectory() as out:
        summary = run_experiment(config, out, callbacks=[RoundClock()])
        # hfl's own wall_seconds stops before the metrics line and the checkpoint: shown beside, not compared
        wall = [r["wall_seconds"] for r in read_metrics(out)]
    # rounds[k]: round k + 2, from its start to the next round's start (the callbacks of round 1 are
    # the first start this clock sees, so round 1 itself, which includes the actors' start, is not timed)
    rounds = [b - a for a, b in itertools.pairwise(next_starts)]
    return {"accuracy": summary["final_accuracy"], "steady_round": statistics.median(rounds[1:]), "actor_rss": rss,
            "actors": len(rss), "processes": processes[0] if processes else None, "wall_seconds": statistics.median(wall[2:])}


def timed_child(kind: str, actors: int) -> dict:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, __file__, "--child", kind, "--actors", str(actors)],
                            capture_output=True, text=True, check=True)
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    outcome["process"] = time.perf_counter() - start
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--child", choices=["plain", "ray"])
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child_plain() if args.child == "plain" else child_ray(args.actors)))
        return
    process, steady, rss = [], [], []
    for i in range(args.repeats):
        plain, ray = timed_child("plain", args.actors), timed_child("ray", args.actors)
        process.append(ray["process"] / plain["process"])
        steady.append(ray["steady_round"] / plain["steady_round"])
        rss += ray["actor_rss"]
        print(f"repeat {i}: process ray {ray['process']:.1f}s plain {plain['process']:.1f}s; steady round ray "
              f"{ray['steady_round'] * 1000:.0f}ms (its wall_seconds {ray['wall_seconds'] * 1000:.0f}ms) plain "
              f"{plain['steady_round'] * 1000:.0f}ms; accuracy ray "
              f"{ray['accuracy']:.3f} plain {plain['accuracy']:.3f}; processes ray {ray['processes']} "
              f"({ray['actors']} client actors) plain {plain['processes']}", file=sys.stderr, flush=True)
    print(f"actors={args.actors} actor_rss_mib={statistics.median(rss) / 2**20:.0f} "
          f"process_ratio={statistics.median(process):.3f} steady_round_ratio={statistics.median(steady):.3f} "
          f"processes_ray={ray['processes']} client_actors={ray['actors']} processes_plain={plain['processes']}")


if __name__ == "__main__":
    main()
