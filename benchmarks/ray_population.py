"""Does a round on the Ray backend cost the same with 10,000 clients as with 100?

Both runs train the same work per round: FedAvg, 10 clients a round, each with 6 MNIST images
(1 local epoch, batch 8, the small CNN); the global model is evaluated only after the last round,
so that a steady round is the clients' round alone (evaluating 10,000 test images takes seconds,
the same for both populations). 10,000 clients
share the 60,000 training images; 100 clients share 600 of them (`data.server_fraction` keeps the
other 59,400 aside, unused by FedAvg). What may grow with the population is everything outside a
client's training: the actors' set-up (partitions, budgets), cohort sampling, planning, and what
the driver keeps per client. Reports each run's steady round (median of rounds 3..), its first
round (actors' start included) and whole process, and the ratio of steady rounds.

    python benchmarks/ray_population.py [--rounds 12] [--populations 100,10000]

MNIST is read from $HFL_DATA or ../shared/datasets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PER_ROUND, SAMPLES = 10, 6


def config_for(population: int, rounds: int):
    from hfl.config import config_from_dict

    train = 60_000
    return config_from_dict({
        "name": f"population-{population}",
        "data": {"name": "mnist", "root": os.environ.get("HFL_DATA") or str(HERE.parent.parent / "shared" / "datasets"),
                 "partition": "iid", "server_fraction": 1 - population * SAMPLES / train},
        "model": {"name": "cnn"},
        "method": {"name": "fedavg"},
        "fl": {"rounds": rounds, "clients": population, "fraction": PER_ROUND / population, "local_epochs": 1, "batch_size": 8, "lr": 0.05,
               "eval_every": rounds},
        "backend": {"name": "ray", "device": "cpu", "actors_per_pool": 2},
    })


def child(population: int, rounds: int) -> dict:
    from hfl.loggers import read_metrics
    from hfl.server import run_experiment

    with tempfile.TemporaryDirectory() as out:
        summary = run_experiment(config_for(population, rounds), out)
        records = read_metrics(out)
    wall = [r["wall_seconds"] for r in records]
    samples = {c["num_samples"] for r in records for c in r["clients"]}
    return {"steady_round": statistics.median(wall[2:]), "first_round": wall[0], "samples_per_client": sorted(samples),
            "accuracy": summary["final_accuracy"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--populations", default="100,10000")
    parser.add_argument("--child", type=int)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.rounds)))
        return
    results = {}
    for population in [int(p) for p in args.populations.split(",")]:
        start = time.perf_counter()
        run = subprocess.run([sys.executable, __file__, "--child", str(population), "--rounds", str(args.rounds)],
                             capture_output=True, text=True, check=True)
        results[population] = {**json.loads(run.stdout.strip().splitlines()[-1]), "process": time.perf_counter() - start}
        r = results[population]
        print(f"clients={population}: steady round {r['steady_round'] * 1000:.0f}ms, first round {r['first_round']:.1f}s, "
              f"process {r['process']:.1f}s, samples per client {r['samples_per_client']}, accuracy {r['accuracy']:.3f}",
              file=sys.stderr, flush=True)
    smallest, largest = min(results), max(results)
    print(f"steady_round_ratio_{largest}_vs_{smallest}={results[largest]['steady_round'] / results[smallest]['steady_round']:.3f} "
          f"first_round_ratio={results[largest]['first_round'] / results[smallest]['first_round']:.3f}")


if __name__ == "__main__":
    main()
