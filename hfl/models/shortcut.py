"""A parameter-free path from a body block's output to the head (He et al., 2016, option A): what
FeDepth uses to reach the head from a block group that ends before the last block."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from hfl.models.base import ScalableModel


def skip_to_head(h: Tensor, head_shape: Sequence[int]) -> Tensor:
    """He et al.'s parameter-free shortcut from a group's output to the head's input shape
    (channels, height, width): strided subsampling, then zero channels appended. A sequence
    (channels, positions: the GPT's tokens) keeps every position."""
    channels, *extent = head_shape
    if len(extent) == 2:
        step_h, step_w = -(-h.shape[2] // extent[0]), -(-h.shape[3] // extent[1])
        if step_h > 1 or step_w > 1:
            h = h[:, :, ::step_h, ::step_w]
    if h.shape[1] > channels:
        raise ValueError(f"a group's output has {h.shape[1]} channels, more than the head's {channels}")
    return F.pad(h, (0, 0) * len(extent) + (0, channels - h.shape[1])) if h.shape[1] < channels else h


def block_output_shapes(model: ScalableModel, input_shape: Sequence[int], dtype: torch.dtype = torch.float32) -> list[tuple[int, ...]]:
    """(channels, height, width) (channels, sequence for tokens) after every body block, from a
    forward pass on the meta device of inputs of `input_shape` and `dtype`."""
    probe = copy.deepcopy(model).to("meta").eval()
    h = probe.stem(torch.empty(1, *input_shape, dtype=dtype, device="meta"))
    shapes = []
    for block in probe.body:
        h = block(h)
        shapes.append(tuple(h.shape[1:]))
    return shapes
