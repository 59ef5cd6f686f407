"""Normalized sparse convolution (FedMef Eq. 6–7): filter-wise weight standardisation over the kept
entries only, for models without batch norm (ReLU → conv), so that outputs stay centred on zero and
scaled activation pruning drops little.

Eq. 7 reads θ̂ = γ·√c_in·(θ⊙m − μ)/σ, μ and σ the mean and population standard deviation of the
filter's kept entries, re-masked; the paper's convolution divides by c_in, so in a standard
convolution the effective weight is θ̂ / c_in = γ·(θ⊙m − μ)/(σ·√c_in). c_in is the input channels
one filter sees (in_channels / groups: 1 for a depthwise convolution).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

RELU_GAMMA = math.sqrt(2.0 / (1.0 - 1.0 / math.pi))
"""Default γ. The paper does not give one; this is the gain that restores unit variance after a ReLU
of a standard normal (Brock et al.'s scaled weight standardisation), the ReLU → conv case."""

_VARIANCE_FLOOR = 1e-5
"""Added to σ² so that a filter with one kept entry, or equal ones, does not divide by zero."""


def standardized_filters(weight: Tensor, mask: Tensor, gamma: float = RELU_GAMMA) -> Tensor:
    """Eq. 7's θ̂ for a weight (c_out, c_in, k, k) or any (c_out, ...) tensor: per output filter,
    γ·√c_in·(θ⊙m − μ)/σ over the kept entries, zero at pruned ones."""
    flat, keep = weight.flatten(1), mask.flatten(1).to(weight.dtype)
    count = keep.sum(1, keepdim=True).clamp_min(1.0)
    mean = (flat * keep).sum(1, keepdim=True) / count
    variance = (((flat - mean) * keep) ** 2).sum(1, keepdim=True) / count
    c_in = weight.shape[1]
    normed = gamma * math.sqrt(c_in) * (flat * keep - mean) / torch.sqrt(variance + _VARIANCE_FLOOR)
    return (normed * keep).view_as(weight)


def effective_weight(weight: Tensor, mask: Tensor, gamma: float = RELU_GAMMA) -> Tensor:
    """The weight a standard convolution applies for NSConv: θ̂ / c_in."""
    return standardized_filters(weight, mask, gamma) / weight.shape[1]


class NSConv2d(nn.Conv2d):
    """A Conv2d that convolves with its NSConv effective weight. `mask` (same shape as the weight,
    all kept by default) is a non-persistent buffer: the state keys stay those of a Conv2d, and the
    method that owns the masks sets it with `set_mask` whenever the mask changes."""

    mask: Tensor

    def __init__(self, *args: Any, gamma: float = RELU_GAMMA, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gamma = gamma
        self.register_buffer("mask", torch.ones_like(self.weight, dtype=torch.bool), persistent=False)

    def set_mask(self, mask: Tensor) -> None:
        self.mask.copy_(mask)

    def forward(self, x: Tensor) -> Tensor:
        return self._conv_forward(x, effective_weight(self.weight, self.mask, self.gamma), self.bias)
