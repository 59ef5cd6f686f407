"""Scaled activation pruning (FedMef §3.4): Conv2d and Linear layers whose forward is dense but whose
copy of the input kept for backward holds only the top ⌊(1 − s)·numel⌋ entries by magnitude.

The copy is stored compressed, values and int32 positions (int64 beyond 2³¹ entries), not as a
dense tensor of zeros, so autograd's saved-tensor hooks, and with them hfl's accountant, see the
smaller storage. In backward the weight gradient comes from the sparse copy; the input gradient
needs only the weight and is exact.

The saving is real only where nothing else keeps the dense input: a plain ReLU before the layer
keeps its own output for its backward, so in a ReLU → Conv model that storage would stay alive
whatever the conv saves. `prune_activations(..., relu_masks=True)` also switches ReLUs to `MaskReLU`,
which keeps a boolean mask of the positive entries (one byte per entry) instead of its float output:
cheaper where a conv or linear layer is the only other holder of the ReLU's output, dearer by the
mask where another layer (pooling) keeps that output anyway. Choosing the
entries (their magnitudes) and rebuilding the dense copy in backward are transients of one layer's
input, so the peak drops once several layers' inputs would be alive.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hfl.pruning.nsconv import (
    NSConv2d,
    effective_weight,
    standardization_backward,
)


def kept_entries(numel: int, sparsity: float) -> int:
    """⌊(1 − s)·numel⌋, the entries of an input SAP keeps for backward."""
    return math.floor((1.0 - sparsity) * numel)


def compress_top(x: Tensor, sparsity: float) -> tuple[Tensor, Tensor]:
    """(values, flat positions) of the ⌊(1 − s)·numel⌋ entries of largest |x|."""
    flat = x.detach().flatten()
    positions = torch.topk(flat.abs(), kept_entries(flat.numel(), sparsity), sorted=False).indices
    index_dtype = torch.int32 if flat.numel() < 2**31 else torch.int64
    return flat[positions], positions.to(index_dtype)


def decompress(values: Tensor, positions: Tensor, shape: torch.Size) -> Tensor:
    """The dense tensor of `shape` holding `values` at `positions` and zeros elsewhere."""
    out = torch.zeros(shape.numel(), dtype=values.dtype, device=values.device)
    out[positions.long()] = values
    return out.view(shape)


class _PrunedInputConv2d(torch.autograd.Function):
    """The convolution of SAP. With a `mask` it is an NSConv: the effective weight (`effective_weight`)
    is computed in forward and again in backward, never kept, so that what stays alive for backward
    is the compressed input alone (the raw weight and the mask are resident anyway)."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, conv: nn.Conv2d, sparsity: float, mask: Tensor | None = None,
        gamma: float = 1.0, gain: Tensor | None = None,
    ) -> Tensor:
        values, positions = compress_top(x, sparsity)
        ctx.save_for_backward(values, positions, weight, mask, gain)
        ctx.shape, ctx.conv, ctx.has_bias, ctx.gamma = x.shape, conv, bias is not None, gamma
        applied = weight if mask is None else effective_weight(weight, mask, gamma, gain)
        return F.conv2d(x, applied, bias, conv.stride, conv.padding, conv.dilation, conv.groups)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        values, positions, weight, mask, gain = ctx.saved_tensors
        conv = ctx.conv
        args = (conv.stride, conv.padding, conv.dilation, conv.groups)
        grad_x = None
        if ctx.needs_input_grad[0]:
            applied = weight if mask is None else effective_weight(weight, mask, ctx.gamma, gain)
            grad_x = torch.nn.grad.conv2d_input(ctx.shape, applied, grad_out, *args)
            del applied
        grad_w = grad_gain = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[7]:
            grad_w = torch.nn.grad.conv2d_weight(decompress(values, positions, ctx.shape), weight.shape, grad_out, *args)
            if mask is not None:  # through the gain and the standardisation to the stored weight
                if gain is not None and ctx.needs_input_grad[7]:
                    grad_gain = effective_weight(weight, mask, ctx.gamma).mul_(grad_w).flatten(1).sum(1)
                grad_w = standardization_backward(weight, mask, grad_w, ctx.gamma, gain=gain)
            if not ctx.needs_input_grad[1]:
                grad_w = None
        grad_b = grad_out.sum((0, 2, 3)) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None, None, grad_gain


class _PrunedInputLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, sparsity: float) -> Tensor:
        values, positions = compress_top(x, sparsity)
        ctx.save_for_backward(values, positions, weight)
        ctx.shape, ctx.has_bias = x.shape, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        values, positions, weight = ctx.saved_tensors
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            x = decompress(values, positions, ctx.shape)
            grad_w = grad_out.reshape(-1, grad_out.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


class ActivationPrunedConv2d(nn.Conv2d):
    """A Conv2d that keeps a top-k compressed copy of its input for backward (`sparsity` dropped)."""

    activation_sparsity: float

    def forward(self, x: Tensor) -> Tensor:
        if not torch.is_grad_enabled():
            return super().forward(x)
        return _PrunedInputConv2d.apply(x, self.weight, self.bias, self, self.activation_sparsity)


class ActivationPrunedNSConv2d(ActivationPrunedConv2d, NSConv2d):
    """An NSConv2d whose input is pruned like ActivationPrunedConv2d's (FedMef's SAP with NSConv):
    the convolution applies the normalised effective weight and keeps only the compressed input."""

    def forward(self, x: Tensor) -> Tensor:
        if not torch.is_grad_enabled():
            return NSConv2d.forward(self, x)
        if self.held_weight is not None:
            return _PrunedInputConv2d.apply(x, self.held_weight, self.bias, self, self.activation_sparsity)
        return _PrunedInputConv2d.apply(x, self.weight, self.bias, self, self.activation_sparsity, self.mask, self.gamma, self.gain)


class ActivationPrunedLinear(nn.Linear):
    """A Linear that keeps a top-k compressed copy of its input for backward (`sparsity` dropped)."""

    activation_sparsity: float

    def forward(self, x: Tensor) -> Tensor:
        if not torch.is_grad_enabled():
            return super().forward(x)
        return _PrunedInputLinear.apply(x, self.weight, self.bias, self.activation_sparsity)


class _MaskReLUFunction(torch.autograd.Function):
    """ReLU that saves which entries were positive (bool), not its output: the gradient needs no more."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        positive = x > 0
        ctx.save_for_backward(positive)
        return x * positive

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (positive,) = ctx.saved_tensors
        return grad * positive


class MaskReLU(nn.ReLU):
    """An nn.ReLU whose backward keeps a boolean mask instead of the float output (never in place:
    the output is a new tensor, so the input may be freed)."""

    def forward(self, x: Tensor) -> Tensor:
        return _MaskReLUFunction.apply(x) if torch.is_grad_enabled() and x.requires_grad else F.relu(x, inplace=self.inplace)


_PRUNED = {nn.Conv2d: ActivationPrunedConv2d, NSConv2d: ActivationPrunedNSConv2d, nn.Linear: ActivationPrunedLinear}


def prune_activations(model: nn.Module, sparsity: float, relu_masks: bool = False, relu_conv_only: bool = False) -> nn.Module:
    """Switch every Conv2d (NSConv2d included) and Linear of `model` (in place) to its activation-pruned twin, keeping
    their parameters, state keys and hooks (with `relu_masks`, every ReLU to `MaskReLU` too); returns
    `model`. Layers already switched take the new `sparsity`. With `relu_conv_only`, only the
    convolutions after the model's first are switched: the first reads the model's input (an image,
    not a ReLU's output) and the linear layers read pooled features, so their gradients stay exact."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"activation sparsity must lie in [0, 1), got {sparsity}")
    first_conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    for module in model.modules():
        pruned = _PRUNED.get(type(module))
        if relu_conv_only and (module is first_conv or isinstance(module, nn.Linear)):
            pruned = None
        if pruned is ActivationPrunedConv2d and (module.padding_mode != "zeros" or isinstance(module.padding, str)):
            raise ValueError(f"scaled activation pruning needs numeric zero padding, got {module.padding_mode!r} / {module.padding!r}")
        if relu_masks and type(module) is nn.ReLU:
            pruned = MaskReLU
        if pruned is not None:
            # The class changes, the object stays: parents, parameters and hooks still point at it.
            module.__class__ = pruned
        if isinstance(module, (ActivationPrunedConv2d, ActivationPrunedLinear)):
            module.activation_sparsity = sparsity
    return model
