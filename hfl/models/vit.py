"""A small Vision Transformer for CIFAR- and digits-sized inputs.

Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words"; global average pooling over the tokens
instead of a class token, as in Beyer et al. 2022, "Better plain ViT baselines for ImageNet-1k".
`stem` embeds patches and adds a learned position embedding, `body` holds pre-norm encoder blocks
(x + attn(LN(x)), then x + mlp(LN(x))), `head` is the mean over tokens, LayerNorm and a linear layer
(timm's ViT with average pooling). Between blocks the tokens travel as a channels-first map
(batch, dim, rows, columns), the layout of the convolutional models' features, so exits, block-wise
training and anything else reading (C, H, W) features treat the ViT like the others; a block views
the map as tokens (batch, rows * columns, dim) without copying.

Width scales the embedding dimension, as NeFL does for ViTs (Kang et al., appendix B.2). Channel
groups: `embed` is the residual stream (patch and position embeddings, every LayerNorm, every
projection into or out of the stream, the classifier's input); each block's attention has its own
group `body.{i}.attn` (the outputs of separate q, k, v projections and the input of the output
projection) and its MLP `body.{i}.mlp` (the hidden units). Every width keeps all heads and narrows
each: channel c of q, k and v is dimension c // heads of head c % heads, so the first n channels hold
the first dimensions of every head, and a width slice of a block is the same heads, each narrower.
Every encoder block keeps the token shape, so depth scaling may skip any of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hfl.errors import ConfigError
from hfl.models.base import ResidualBlock, ScalableModel
from hfl.registry import MODELS

BATCH_NORMS = ("bn", "static_bn")
"""The `norm` values the ViT accepts: batch-norm kinds, which its layer norms leave unchanged."""


class PositionEmbedding(nn.Module):
    """A learned embedding per patch position, stored as (dim, grid, grid) so dim 0 is the channel."""

    channel_dim = 0
    """The dimension of its output that indexes channels: unlike a layer's, the output has no batch."""

    def __init__(self, dim: int, grid: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(nn.init.trunc_normal_(torch.empty(dim, grid, grid), std=0.02))

    def forward(self, size: tuple[int, int]) -> Tensor:
        """The embedding on a (rows, columns) patch grid, resampled when the input is not the
        size the model was built for (as timm's ViTs do for a new resolution); the antialiasing
        filter lets every stored position contribute when shrinking, e.g. to digits' 2x2 grid."""
        if tuple(size) == tuple(self.weight.shape[1:]):
            return self.weight
        return F.interpolate(self.weight[None], size=size, mode="bilinear", align_corners=False, antialias=True)[0]


class PatchEmbedding(nn.Module):
    """Non-overlapping patches, linearly embedded (a strided conv), plus the position embedding;
    returns the map (batch, dim, rows, columns) of patch tokens."""

    def __init__(self, model: ScalableModel, in_channels: int, dim: int, patch_size: int, grid: int, group: str) -> None:
        super().__init__()
        self.proj = model.couple(nn.Conv2d(in_channels, dim, patch_size, stride=patch_size), None, group)
        self.position = model.couple(PositionEmbedding(dim, grid), None, group)

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj(x)
        return h + self.position(h.shape[-2:])


class Attention(nn.Module):
    """Multi-head self-attention with separate q, k, v projections whose channels interleave the
    heads (channel c: dimension c // heads of head c % heads).

    When the width leaves a channel count that `heads` does not divide, the first heads keep one
    dimension more than the others; the shorter ones are zero-padded, which adds nothing to their
    scores, and the padded outputs are dropped. Scores are scaled by 1/sqrt(mean head dimension)."""

    def __init__(self, model: ScalableModel, dim: int, inner: int, heads: int, groups: tuple[str, str]) -> None:
        super().__init__()
        gembed, gattn = groups
        self.heads = heads
        self.q = model.couple(nn.Linear(dim, inner), gembed, gattn)
        self.k = model.couple(nn.Linear(dim, inner), gembed, gattn)
        self.v = model.couple(nn.Linear(dim, inner), gembed, gattn)
        self.proj = model.couple(nn.Linear(inner, dim), gattn, gembed)
        self.scale = self.scale_at(inner)

    def scale_at(self, channels: int) -> float:
        """The score scale of this attention with `channels` q and k channels: a masked wider
        attention (FjORD's ordered dropout) computes the narrow one's scores with it."""
        return (channels / self.heads) ** -0.5

    def _split(self, t: Tensor) -> Tensor:
        """(batch, tokens, channels) -> (batch, heads, tokens, head dim)."""
        b, n, c = t.shape
        d = -(-c // self.heads)
        if d * self.heads != c:
            t = F.pad(t, (0, d * self.heads - c))
        return t.reshape(b, n, d, self.heads).permute(0, 3, 1, 2)

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        inner = self.q.out_features
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        # Plain matmuls rather than scaled_dot_product_attention: the cost accounting measures what
        # autograd saves and counts FLOPs by op, the same on every device.
        weights = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        out = (weights @ v).permute(0, 2, 3, 1).reshape(b, n, -1)
        return self.proj(out[..., :inner])


class MLP(nn.Module):
    """Linear - GELU - linear, the hidden units one channel group."""

    def __init__(self, model: ScalableModel, dim: int, hidden: int, groups: tuple[str, str]) -> None:
        super().__init__()
        gembed, gmlp = groups
        self.fc1 = model.couple(nn.Linear(dim, hidden), gembed, gmlp)
        self.act = nn.GELU()
        self.fc2 = model.couple(nn.Linear(hidden, dim), gmlp, gembed)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderBlock(ResidualBlock):
    """Pre-norm transformer block on a (batch, dim, rows, columns) map of tokens:
    x + s_attn * attn(LN(x)), then x + s_mlp * mlp(LN(x))."""

    step_names = ("attn_step", "mlp_step")

    def __init__(self, model: ScalableModel, dim: int, inner: int, hidden: int, heads: int, groups: tuple[str, str, str]) -> None:
        super().__init__()
        gembed, gattn, gmlp = groups
        self.norm1 = model.couple(nn.LayerNorm(dim, eps=1e-6), None, gembed)
        self.attn = Attention(model, dim, inner, heads, (gembed, gattn))
        self.norm2 = model.couple(nn.LayerNorm(dim, eps=1e-6), None, gembed)
        self.mlp = MLP(model, dim, hidden, (gembed, gmlp))

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)
        t = t + self.scaled(self.attn(self.norm1(t)), self.attn_step)
        t = t + self.scaled(self.mlp(self.norm2(t)), self.mlp_step)
        # Tokens are laid out (position, channel) in memory, so this is a view, as is the next
        # block's flatten + transpose.
        return t.transpose(1, 2).reshape(b, c, h, w)


class TokenClassifier(nn.Module):
    """The mean over tokens, LayerNorm and a linear classifier: the head and every early exit."""

    def __init__(self, model: ScalableModel, group: str, dim: int, num_classes: int) -> None:
        super().__init__()
        self.norm = model.couple(nn.LayerNorm(dim, eps=1e-6), None, group)
        self.fc = model.couple(nn.Linear(dim, num_classes), group, None)

    def forward(self, h: Tensor) -> Tensor:
        return self.fc(self.norm(h.mean(dim=(2, 3))))


def init_weights(module: nn.Module) -> None:
    """timm's ViT initialisation: truncated-normal linear weights (std 0.02), zero biases."""
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        nn.init.zeros_(module.bias)


class ViT(ScalableModel):
    """Patch embedding + position embedding, `depth` pre-norm encoder blocks, token mean + LayerNorm + linear.

    `norm` is accepted for the common builder signature: the ViT normalises with LayerNorm, which
    keeps no running statistics, so 'bn' and 'static_bn' build the same model ('none' is refused). The position
    embedding is learned for `image_size` inputs and resampled for others."""

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        width: float = 1.0,
        norm: str = "bn",
        patch_size: int = 4,
        dim: int = 192,
        depth: int = 6,
        heads: int = 3,
        mlp_ratio: float = 4.0,
        image_size: int = 32,
    ) -> None:
        super().__init__(width, num_classes, norm, head_norm=False)
        if norm not in BATCH_NORMS:
            # The layer norms are part of the architecture: 'none' removes batch norm, which the ViT has none of.
            raise ConfigError("model.norm", norm, f"one of {', '.join(BATCH_NORMS)} for the ViT (they build the same model)")
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads})")
        if not 1 <= patch_size <= image_size:
            raise ValueError(f"patch_size must be in 1..image_size ({image_size}), got {patch_size}")
        if depth < 1 or mlp_ratio <= 0:
            raise ValueError(f"depth must be >= 1 and mlp_ratio > 0, got {depth} and {mlp_ratio}")
        self.heads = heads
        embed = self.channels("embed", dim)
        self.stem = PatchEmbedding(self, in_channels, embed, patch_size, image_size // patch_size, "embed")
        blocks = []
        for i in range(depth):
            gattn, gmlp = f"body.{i}.attn", f"body.{i}.mlp"
            inner, hidden = self.channels(gattn, dim), self.channels(gmlp, round(dim * mlp_ratio))
            blocks.append(EncoderBlock(self, embed, inner, hidden, heads, ("embed", gattn, gmlp)))
            self.declare_block("embed", "embed", droppable=True)
        self.body = nn.ModuleList(blocks)
        self.head = TokenClassifier(self, "embed", embed, num_classes)
        self.apply(init_weights)

    def exit_classifier(self, name: str, group: str, target_bases: Sequence[int]) -> nn.Module:
        """A token classifier like the head. Every block keeps the stream's width, so there is
        nothing to down-sample to: a 'bottleneck' exit is the same classifier."""
        if target_bases:
            raise NotImplementedError(f"{name}: a ViT exit cannot down-sample to other channel groups")
        exit_head = TokenClassifier(self, group, self.group_channels(group), self.num_classes)
        exit_head.apply(init_weights)
        return exit_head


@MODELS.register("vit")
def vit(in_channels: int, num_classes: int, width: float = 1.0, norm: str = "bn") -> ViT:
    """A 6-block ViT with 4x4 patches for 32x32 inputs (64 tokens): the class defaults; build `ViT`
    directly for other sizes."""
    return ViT(in_channels, num_classes, width, norm)


@MODELS.register("vit_tiny")
def vit_tiny(in_channels: int, num_classes: int, width: float = 1.0, norm: str = "bn") -> ViT:
    """DeiT-Tiny's shape (Touvron et al. 2021: dim 192, 12 blocks, 3 heads) with 4x4 patches for
    32x32 inputs: 12 encoder blocks, as ViT-B/16 in NeFL's depth-scaling tables."""
    return ViT(in_channels, num_classes, width, norm, patch_size=4, dim=192, depth=12, heads=3)


# CAFF's ViT family (Pfeiffer et al. 2024, section 4.1): embedding 192, 6 heads, 4x4 patches and
# l = 3, 6, 9 or 12 blocks, the shapes `hfl pretrain experiments/pretrain/vit_*.yaml` pretrains.
@MODELS.register("vit_caff_l3")
def vit_caff_l3(in_channels: int, num_classes: int, width: float = 1.0, norm: str = "bn") -> ViT:
    """CAFF's ViT with 3 blocks (embedding 192, 6 heads, 4x4 patches, 32x32 inputs)."""
    return ViT(in_channels, num_classes, width, norm, patch_size=4, dim=192, depth=3, heads=6)


@MODELS.register("vit_caff_l6")
def vit_caff_l6(in_channels: int, num_classes: int, width: float = 1.0, norm: str = "bn") -> ViT:
    """CAFF's ViT with 6 blocks."""
    return ViT(in_channels, num_classes, width, norm, patch_size=4, dim=192, depth=6, heads=6)


@MODELS.register("vit_caff_l9")
def vit_caff_l9(in_channels: int, num_classes: int, width: float = 1.0, norm: str = "bn") -> ViT:
    """CAFF's ViT with 9 blocks."""
    return ViT(in_channels, num_classes, width, norm, patch_size=4, dim=192, depth=9, heads=6)


@MODELS.register("vit_caff_l12")
def vit_caff_l12(in_channels: int, num_classes: int, width: float = 1.0, norm: str = "bn") -> ViT:
    """CAFF's ViT with 12 blocks."""
    return ViT(in_channels, num_classes, width, norm, patch_size=4, dim=192, depth=12, heads=6)
