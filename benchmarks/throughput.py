"""hfl's LocalBackend against a plain PyTorch loop on the same FedAvg work, alternated in one run.

Work: digits, 100 IID clients, 10 per round, 5 local epochs, batch 8, SGD lr 0.05, the small CNN,
20 rounds. Both sides load the data, build the model, train, average and evaluate every round;
hfl also writes its metrics and a checkpoint every round, as a user's run does.

    python benchmarks/throughput.py [--repeats 5] [--trainer fast|lightning]

The last line is `ratio=<median hfl/plain wall time>`; the target is <= 1.15.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

from hfl.config import config_from_dict
from hfl.data import load_dataset, partition
from hfl.models import build_model
from hfl.server import run_experiment

ROUNDS, CLIENTS, PER_ROUND, EPOCHS, BATCH, LR = 20, 100, 10, 5, 8, 0.05


def hfl_config(trainer: str):
    return config_from_dict({
        "name": "throughput",
        "data": {"name": "digits", "partition": "iid"},
        "model": {"name": "cnn"},
        "method": {"name": "fedavg"},
        "fl": {"rounds": ROUNDS, "clients": CLIENTS, "fraction": PER_ROUND / CLIENTS, "local_epochs": EPOCHS,
               "batch_size": BATCH, "lr": LR},
        "backend": {"device": "cpu", "trainer": trainer},
    })


def run_hfl(trainer: str) -> tuple[float, float]:
    config = hfl_config(trainer)
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        summary = run_experiment(config, out)
        return time.perf_counter() - start, summary["final_accuracy"]


def run_plain(seed: int = 0, per_round: bool = False):
    """The same work as a researcher would write it by hand: tensors, randperm batches, SGD.
    Returns (seconds, final accuracy), plus each round's seconds when `per_round`."""
    start = time.perf_counter()
    round_seconds = []
    config = hfl_config("fast")
    data = load_dataset("digits", config.data.root, config.data.cache_dir)
    x = (data.train_x.float() / 255 - data.mean[0]) / data.std[0]
    y = data.train_y
    x_test = (data.test_x.float() / 255 - data.mean[0]) / data.std[0]
    parts = [torch.as_tensor(p) for p in partition("iid", y.numpy(), CLIENTS, seed)]
    torch.manual_seed(seed)
    model = build_model("cnn", 1, 10)
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = np.random.default_rng(seed)
    for _ in range(ROUNDS):
        round_start = time.perf_counter()
        cohort = rng.choice(CLIENTS, PER_ROUND, replace=False)
        total = {k: torch.zeros_like(v) for k, v in global_state.items()}
        weight = 0
        for c in cohort:
            model.load_state_dict(global_state)
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
            idx = parts[c]
            model.train()
            for _ in range(EPOCHS):
                order = idx[torch.randperm(len(idx))]
                for b in range(0, len(order), BATCH):
                    batch = order[b : b + BATCH]
                    optimizer.zero_grad()
                    F.cross_entropy(model(x[batch]), y[batch]).backward()
                    optimizer.step()
            for k, v in model.state_dict().items():
                total[k] += v * len(idx)
            weight += len(idx)
        global_state = {k: v / weight for k, v in total.items()}
        model.load_state_dict(global_state)
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == data.test_y).float().mean().item()
        round_seconds.append(time.perf_counter() - round_start)
    if per_round:
        return time.perf_counter() - start, accuracy, round_seconds
    return time.perf_counter() - start, accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--trainer", default="fast", choices=["fast", "lightning"])
    args = parser.parse_args()
    torch.set_num_threads(1)  # both sides on one thread: the comparison is of overhead, not BLAS
    run_hfl(args.trainer), run_plain()  # warm-up: imports, allocator, data cache
    ratios = []
    for i in range(args.repeats):
        hfl_s, hfl_acc = run_hfl(args.trainer)
        plain_s, plain_acc = run_plain()
        ratios.append(hfl_s / plain_s)
        print(f"repeat {i}: hfl {hfl_s:.2f}s (acc {hfl_acc:.3f})  plain {plain_s:.2f}s (acc {plain_acc:.3f})  "
              f"ratio {ratios[-1]:.3f}", file=sys.stderr, flush=True)
    print(f"ratio={statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
