"""hfl's LocalBackend against a plain PyTorch loop on the same FedAvg work, alternated in one run.

Work: digits, 100 IID clients, 10 per round, 5 local epochs, batch 8, SGD lr 0.05, the small CNN,
20 rounds. Both sides load the data, build the model, train, average and evaluate every round;
hfl also writes its metrics and a checkpoint every round, as a user's run does. The plain side is
benchmarks/plain_fedavg.py, which imports no hfl.

    python benchmarks/throughput.py [--repeats 5] [--trainer fast|lightning] [--batch-clients N] [--device cpu|cuda]

The last line is `ratio=<median hfl/plain wall time>`; the target is <= 1.15 on the CPU, <= 1.10
on a GPU.
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


def hfl_config(trainer: str, batch_clients: int = 1, device: str = "cpu"):
    return config_from_dict({
        "name": "throughput",
        "data": {"name": "digits", "partition": "iid"},
        "model": {"name": "cnn"},
        "method": {"name": "fedavg"},
        "fl": {"rounds": ROUNDS, "clients": CLIENTS, "fraction": PER_ROUND / CLIENTS, "local_epochs": EPOCHS,
               "batch_size": BATCH, "lr": LR},
        "backend": {"device": device, "trainer": trainer, "batch_clients": batch_clients},
    })


def run_hfl(trainer: str, batch_clients: int, device: str) -> tuple[float, float]:
    config = hfl_config(trainer, batch_clients, device)
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        summary = run_experiment(config, out)
        return time.perf_counter() - start, summary["final_accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--trainer", default="fast", choices=["fast", "lightning"])
    parser.add_argument("--batch-clients", type=int, default=1, help="hfl's backend.batch_clients (clients trained at once)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    torch.set_num_threads(1)  # both sides on one thread: the comparison is of overhead, not BLAS
    run_hfl(args.trainer, args.batch_clients, args.device), run_plain(device=args.device)  # warm-up: imports, allocator, data cache
    ratios = []
    for i in range(args.repeats):
        hfl_s, hfl_acc = run_hfl(args.trainer, args.batch_clients, args.device)
        plain_s, plain_acc, _ = run_plain(device=args.device)
        ratios.append(hfl_s / plain_s)
        print(f"repeat {i}: hfl {hfl_s:.2f}s (acc {hfl_acc:.3f})  plain {plain_s:.2f}s (acc {plain_acc:.3f})  "
              f"ratio {ratios[-1]:.3f}", file=sys.stderr, flush=True)
    print(f"ratio={statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
