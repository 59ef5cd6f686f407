"""The heavier baseline: FedAvg written by hand in plain PyTorch on PreResNet-20 and 32x32 images.

20 IID clients of 500 images each, 4 per round, 1 local epoch, batch 32, SGD lr 0.05, evaluation on
2,000 test images every 5th round and in the last one. The model is hfl's `preresnet20` (batch norm),
imported alone so both sides run the same layers; nothing else of hfl is used. The images are
seeded random tensors of CIFAR-10's shape: this baseline times the work, and a convolution costs
the same whatever the pixels hold (hfl's side of ray_scaling.py trains on CIFAR-10 classes 0 and 1).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from plain_fedavg import fedavg_round

from hfl.models.resnet import preresnet20

ROUNDS, CLIENTS, PER_ROUND, SAMPLES, EPOCHS, BATCH, LR, EVAL_EVERY, TEST = 8, 20, 4, 500, 1, 32, 0.05, 5, 2000


def run_plain(seed: int = 0, rounds: int = ROUNDS) -> tuple[float, float, list[float]]:
    """(seconds, final accuracy, seconds of each round from its start to the next round's start)."""
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(CLIENTS * SAMPLES, 3, 32, 32, generator=gen)
    y = torch.randint(0, 2, (CLIENTS * SAMPLES,), generator=gen)
    x_test, y_test = torch.randn(TEST, 3, 32, 32, generator=gen), torch.randint(0, 2, (TEST,), generator=gen)
    parts = torch.randperm(len(y), generator=gen).view(CLIENTS, SAMPLES)
    torch.manual_seed(seed)
    model = preresnet20(3, 2, norm="bn")
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = np.random.default_rng(seed)
    starts, accuracy = [], float("nan")
    for r in range(1, rounds + 1):
        starts.append(time.perf_counter())
        global_state = fedavg_round(model, global_state, x, y, [parts[c] for c in rng.choice(CLIENTS, PER_ROUND, replace=False)],
                                    EPOCHS, BATCH, LR)
        if r % EVAL_EVERY == 0 or r == rounds:
            model.load_state_dict(global_state)
            model.eval()
            with torch.no_grad():
                accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    end = time.perf_counter()
    return end - start, accuracy, [b - a for a, b in zip(starts, [*starts[1:], end])]
