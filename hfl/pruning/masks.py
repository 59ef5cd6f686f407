"""Prunable tensors and random initial masks with the Erdős–Rényi-Kernel (ERK) density split.

ERK (Evci et al., "Rigging the Lottery", ICML 2020) gives a layer of shape (c_out, c_in, k_h, k_w)
a density proportional to (c_out + c_in + k_h + k_w) / (c_out·c_in·k_h·k_w): small layers stay
denser, large ones carry most of the pruning. FedMef, FedTiny and FedDST start from such a mask.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor, nn

PRUNABLE_MODULES = (nn.Conv2d, nn.Linear)
"""Layers whose weight is pruned; their biases and every norm layer stay dense."""


def prunable_keys(model: nn.Module) -> list[str]:
    """State keys of the weights of the model's convolutions and linear layers, in model order."""
    return [f"{name}.weight" if name else "weight" for name, module in model.named_modules() if isinstance(module, PRUNABLE_MODULES)]


def erk_densities(shapes: Mapping[str, torch.Size], density: float) -> dict[str, float]:
    """Per key, the ERK density such that the kept entries over all tensors sum to `density` of
    their total. A layer whose ERK density would exceed 1 is kept dense and the others share the
    rest, repeated until none exceeds 1."""
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density must lie in [0, 1], got {density}")
    total = sum(math.prod(s) for s in shapes.values())
    raw = {k: sum(s) / math.prod(s) for k, s in shapes.items()}
    dense: set[str] = set()
    while True:
        budget = density * total - sum(math.prod(shapes[k]) for k in dense)
        spread = sum(raw[k] * math.prod(shapes[k]) for k in shapes if k not in dense)
        scale = budget / spread if spread else 0.0
        over = {k for k in shapes if k not in dense and scale * raw[k] > 1.0}
        if not over:
            return {k: 1.0 if k in dense else scale * raw[k] for k in shapes}
        dense |= over


def erk_counts(shapes: Mapping[str, torch.Size], sparsity: float) -> dict[str, int]:
    """Kept entries per key at overall `sparsity`: each layer's ERK density times its size, rounded
    to the nearest integer (so the total may differ from (1 - sparsity)·total by a few entries)."""
    densities = erk_densities(shapes, 1.0 - sparsity)
    return {k: round(densities[k] * math.prod(s)) for k, s in shapes.items()}


def random_masks(model: nn.Module, sparsity: float, generator: torch.Generator) -> dict[str, Tensor]:
    """{state key: bool mask} for every prunable weight: exactly the ERK count of entries kept per
    layer, their positions drawn uniformly from `generator`."""
    state = model.state_dict()
    shapes = {k: state[k].shape for k in prunable_keys(model)}
    masks = {}
    for key, count in erk_counts(shapes, sparsity).items():
        kept = torch.zeros(math.prod(shapes[key]), dtype=torch.bool)
        kept[torch.randperm(kept.numel(), generator=generator)[:count]] = True
        masks[key] = kept.view(shapes[key])
    return masks


def magnitude_masks(state: Mapping[str, Tensor], keys: list[str], sparsity: float) -> dict[str, Tensor]:
    """{key: bool mask} keeping, in each of `keys`, its ERK count of entries with the largest |θ|
    (one-shot L1 magnitude pruning at overall `sparsity`); ties go to the earlier entry."""
    counts = erk_counts({k: state[k].shape for k in keys}, sparsity)
    masks = {}
    for key, count in counts.items():
        kept = torch.zeros(state[key].numel(), dtype=torch.bool)
        kept[state[key].detach().abs().flatten().topk(count, sorted=False).indices] = True
        masks[key] = kept.view(state[key].shape)
    return masks
