"""Which entries a dynamic sparse method marks, drops, grows and reports, per prunable layer.

Every function takes `counts`, the ξ of each layer (see `schedules.adjustment_count`), and
works on the keys of `masks` only: biases and norms have no mask and are never touched.
Ties in magnitude fall to `torch.topk`'s order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor


def _smallest_active(weight: Tensor, mask: Tensor, count: int) -> Tensor:
    score = weight.abs().flatten().masked_fill(~mask.flatten(), float("inf"))
    return torch.topk(score, count, largest=False).indices


def _largest_inactive(gradient: Tensor, mask: Tensor, count: int) -> Tensor:
    score = gradient.abs().flatten().masked_fill(mask.flatten(), -float("inf"))
    return torch.topk(score, count).indices


def _flat_mask(like: Tensor, positions: Tensor) -> Tensor:
    out = torch.zeros(like.numel(), dtype=torch.bool, device=like.device)
    out[positions] = True
    return out.view(like.shape)


def droppable(mask: Tensor, count: int) -> int:
    """ξ as the server applies it to a layer: at most its pruned entries, which are all that can grow
    back in their place (none in a layer ERK keeps dense)."""
    return min(count, mask.numel() - int(mask.sum()))


def lowest_magnitude(weights: Mapping[str, Tensor], masks: Mapping[str, Tensor], counts: Mapping[str, int]) -> dict[str, Tensor]:
    """FedMef's θ_low as masks: per layer the kept entries of smallest |θ| that the server will drop
    next (`droppable` of `counts[key]`), which budget-aware extrusion shrinks."""
    return {k: _flat_mask(m, _smallest_active(weights[k], m, droppable(m, counts[k]))) for k, m in masks.items()}


def prune_and_grow(
    weights: Mapping[str, Tensor], masks: Mapping[str, Tensor], gradients: Mapping[str, Tensor], counts: Mapping[str, int],
    magnitudes: Mapping[str, Tensor] | None = None,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The server's mask adjustment (FedTiny, FedMef): per layer drop the ξ kept entries of smallest
    |θ̄| (of `magnitudes[key]` where given: what the layer applies, FedMef's θ̂) and grow the ξ pruned
    entries of largest |ḡ|, θ̄ and ḡ the averaged weights and gradients.
    Returns (new masks, weights with dropped entries zeroed and grown ones set to 0). Only entries
    pruned before the adjustment can grow (they are the ones clients report gradients for), and ξ is
    capped by the number of pruned entries, so each layer keeps its count of kept entries."""
    new_masks, new_weights = {}, dict(weights)
    for key, mask in masks.items():
        count = droppable(mask, counts[key])
        new = mask.clone()
        flat = new.view(-1)
        flat[_smallest_active((magnitudes or weights)[key], mask, count)] = False
        flat[_largest_inactive(gradients[key], mask, count)] = True
        new_masks[key] = new
        new_weights[key] = weights[key] * (new & mask)  # grown entries start at 0
    return new_masks, new_weights


@dataclass(frozen=True)
class SparseGradient:
    """Gradient entries a client uploads: values at flat indices of a tensor of `shape`."""

    values: Tensor
    indices: Tensor
    """int64 positions in the flattened tensor."""
    shape: torch.Size

    def dense(self) -> Tensor:
        out = torch.zeros(self.shape.numel(), dtype=self.values.dtype, device=self.values.device)
        out[self.indices] = self.values
        return out.view(self.shape)


def top_pruned_gradients(gradients: Mapping[str, Tensor], masks: Mapping[str, Tensor], counts: Mapping[str, int]) -> dict[str, SparseGradient]:
    """What a FedTiny/FedMef client uploads for growing: per layer, among the pruned entries, the
    `counts[key]` entries of largest |gradient| of one batch's dense gradient."""
    out = {}
    for key, mask in masks.items():
        gradient = gradients[key]
        indices = _largest_inactive(gradient, mask, min(counts[key], mask.numel() - int(mask.sum())))
        out[key] = SparseGradient(gradient.flatten()[indices], indices, gradient.shape)
    return out
