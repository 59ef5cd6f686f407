"""What every hfl model declares: ordered blocks, coupled channel groups and exit points.

A model is `stem -> body[0] -> ... -> body[n-1] -> head`. While a model builds its layers it
registers, per layer, which channel group each weight dimension belongs to (`couple`). Sub-model
specs are computed from those declarations, never from parameter names.

Methods with early exits (DepthFL, ScaleFL, FeDepth) attach classifiers after chosen blocks
(`hfl.models.exits.add_exits`); a depth-scaled sub-model keeps a prefix of the body and the exits
inside it (`truncate`), and `forward_exits` returns every exit's logits, shallowest first, the head's last.

Residual blocks can carry learnable step sizes (NeFL reads a residual network as an ODE solver,
Y_{j+1} = Y_j + s_j F_j(Y_j)); models are built without them and a method turns them on with
`add_step_sizes`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from hfl.models import NORMS


def scaled_channels(base: int, width: float, unit: int = 1) -> int:
    """Channels kept at width ratio `width` of a layer with `base` channels: ceil(width * base), at
    least one. Channels that come in runs of `unit` kept or dropped whole (an attention head's
    dimensions) are counted in runs: `unit` * ceil(width * base / unit)."""
    # The epsilon keeps products such as 0.5 * 16 = 8.000000001 from rounding up.
    return unit * max(1, math.ceil(base // unit * width - 1e-6))


class ConstantStep(nn.Module):
    """A step size that is a fixed number (see `ResidualBlock.fix_step_sizes`)."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def forward(self) -> float:
        return self.value

    def extra_repr(self) -> str:
        return f"{self.value:g}"


class ResidualBlock(nn.Module):
    """A body block computing Y + s * F(Y), with one step size s per residual branch (`step_names`).

    Built without step sizes (s = 1, nothing in the state dict); `add_step_sizes` makes each a
    learnable scalar parameter. Step sizes are coupled to no channel group: width slicing keeps them
    whole, and a skipped block takes its step sizes with it. A method may replace a step size by a
    module returning it (NeFL's copy per sub-model).

    A block whose shortcut projects (it changes the feature shape) can still skip its residual
    branch: `skip_branch` keeps only the modules the shortcut path needs (`shortcut_modules`), the
    depth scaling NeFL applies to every block ("a step size of zero": Y + 0 * F(Y))."""

    step_names: tuple[str, ...] = ("step",)
    shortcut_modules: tuple[str, ...] = ()
    """Child modules the shortcut path runs through (a projection and what feeds it)."""

    def __init__(self) -> None:
        super().__init__()
        self.branch_skipped = False
        for name in self.step_names:
            self.register_parameter(name, None)  # a None parameter is left out of the state dict

    def add_step_sizes(self, value: float) -> None:
        """(Re)set every step size of this block to a fresh learnable scalar `value`."""
        like = next(self.parameters())
        for name in self.step_names:
            setattr(self, name, nn.Parameter(torch.tensor(float(value), dtype=like.dtype, device=like.device)))

    def fix_step_sizes(self, value: float) -> None:
        """Scale every residual branch of this block by the constant `value` (NF-ResNets' α): no
        parameter, nothing in the state dict, and nothing kept for backward beyond the branch's own."""
        for name in self.step_names:
            if name in self._parameters:
                delattr(self, name)  # a parameter slot takes no module
            setattr(self, name, ConstantStep(value))

    @staticmethod
    def scaled(branch: Tensor, step: Tensor | nn.Module | None) -> Tensor:
        """s * F(Y); without step sizes F(Y) itself, so the plain network computes exactly what it did."""
        if isinstance(step, nn.Module):
            step = step()
        return branch if step is None else branch * step

    def branch_state_keys(self) -> list[str]:
        """State keys (relative to the block) that `skip_branch` removes."""
        kept = tuple(f"{name}." for name in self.shortcut_modules)
        return [k for k in self.state_dict() if not k.startswith(kept)]

    def skip_branch(self) -> None:
        """Keep only the shortcut path: the block computes its shortcut of Y (with its step sizes
        and residual layers gone)."""
        if not self.shortcut_modules:
            raise ValueError(f"{type(self).__name__} has an identity shortcut: drop the whole block instead")
        for name, _ in list(self.named_children()):
            if name not in self.shortcut_modules:
                delattr(self, name)
        for name in self.step_names:
            setattr(self, name, None)
        self.branch_skipped = True


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
    unit: int = 1
    """Channels come in runs of `unit` that width slicing keeps or drops whole (the dimensions of
    one attention head); 1: single channels."""

    def kept(self, width: float) -> int:
        """Channels of this group in a model at width ratio `width` (relative to width 1)."""
        return scaled_channels(self.base, width, self.unit)


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

    input_kind: ClassVar[str] = "images"
    """What the model reads: "images" (float N x C x H x W) or "tokens" (int64 N x sequence ids, a
    model that then also has a `context`, the longest sequence it reads). A dataset's `input_kind`
    must match it."""

    def __init__(self, width: float, num_classes: int, norm: str, head_norm: bool) -> None:
        super().__init__()
        if width <= 0:
            raise ValueError(f"width must be positive, got {width}")
        self.width = width
        self.num_classes = num_classes
        self.norm = norm
        self.head_norm = head_norm
        """True when the body's output needs norm + ReLU before a classifier (pre-activation nets)."""
        self.exits = nn.ModuleDict()
        """Early-exit classifiers, keyed by the index of the body block they follow."""
        self.depth: int | None = None
        """Body blocks this instance runs (a prefix); None: all of them."""
        self._couplings: list[tuple[nn.Module, str, int, str]] = []
        self._classifiers: list[nn.Module] = []
        self._group_base: dict[str, int] = {}
        self._group_unit: dict[str, int] = {}
        self._block_groups: list[tuple[str | None, str, bool]] = []

    # -- declarations made while building ---------------------------------------------------
    def channels(self, group: str, base: int, unit: int = 1) -> int:
        """Declare channel group `group` with `base` channels at width 1, in runs of `unit` that
        width slicing keeps whole (see `ChannelGroup.unit`); returns this width's count."""
        if base % unit:
            raise ValueError(f"channel group {group!r}: {base} channels do not split into runs of {unit}")
        if self._group_base.setdefault(group, base) != base or self._group_unit.setdefault(group, unit) != unit:
            raise ValueError(f"channel group {group!r} declared with two base sizes or units")
        return scaled_channels(base, self.width, unit)

    def couple(self, module: nn.Module, in_group: str | None, out_group: str | None) -> nn.Module:
        """Record which groups index `module`'s output (dim 0) and input (dim 1) channels; a linear
        layer whose output is in no group is a classifier (its output rows are the classes)."""
        if out_group is None and isinstance(module, nn.Linear):
            self._classifiers.append(module)
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
            ChannelGroup(g, base, self.group_channels(g), tuple(members[g]), self._group_unit[g])
            for g, base in self._group_base.items()
        ]

    def classifier_keys(self) -> list[str]:
        """State keys whose rows (dim 0) are the classes: the weight and bias of every classifier
        this instance has (the head's and the early exits')."""
        names = self._module_names()
        return [
            f"{names[id(m)]}.{attr}" for m in self._classifiers if id(m) in names for attr in ("weight", "bias")
            if getattr(m, attr, None) is not None
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
            ExitPoint(b.index, b.out_group, self.group_channels(b.out_group)) for b in self.blocks()
        ]

    def group_channels(self, group: str) -> int:
        """Channels of declared group `group` in this instance."""
        return scaled_channels(self._group_base[group], self.width, self._group_unit[group])

    @property
    def exit_blocks(self) -> tuple[int, ...]:
        """Blocks followed by an early exit, in forward order (the head is not counted)."""
        return tuple(sorted(int(b) for b in self.exits))

    def exit_classifier(self, name: str, group: str, target_bases: Sequence[int]) -> nn.Module | None:
        """The early-exit classifier this model reads features of `group` with, or None for the
        convolutional one of `hfl.models.exits` (which down-samples to `target_bases` channels
        first). Models whose features are not feature maps (the ViT's tokens) return their own."""
        return None

    def add_step_sizes(self, initial: Sequence[float] | float = 1.0) -> None:
        """Give every body block learnable step sizes (NeFL): block i then computes Y + s_i F_i(Y).

        `initial` is one starting value for all blocks or one per body block (`nefl_do_step_sizes`
        gives NeFL-DO's); a block with several branches starts each of them at its value. A block's step sizes sit in the state dict under the block, one per
        residual branch (`body.<i>.step`; the ViT's `body.<i>.attn_step`, `body.<i>.mlp_step`).
        Skipped blocks (identities) get none and their entries of `initial` are ignored. Calling it
        again resets the values."""
        count = len(self.body)
        values = [float(initial)] * count if isinstance(initial, (int, float)) else [float(v) for v in initial]
        if len(values) != count:
            raise ValueError(f"initial step sizes: expected one value or {count} (one per body block), got {len(values)}")
        for i, (block, value) in enumerate(zip(self.body, values)):
            if isinstance(block, nn.Identity) or getattr(block, "branch_skipped", False):
                continue
            if not isinstance(block, ResidualBlock):
                raise TypeError(
                    f"{type(self).__name__} body block {i} ({type(block).__name__}) is not residual: "
                    "step sizes scale a residual branch Y + s * F(Y)"
                )
            block.add_step_sizes(value)

    def step_size_keys(self) -> list[str]:
        """State keys of the step sizes this instance holds, in body order (empty before `add_step_sizes`)."""
        return [
            f"body.{i}.{key}"
            for i, block in enumerate(self.body)
            if isinstance(block, ResidualBlock)
            for key, _ in block.named_parameters()
            if key.partition(".")[0] in block.step_names
        ]

    def truncate(self, depth: int) -> None:
        """Keep body blocks 0..depth-1, the exits among them, and the head only when nothing is cut."""
        count = len(self.body)
        if not 1 <= depth <= count:
            raise ValueError(f"depth must be in 1..{count}, got {depth}")
        for i in range(depth, count):
            self.body[i] = nn.Identity()
        for b in [b for b in self.exit_blocks if b >= depth]:
            del self.exits[str(b)]
        if depth < count:
            self.head = None
        self.depth = depth

    def replace_norms(self, factory: Callable[[nn.modules.batchnorm._BatchNorm], nn.Module]) -> None:
        """Swap every coupled batch-norm layer for `factory(layer)`; the batch-norm layers inside the
        replacement are coupled to the old layer's channel group (e.g. FjORD's norm per width)."""
        groups = {id(m): g for m, _, dim, g in self._couplings if dim == 0 and isinstance(m, nn.modules.batchnorm._BatchNorm)}
        for parent in list(self.modules()):
            for child_name, child in list(parent.named_children()):
                if id(child) not in groups:
                    continue
                replacement = factory(child)
                for inner in replacement.modules():
                    if isinstance(inner, nn.modules.batchnorm._BatchNorm):
                        self.couple(inner, None, groups[id(child)])
                setattr(parent, child_name, replacement)

    def drop_blocks(self, indices: set[int] | frozenset[int]) -> None:
        """Skip body blocks (depth scaling): a droppable block becomes the identity, a residual
        block that changes the feature shape keeps only its projection shortcut (NeFL omits those
        too); any other block cannot be skipped."""
        blocks = self.blocks()
        for i in sorted(indices):
            if blocks[i].droppable:
                self.body[i] = nn.Identity()
            elif isinstance(self.body[i], ResidualBlock) and self.body[i].shortcut_modules:
                self.body[i].skip_branch()
            else:
                raise ValueError(f"block {i} changes the feature shape without a residual shortcut and cannot be dropped")

    def dropped_block_keys(self, index: int) -> list[str]:
        """State keys (relative to body block `index`) that `drop_blocks` removes from it."""
        block = self.body[index]
        if not self.blocks()[index].droppable and isinstance(block, ResidualBlock) and block.shortcut_modules:
            return block.branch_state_keys()
        return list(block.state_dict())

    def example_batch(
        self, batch: int, channels: int = 3, extent: int = 32, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        """Random inputs this model reads and targets for `F.cross_entropy(model(x), y)`, for
        contract tests: `batch` standard-normal images of `channels` x `extent` x `extent` and a
        class each. A model reading other inputs (token ids) overrides it."""
        x = torch.randn(batch, channels, extent, extent, generator=generator)
        return x, torch.randint(0, self.num_classes, (batch,), generator=generator)

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

    def forward_exits(self, x: Tensor) -> list[Tensor]:
        """The logits of every exit this instance holds, shallowest first (the head's last)."""
        h, outputs = self.stem(x), []
        for i, block in enumerate(self.body):
            if self.depth is not None and i >= self.depth:
                break
            h = block(h)
            if str(i) in self.exits:
                outputs.append(self.exits[str(i)](h))
        if self.head is not None:
            outputs.append(self.head(h))
        return outputs

    def forward(self, x: Tensor) -> Tensor:
        """The deepest exit's logits (the head's, unless the model is truncated)."""
        if self.exits or self.depth is not None:
            return self.forward_exits(x)[-1]
        return self.head(self.features(x))


def make_norm(model: ScalableModel, channels: int, norm: str, group: str) -> nn.Module:
    """A 2-d normalisation layer coupled to `group`; 'static_bn' keeps no running statistics and
    'none' is an identity, with nothing in the state dict."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if norm == "none":
        return nn.Identity()
    layer = nn.BatchNorm2d(channels, track_running_stats=norm == "bn")
    return model.couple(layer, None, group)


def relu_after_norm(norm: str) -> nn.ReLU:
    """A ReLU applied to the output of a `make_norm(..., norm, ...)` layer: in place, except with
    norm 'none', whose identity would hand the ReLU its own input to overwrite (a residual stream,
    or features an early exit reads too)."""
    return nn.ReLU(inplace=norm != "none")


class ClassifierHead(nn.Module):
    """Optional norm + ReLU, global average pooling and a linear classifier."""

    def __init__(self, model: ScalableModel, group: str, channels: int, num_classes: int, norm: str | None) -> None:
        super().__init__()
        self.norm = make_norm(model, channels, norm, group) if norm else nn.Identity()
        self.act = relu_after_norm(norm) if norm else nn.Identity()
        self.fc = model.couple(nn.Linear(channels, num_classes), group, None)

    def forward(self, h: Tensor) -> Tensor:
        h = self.act(self.norm(h))
        return self.fc(h.mean(dim=(2, 3)))
