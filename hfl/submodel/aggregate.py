"""The masked weighted mean shared by every sub-model method.

new = sum_i w_i * scatter(u_i) / sum_i w_i * scatter(1_i); entries no client held keep their value.
With full-model updates this is FedAvg's weighted average, computed by the same code path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from hfl.submodel.spec import _region
from hfl.types import ClientUpdate


def masked_weighted_mean(global_state: Mapping[str, Tensor], updates: Iterable[ClientUpdate]) -> dict[str, Tensor]:
    """Average every entry over the clients that held it, weighted by `update.weight`."""
    sums: dict[str, Tensor] = {}
    full_weight: dict[str, float] = {}  # weight of updates that covered a whole tensor, kept as a scalar
    partial_weight: dict[str, Tensor] = {}  # element-wise weight of partial updates, only when needed
    counters: dict[str, Tensor] = {}  # integer buffers (e.g. BN's num_batches_tracked): take the max
    for update in updates:
        spec, w = update.spec, float(update.weight)
        for client_key, value in update.state.items():
            key = spec.global_key(client_key)
            old = global_state[key]
            value = value.to(old.device)  # updates from remote workers arrive on their own device
            if not old.is_floating_point():
                counters[key] = torch.maximum(counters[key], value) if key in counters else value.clone()
                continue
            acc = sums.get(key)
            if acc is None:
                acc = sums[key] = torch.zeros_like(old)
            dims, mask = spec.indices.get(client_key), spec.masks.get(client_key)
            if not dims and mask is None:
                acc.add_(value.to(old.dtype), alpha=w)
                full_weight[key] = full_weight.get(key, 0.0) + w
                continue
            region = _region(old.shape, dims or {})
            held = mask.to(old.device, old.dtype) if mask is not None else torch.ones_like(value, dtype=old.dtype)
            if isinstance(region[0], slice) or not region:
                acc[region] += w * value * held
            else:
                acc.index_put_(region, w * value * held, accumulate=True)
            weight = partial_weight.get(key)
            if weight is None:
                weight = partial_weight[key] = torch.zeros_like(old)
            if isinstance(region[0], slice) or not region:
                weight[region] += w * held
            else:
                weight.index_put_(region, w * held, accumulate=True)
    new = dict(global_state)
    for key, acc in sums.items():
        if key not in partial_weight:
            new[key] = acc / full_weight[key]
            continue
        weight = partial_weight[key] + full_weight.get(key, 0.0)
        new[key] = torch.where(weight > 0, acc / weight.clamp_min(1e-30), global_state[key])
    new.update(counters)
    return new
