"""What every hfl model declares: ordered blocks, coupled channel groups and exit points.

A model is `stem -> body[0] -> ... -> body[n-1] -> head`. While a model builds its layers it
registers, per layer, which channel group each weight dimension belongs to (`couple`). Sub-model
specs are computed from those declarations, never from parameter names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor, nn

NORMS = ("bn", "static_bn")


def scaled_channels(base: int, width: float) -> int:
    """Channels kept at width ratio `width` of a layer with `base` channels: ceil(width * base)."""
    # The epsilon keeps products such as 0.5 * 16 = 8.000000001 from rounding up.
    return max(1, math.ceil(base * width - 1e-6))


@dataclass(frozen=True)
class ChannelGroup:
    """Weight dimensions that must be sliced together (e.g. a conv's outputs and the next BN)."""

    name: str
    base: int
    """Channels at width 1."""
    size: int
    """Channels in this model instance."""
    members: tuple[tuple[str, int], ...]
    """(state-dict key, dimension) pairs that index this group's channels."""


@dataclass(frozen=True)
class Block:
    """One entry of the model's body, in forward order."""

    name: str
    """Qualified module name; the block's state keys start with `name + '.'`."""
    index: int
    in_group: str | None
    out_group: str
    droppable: bool
    """True when input and output shapes are equal, so depth scaling may skip the block."""


@dataclass(frozen=True)
class ExitPoint:
    """A place after a body block where a classifier (early exit) can attach."""

    after_block: int
    group: str
    channels: int


class ScalableModel(nn.Module):
    """Base class: subclasses build `stem`, `body` (nn.ModuleList) and `head`, calling `couple`."""

    def __init__(self, width: float) -> None:
        super().__init__()
        if width <= 0:
            raise ValueError(f"width must be positive, got {width}")
        self.width = width
        self._couplings: list[tuple[nn.Module, str, int, str]] = []
        self._group_base: dict[str, int] = {}
        self._block_groups: list[tuple[str | None, str, bool]] = []

    # -- declarations made while building ---------------------------------------------------
    def channels(self, group: str, base: int) -> int:
        """Declare channel group `group` with `base` channels at width 1; returns this width's count."""
        if self._group_base.setdefault(group, base) != base:
            raise ValueError(f"channel group {group!r} declared with two base sizes")
        return scaled_channels(base, self.width)

    def couple(self, module: nn.Module, in_group: str | None, out_group: str | None) -> nn.Module:
        """Record which groups index `module`'s output (dim 0) and input (dim 1) channels."""
        is_norm = isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm))
        for attr in ("weight", "bias", "running_mean", "running_var"):
            if getattr(module, attr, None) is None:
                continue
            if out_group is not None:
                self._couplings.append((module, attr, 0, out_group))
            if in_group is not None and attr == "weight" and not is_norm:
                self._couplings.append((module, attr, 1, in_group))
        return module

    def declare_block(self, in_group: str | None, out_group: str, droppable: bool) -> None:
        """Declare the next body block's channel groups; call once per entry of `body`, in order."""
        self._block_groups.append((in_group, out_group, droppable))

    # -- structure queries --------------------------------------------------------------------
    def _module_names(self) -> dict[int, str]:
        return {id(m): name for name, m in self.named_modules()}

    def channel_groups(self) -> list[ChannelGroup]:
        names = self._module_names()
        members: dict[str, list[tuple[str, int]]] = {g: [] for g in self._group_base}
        for module, attr, dim, group in self._couplings:
            if id(module) not in names:  # the layer was dropped from this instance
                continue
            prefix = names[id(module)]
            members[group].append((f"{prefix}.{attr}" if prefix else attr, dim))
        return [
            ChannelGroup(g, base, scaled_channels(base, self.width), tuple(members[g]))
            for g, base in self._group_base.items()
        ]

    def blocks(self) -> list[Block]:
        if len(self._block_groups) != len(self.body):
            raise RuntimeError("every body block must be declared once with declare_block")
        return [
            Block(f"body.{i}", i, gin, gout, droppable)
            for i, (gin, gout, droppable) in enumerate(self._block_groups)
        ]

    def exit_points(self) -> list[ExitPoint]:
        return [
            ExitPoint(b.index, b.out_group, scaled_channels(self._group_base[b.out_group], self.width))
            for b in self.blocks()
        ]

    def drop_blocks(self, indices: set[int] | frozenset[int]) -> None:
        """Replace body blocks by identities (depth scaling); only droppable blocks qualify."""
        blocks = self.blocks()
        for i in sorted(indices):
            if not blocks[i].droppable:
                raise ValueError(f"block {i} changes the feature shape and cannot be dropped")
            self.body[i] = nn.Identity()

    # -- forward ------------------------------------------------------------------------------
    def features(self, x: Tensor, upto: int | None = None) -> Tensor:
        """Run the stem and body blocks 0..upto (all blocks when None)."""
        h = self.stem(x)
        # Iterating (not slicing) the ModuleList: a slice builds a new Module on every forward.
        for i, block in enumerate(self.body):
            if upto is not None and i > upto:
                break
            h = block(h)
        return h

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


def make_norm(model: ScalableModel, channels: int, norm: str, group: str) -> nn.Module:
    """A 2-d normalisation layer coupled to `group`; 'static_bn' keeps no running statistics."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    layer = nn.BatchNorm2d(channels, track_running_stats=norm == "bn")
    return model.couple(layer, None, group)


class ClassifierHead(nn.Module):
    """Optional norm + ReLU, global average pooling and a linear classifier."""

    def __init__(self, model: ScalableModel, group: str, channels: int, num_classes: int, norm: str | None) -> None:
        super().__init__()
        self.norm = make_norm(model, channels, norm, group) if norm else nn.Identity()
        self.act = nn.ReLU(inplace=True) if norm else nn.Identity()
        self.fc = model.couple(nn.Linear(channels, num_classes), group, None)

    def forward(self, h: Tensor) -> Tensor:
        h = self.act(self.norm(h))
        return self.fc(h.mean(dim=(2, 3)))
