"""The baseline of the benchmarks: FedAvg written by hand in plain PyTorch, importing no hfl.

Digits (scikit-learn), the same 80/20 split size, 100 IID clients, 10 per round, 5 local epochs,
batch 8, SGD lr 0.05, the same small CNN (conv 32 - pool - conv 64 - pool - mean - linear),
evaluation every round.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROUNDS, CLIENTS, PER_ROUND, EPOCHS, BATCH, LR = 20, 100, 10, 5, 8, 0.05


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )


def local_sgd(model: nn.Module, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, epochs: int, batch_size: int, lr: float) -> None:
    """One client's training: plain SGD over its samples `idx`, reshuffled every epoch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        shuffled = idx[torch.randperm(len(idx))].to(x.device)
        for b in range(0, len(shuffled), batch_size):
            batch = shuffled[b : b + batch_size]
            optimizer.zero_grad()
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()


def fedavg_round(model: nn.Module, global_state: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                 client_indices: list[torch.Tensor], epochs: int, batch_size: int, lr: float) -> dict[str, torch.Tensor]:
    """One FedAvg round: each client trains from the global state; the sample-weighted mean of their
    states (averaged in float32, so integer buffers such as batch norm's counters average too)."""
    total = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in global_state.items()}
    weight = 0
    for idx in client_indices:
        model.load_state_dict(global_state)
        local_sgd(model, x, y, idx, epochs, batch_size, lr)
        for k, v in model.state_dict().items():
            total[k] += v.float() * len(idx)
        weight += len(idx)
    return {k: (v / weight).to(global_state[k].dtype) for k, v in total.items()}


def run_plain(seed: int = 0, device: str = "cpu", rounds: int = ROUNDS) -> tuple[float, float, list[float]]:
    """(seconds, final accuracy, seconds of each round: from its start to the next round's start,
    the last to the end of the loop, so that every round's work is counted, evaluation included)."""
    start = time.perf_counter()
    from sklearn.datasets import load_digits  # here, not at the top: hfl's side imports this module's constants

    digits = load_digits()
    x_all = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16
    y_all = torch.tensor(digits.target)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(y_all), generator=gen)
    n_test = int(0.2 * len(y_all))
    test, train = order[:n_test], order[n_test:]
    mean, std = x_all[train].mean(), x_all[train].std()
    x, y = ((x_all[train] - mean) / std).to(device), y_all[train].to(device)
    x_test, y_test = ((x_all[test] - mean) / std).to(device), y_all[test].to(device)
    parts = torch.randperm(len(y), generator=gen)[: len(y) // CLIENTS * CLIENTS].view(CLIENTS, -1)
    torch.manual_seed(seed)
    model = small_cnn().to(device)
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = np.random.default_rng(seed)
    starts = []
    for _ in range(rounds):
        starts.append(time.perf_counter())
        global_state = fedavg_round(model, global_state, x, y, [parts[c] for c in rng.choice(CLIENTS, PER_ROUND, replace=False)],
                                    EPOCHS, BATCH, LR)
        model.load_state_dict(global_state)
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    end = time.perf_counter()
    return end - start, accuracy, [b - a for a, b in zip(starts, [*starts[1:], end])]
