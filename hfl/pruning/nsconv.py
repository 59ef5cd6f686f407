"""Normalized sparse convolution (FedMef Eq. 6–7): filter-wise weight standardisation over the kept
entries only, for models without batch norm (ReLU → conv), so that outputs stay centred on zero and
scaled activation pruning drops little.

Eq. 7 reads θ̂ = γ·√c_in·(θ⊙m − μ)/σ, μ and σ the mean and population standard deviation of the
filter's kept entries, re-masked; the paper's convolution divides by c_in, so in a standard
convolution the effective weight is θ̂ / c_in = γ·(θ⊙m − μ)/(σ·√c_in). Which c_in: Theorem 1's proof
flattens a filter into a row and gets an output variance of γ²·E[x²] only if c_in is the number of
entries that row multiplies, its kept entries: with k kept entries of unit variance the output's
variance is k·γ²/c_in·E[x²]. So c_in here is the filter's kept-entry count k (for a dense filter, in_channels /
groups × k × k, Brock et al.'s scaled weight standardisation). Read as the whole filter's size, the
output variance shrinks by the layer's density (measured on a 3×3 layer: 0.94, 0.47, 0.19, 0.09
at density 1, 0.5, 0.2, 0.1), and a norm-free ResNet at s = 0.9 passes almost nothing through its
residual branches; read as the input channels alone, a 3×3 layer multiplies the variance by about
9·density·γ² and a ResNet-18 without norms diverges (tried: 11.7 % on CIFAR-10 after 10 rounds, where
FedTiny had 31 %).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

RELU_GAMMA = math.sqrt(2.0 / (1.0 - 1.0 / math.pi))
"""Default γ. The paper does not give one; this is the gain that restores unit variance after a ReLU
of a standard normal (Brock et al.'s scaled weight standardisation), the ReLU → conv case."""

_VARIANCE_FLOOR = 1e-5
"""Added to σ² so that a filter with one kept entry, or equal ones, does not divide by zero."""


def _filter_statistics(flat: Tensor, keep: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per row of `flat` (one filter each): the kept entries' count, mean and σ (population, floored)."""
    count = keep.sum(1, keepdim=True).clamp_min(1).to(flat.dtype)
    mean = (flat * keep).sum(1, keepdim=True) / count
    variance = (flat - mean).mul_(keep).square_().sum(1, keepdim=True) / count
    return count, mean, torch.sqrt(variance + _VARIANCE_FLOOR)


def _standardized(flat: Tensor, keep: Tensor, mean: Tensor, sigma: Tensor) -> Tensor:
    """(θ − μ)/σ at the kept entries, zero at the pruned ones."""
    return (flat - mean).div_(sigma).mul_(keep)


class _EffectiveWeight(torch.autograd.Function):
    """γ·g·(θ⊙m − μ)/(σ·√k) per filter (k its kept entries, g its learnable gain or 1), re-masked, with
    the backward of a standardisation written out (grad_θ = m·g·scale/σ·(G − mean(G) − z·mean(G·z)),
    means over the kept entries, z the standardised weight): it keeps nothing of weight size for
    backward (the weight and mask are resident, k, μ and σ are one number per filter) and recomputes
    z, where autograd through the formula would keep several weight-sized intermediates per layer."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor, mask: Tensor, gamma: float, gain: Tensor | None) -> Tensor:
        flat, keep = weight.flatten(1), mask.flatten(1)
        count, mean, sigma = _filter_statistics(flat, keep)
        ctx.save_for_backward(weight, mask, count, mean, sigma, gain)
        ctx.gamma = gamma
        scale = gamma / count.sqrt()
        if gain is not None:
            scale = scale * gain.unsqueeze(1)
        return _standardized(flat, keep, mean, sigma).mul_(scale).view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, Tensor | None]:
        weight, mask, count, mean, sigma, gain = ctx.saved_tensors
        grad_gain = None
        if gain is not None and ctx.needs_input_grad[3]:
            unit = _standardized(weight.flatten(1), mask.flatten(1), mean, sigma).mul_(ctx.gamma / count.sqrt())
            grad_gain = unit.mul_(grad.flatten(1)).sum(1)
            del unit
        grad_weight = standardization_backward(weight, mask, grad, ctx.gamma, (count, mean, sigma), gain)
        return grad_weight, None, None, grad_gain


def standardization_backward(
    weight: Tensor, mask: Tensor, grad: Tensor, gamma: float, statistics: tuple[Tensor, Tensor, Tensor] | None = None,
    gain: Tensor | None = None,
) -> Tensor:
    """The gradient with respect to `weight` of a loss whose gradient with respect to
    `effective_weight(weight, mask, gamma, gain)` is `grad`."""
    flat, keep = weight.flatten(1), mask.flatten(1)
    count, mean, sigma = statistics or _filter_statistics(flat, keep)
    z = _standardized(flat, keep, mean, sigma)
    g = grad.flatten(1) * keep
    if gain is not None:
        g.mul_(gain.unsqueeze(1))
    mean_g = g.sum(1, keepdim=True) / count
    mean_gz = (g * z).sum(1, keepdim=True) / count
    return g.sub_(mean_g).sub_(z.mul_(mean_gz)).mul_(keep).mul_(gamma / (count.sqrt() * sigma)).view_as(weight)


def kept_count(mask: Tensor) -> Tensor:
    """The paper's c_in per filter, shaped to broadcast over a weight: its kept entries (at least 1)."""
    return mask.flatten(1).sum(1).clamp_min(1).view(-1, *[1] * (mask.dim() - 1))


def standardized_filters(weight: Tensor, mask: Tensor, gamma: float = RELU_GAMMA) -> Tensor:
    """Eq. 7's θ̂ for a weight (c_out, c_in, k, k) or any (c_out, ...) tensor: per output filter,
    γ·√c_in·(θ⊙m − μ)/σ over the kept entries, zero at pruned ones (c_in its kept entries)."""
    return effective_weight(weight, mask, gamma) * kept_count(mask).to(weight.dtype)


def effective_weight(weight: Tensor, mask: Tensor, gamma: float = RELU_GAMMA, gain: Tensor | None = None) -> Tensor:
    """The weight a standard convolution applies for NSConv: θ̂ / c_in, each filter times its `gain`
    when one is given."""
    return _EffectiveWeight.apply(weight, mask, gamma, gain)


def applied_in_stored_units(weight: Tensor, mask: Tensor, gamma: float = RELU_GAMMA) -> Tensor:
    """θ̂ / c: the standardised weight NSConv applies (its gain aside), divided by its filter's scale
    c = γ/(σ√k) taken as a constant (no gradient flows through it): at the kept entries (θ − μ)
    (1 + O(1/k) in the gradient), so a penalty on it pulls θ̂ to 0 at the rate a penalty on θ pulls θ."""
    with torch.no_grad():
        count, _mean, sigma = _filter_statistics(weight.flatten(1), mask.flatten(1))
        scale = (gamma / (sigma * count.sqrt())).view(-1, *[1] * (weight.dim() - 1))
    return effective_weight(weight, mask, gamma) / scale


def grown_at_zero(weight: Tensor, before: Tensor, after: Tensor) -> Tensor:
    """`weight` with the entries `after` keeps and `before` did not (grown by a mask adjustment) set
    to their filter's mean over the entries both keep: that mean, and so every survivor's
    standardised value, is unchanged, and a grown entry's standardised value, what the convolution
    applies, is 0 (a stored 0 would apply −μ/σ)."""
    flat, kept, grown = weight.reshape(weight.shape[0], -1), (before & after).flatten(1), (after & ~before).flatten(1)
    _count, mean, _sigma = _filter_statistics(flat, kept)
    return torch.where(grown, mean.expand_as(flat), flat).view_as(weight)


class NSConv2d(nn.Conv2d):
    """A Conv2d that convolves with its NSConv effective weight. `mask` (same shape as the weight,
    all kept by default) is a non-persistent buffer: the state keys stay those of a Conv2d, and
    whoever loads weights into the model loads the masks with them (`load_masks`). With `affine`,
    each filter also has a learnable gain (state key `gain`, initially 1) and bias (initially 0), as
    the weight-standardised convolutions of NF-Nets (Brock et al. 2021): the standardisation fixes
    every filter's scale, and without norms nothing else could learn one."""

    mask: Tensor
    gamma: float
    gain: nn.Parameter | None
    held_weight: Tensor | None = None
    """While set (`applied_weights`), the weight the forward applies instead of computing it."""

    def __init__(self, *args: Any, gamma: float = RELU_GAMMA, affine: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _make_normalized(self, gamma, affine)

    def set_mask(self, mask: Tensor) -> None:
        self.mask.copy_(mask)

    def applied_weight(self) -> Tensor:
        if self.held_weight is not None:
            return self.held_weight
        return effective_weight(self.weight, self.mask, self.gamma, self.gain)

    def forward(self, x: Tensor) -> Tensor:
        return self._conv_forward(x, self.applied_weight(), self.bias)


def _make_normalized(conv: nn.Conv2d, gamma: float, affine: bool) -> None:
    """Give `conv` what an NSConv2d holds beyond a Conv2d's parameters."""
    conv.gamma = gamma
    conv.register_buffer("mask", torch.ones_like(conv.weight, dtype=torch.bool), persistent=False)
    like = {"dtype": conv.weight.dtype, "device": conv.weight.device}
    conv.register_parameter("gain", nn.Parameter(torch.ones(conv.out_channels, **like)) if affine else None)
    if affine and conv.bias is None:
        conv.bias = nn.Parameter(torch.zeros(conv.out_channels, **like))


def normalize_convolutions(model: nn.Module, gamma: float = RELU_GAMMA, affine: bool = False) -> nn.Module:
    """Switch every plain Conv2d of `model` (in place) to an NSConv2d with all entries kept, keeping
    its parameters and state keys (with `affine`, adding a gain per filter and a bias where it had
    none); returns `model`."""
    for module in model.modules():
        if type(module) is nn.Conv2d:
            # The class changes, the object stays: parents, parameters and hooks still point at it.
            module.__class__ = NSConv2d
            _make_normalized(module, gamma, affine)
    return model


def load_masks(model: nn.Module, masks: Mapping[str, Tensor]) -> None:
    """Give every NSConv2d of `model` the mask of its weight's state key in `masks` (all entries
    kept where `masks` has none): the masks an NSConv forward standardises over must be those of the
    weights just loaded. A no-op for models without NSConv."""
    for name, module in model.named_modules():
        if isinstance(module, NSConv2d):
            mask = masks.get(f"{name}.weight" if name else "weight")
            if mask is None:
                module.mask.fill_(True)
            else:
                module.set_mask(mask)


@contextmanager
def applied_weights(model: nn.Module) -> Iterator[dict[str, Tensor]]:
    """Within the block, every NSConv2d applies a fixed copy of its effective weight, a leaf that
    requires grad; yields those leaves by weight state key. The gradient with respect to them is the
    dense one, pruned entries included, that prune-and-grow reads (the gradient with respect to the
    stored weight is zero at pruned entries, which the standardisation masks)."""
    held = {}
    for name, module in model.named_modules():
        if isinstance(module, NSConv2d):
            module.held_weight = module.applied_weight().detach().requires_grad_(True)
            held[f"{name}.weight" if name else "weight"] = module.held_weight
    try:
        yield held
    finally:
        for module in model.modules():
            if isinstance(module, NSConv2d):
                module.held_weight = None
