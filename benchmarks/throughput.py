"""hfl's LocalBackend against a plain PyTorch loop on the same FedAvg work, alternated in one run.

Work: digits, 100 IID clients, 10 per round, 5 local epochs, batch 8, SGD lr 0.05, the small CNN,
20 rounds. Both sides load the data, build the model, train, average and evaluate every round;
hfl also writes its metrics and a checkpoint every round, as a user's run does. The plain side is
benchmarks/plain_fedavg.py, which imports no hfl.

    python benchmarks/throughput.py [--repeats 5] [--trainers fast,lightning] [--rounds 20] [--batch-clients N] [--device cpu|cuda]

Every repeat runs the plain loop once and hfl once per driver (`backend.trainer`: `fast`, hfl's
lean driver of the client module's Lightning hooks, and `lightning`, the same module under
`lightning.Trainer`). One line per driver, `ratio_<driver>=<median hfl/plain wall time>`, then
`ratio=` for the first driver; the target is <= 1.15 on the CPU, <= 1.10 on a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch
from plain_fedavg import BATCH, CLIENTS, EPOCHS, LR, PER_ROUND, ROUNDS, run_plain

from hfl.config import config_from_dict
from hfl.server import run_experiment


def hfl_config(trainer: str, batch_clients: int = 1, device: str = "cpu", rounds: int = ROUNDS):
    return config_from_dict({
        "name": "throughput",
        "data": {"name": "digits", "partition": "iid"},
        "model": {"name": "cnn"},
        "method": {"name": "fedavg"},
        "fl": {"rounds": rounds, "clients": CLIENTS, "fraction": PER_ROUND / CLIENTS, "local_epochs": EPOCHS,
               "batch_size": BATCH, "lr": LR},
        "backend": {"device": device, "trainer": trainer, "batch_clients": batch_clients},
    })


def run_hfl(trainer: str, batch_clients: int, device: str, rounds: int) -> tuple[float, float]:
    config = hfl_config(trainer, batch_clients, device, rounds)
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        summary = run_experiment(config, out)
        return time.perf_counter() - start, summary["final_accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--trainers", default="fast,lightning", help="comma-separated hfl drivers: fast, lightning")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="FedAvg rounds on both sides")
    parser.add_argument("--batch-clients", type=int, default=1, help="hfl's backend.batch_clients (clients trained at once)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    trainers = args.trainers.split(",")
    if not trainers or not set(trainers) <= {"fast", "lightning"}:
        parser.error(f"--trainers {args.trainers!r}: a comma-separated list of fast, lightning")
    torch.set_num_threads(1)  # both sides on one thread: the comparison is of overhead, not BLAS
    for trainer in trainers:  # warm-up: imports, allocator, data cache
        run_hfl(trainer, args.batch_clients, args.device, args.rounds)
    run_plain(device=args.device, rounds=args.rounds)
    ratios: dict[str, list[float]] = {t: [] for t in trainers}
    for i in range(args.repeats):
        plain_s, plain_acc, _ = run_plain(device=args.device, rounds=args.rounds)
        line = f"repeat {i}: plain {plain_s:.2f}s (acc {plain_acc:.3f})"
        for trainer in trainers:
            hfl_s, hfl_acc = run_hfl(trainer, args.batch_clients, args.device, args.rounds)
            ratios[trainer].append(hfl_s / plain_s)
            line += f"  hfl {trainer} {hfl_s:.2f}s (acc {hfl_acc:.3f}) ratio {ratios[trainer][-1]:.3f}"
        print(line, file=sys.stderr, flush=True)
    for trainer in trainers:
        print(f"ratio_{trainer}={statistics.median(ratios[trainer]):.3f}")
    print(f"ratio={statistics.median(ratios[trainers[0]]):.3f}")


if __name__ == "__main__":
    main()
