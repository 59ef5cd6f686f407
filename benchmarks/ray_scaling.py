"""hfl's RayBackend against the plain PyTorch loop of throughput.py on the same FedAvg work.

Reports, measured in one run: the whole process (interpreter start to exit, Ray's start-up
included) and a steady round (median of rounds 3..20), each as ray/plain, and the resident memory
of each client actor.

    python benchmarks/ray_scaling.py [--repeats 3] [--actors 2]
"""

from __future__ import annotations

import argparse
import json
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


def child_plain() -> dict:
    sys.path.insert(0, str(HERE))
    import torch

    from plain_fedavg import run_plain

    torch.set_num_threads(1)
    _, accuracy, rounds = run_plain()
    return {"accuracy": accuracy, "steady_round": statistics.median(rounds[2:])}


def child_ray(actors: int) -> dict:
    sys.path.insert(0, str(HERE))
    import dataclasses

    from throughput import hfl_config

    from hfl.loggers import read_metrics
    from hfl.server import run_experiment

    config = hfl_config("fast")
    config = dataclasses.replace(config, backend=dataclasses.replace(config.backend, name="ray", actors_per_pool=actors))
    rss: list[int] = []

    class ActorMemory:
        def on_round(self, record: dict) -> None:
            if record["round"] == 5:
                rss.extend(actor_rss())

        def on_end(self, summary: dict) -> None:
            pass

    with tempfile.TemporaryDirectory() as out:
        summary = run_experiment(config, out, callbacks=[ActorMemory()])
        rounds = [r["wall_seconds"] for r in read_metrics(out)]
    return {"accuracy": summary["final_accuracy"], "steady_round": statistics.median(rounds[2:]), "actor_rss": rss}


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
              f"{ray['steady_round'] * 1000:.0f}ms plain {plain['steady_round'] * 1000:.0f}ms; accuracy ray "
              f"{ray['accuracy']:.3f} plain {plain['accuracy']:.3f}", file=sys.stderr, flush=True)
    print(f"actors={args.actors} actor_rss_mb={statistics.median(rss) / 2**20:.0f} "
          f"process_ratio={statistics.median(process):.3f} steady_round_ratio={statistics.median(steady):.3f}")


if __name__ == "__main__":
    main()
