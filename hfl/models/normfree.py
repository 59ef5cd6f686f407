"""Pre-activation norm-free residual blocks (Brock, De and Smith, "Characterizing signal propagation to
close the performance gap in unnormalized ResNets", ICLR 2021: NF-ResNets).

A block computes h + α·F(h/β): the branch reads its input divided by β, the expected standard
deviation of the residual stream there, so that every branch starts from unit variance however deep
the stream has grown (by α² a block, reset at each stage's transition, whose projection shortcut reads
the scaled input too); ReLU comes first (pre-activation), so the stream itself is never rectified, the
stem ends in no ReLU and the head rectifies before pooling. The zero-initialised skip gain that lets
each block start as the identity is its last convolution's per-filter gain (NSConv's, `ns_affine`),
set to 0 by the method: a gain folded into the weight keeps no activation for backward, where a scalar
multiplying the branch's output would keep that output.

`preactivate_norm_free` switches a norm-free `ResNet` built with either block kind (post-activation
`BasicBlock`, `PreActBlock`) in place: the parameters and state keys stay those of the model as built.
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from hfl.models.base import ResidualBlock
from hfl.models.resnet import BasicBlock, PreActBlock, ResNet


class NormFreeBlock(ResidualBlock):
    """h + α·conv2(ReLU(conv1(ReLU(h/β)))), the shortcut h, or its projection of ReLU(h/β) where the
    block changes the feature shape; α the block's step (`fix_step_sizes`), β `beta`."""

    preactivated = True
    shortcut_modules = ("act", "shortcut")
    beta: float
    """The expected standard deviation of the block's input (`preactivate_norm_free`)."""

    def forward(self, x: Tensor) -> Tensor:
        out = self.act(x / self.beta)
        skip = x if self.shortcut is None else self.shortcut(out)
        if self.branch_skipped:
            return skip
        branch = self.conv2(self.act(self.conv1(out)))
        return self.scaled(branch, self.step) + skip


def preactivate_norm_free(model: ResNet, alpha: float) -> list[NormFreeBlock]:
    """Switch every block of `model`, a ResNet without norms (`model.norm=none`), to a `NormFreeBlock`
    in place, with β from the stream's expected variance: 1 after the stem and after each transition,
    growing by α² a block (α = 1 for unscaled branches); drop the stem's ReLU and rectify in the
    head. Returns the blocks, whose last convolutions' gains are the skip gains."""
    if not isinstance(model, ResNet) or model.norm != "none":
        raise ValueError(f"pre-activation norm-free blocks need a ResNet without norms, got {type(model).__name__} with norm {model.norm!r}")
    variance, blocks = 1.0, []
    for block in model.body:
        if not isinstance(block, (BasicBlock, PreActBlock)):
            raise ValueError(f"cannot make a {type(block).__name__} a norm-free pre-activation block")
        if isinstance(block.shortcut, nn.Identity):
            block.shortcut = None
        block.__class__ = NormFreeBlock
        block.beta = math.sqrt(variance)
        variance = (variance if block.shortcut is None else 1.0) + alpha**2
        blocks.append(block)
    if isinstance(model.stem, nn.Sequential):  # the post-activation stem: conv, (no) norm, ReLU
        model.stem[-1] = nn.Identity()
    model.head.act = nn.ReLU()
    return blocks
