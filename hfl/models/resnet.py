"""CIFAR-style ResNets: pre-activation ResNet-20 and post-activation ResNet-18/34/56/110.

He et al. 2016, "Deep Residual Learning for Image Recognition" and "Identity Mappings in Deep
Residual Networks". Every residual stream of a stage is one channel group (`stage{k}`); each
block's inner channels (between its two convs) are a group of their own (`body.{i}.inner`).
With step sizes on (`ScalableModel.add_step_sizes`), a block scales its residual branch by its `step`;
a block that opens a stage can skip its branch and keep its projection shortcut (NeFL's depth scaling).
"""

from __future__ import annotations

from torch import Tensor, nn

from hfl.models.base import (
    ClassifierHead,
    ResidualBlock,
    ScalableModel,
    make_norm,
    relu_after_norm,
)
from hfl.registry import MODELS

CIFAR_CHANNELS = (16, 32, 64)
IMAGENET_CHANNELS = (64, 128, 256, 512)


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class BasicBlock(ResidualBlock):
    """Post-activation block: conv3x3-BN-ReLU-conv3x3-BN (times the step size), plus the shortcut, then ReLU."""

    preactivated = False
    shortcut_modules = ("shortcut", "act")

    def __init__(
        self,
        model: ScalableModel,
        cin: int,
        inner: int,
        cout: int,
        stride: int,
        groups: tuple[str, str, str],
        norm: str,
    ) -> None:
        super().__init__()
        gin, ginner, gout = groups
        self.conv1 = model.couple(conv3x3(cin, inner, stride), gin, ginner)
        self.bn1 = make_norm(model, inner, norm, ginner)
        self.conv2 = model.couple(conv3x3(inner, cout), ginner, gout)
        self.bn2 = make_norm(model, cout, norm, gout)
        self.act = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or gin != gout:
            conv = model.couple(conv1x1(cin, cout, stride), gin, gout)
            self.shortcut = nn.Sequential(conv, make_norm(model, cout, norm, gout))

    def forward(self, x: Tensor) -> Tensor:
        if self.branch_skipped:
            return self.act(self.shortcut(x))
        out = self.act(self.bn1(self.conv1(x)))
        out = self.scaled(self.bn2(self.conv2(out)), self.step)
        return self.act(out + self.shortcut(x))


class PreActBlock(ResidualBlock):
    """Pre-activation block: BN-ReLU-conv3x3-BN-ReLU-conv3x3 (times the step size), plus the shortcut.

    A projection shortcut reads the pre-activated input, as in the reference implementation;
    an identity shortcut reads the raw input.
    """

    preactivated = True
    shortcut_modules = ("bn1", "act", "shortcut")

    def __init__(
        self,
        model: ScalableModel,
        cin: int,
        inner: int,
        cout: int,
        stride: int,
        groups: tuple[str, str, str],
        norm: str,
    ) -> None:
        super().__init__()
        gin, ginner, gout = groups
        self.bn1 = make_norm(model, cin, norm, gin)
        self.conv1 = model.couple(conv3x3(cin, inner, stride), gin, ginner)
        self.bn2 = make_norm(model, inner, norm, ginner)
        self.conv2 = model.couple(conv3x3(inner, cout), ginner, gout)
        self.act = relu_after_norm(norm)
        self.shortcut: nn.Module | None = None
        if stride != 1 or gin != gout:
            self.shortcut = model.couple(conv1x1(cin, cout, stride), gin, gout)

    def forward(self, x: Tensor) -> Tensor:
        out = self.act(self.bn1(x))
        skip = x if self.shortcut is None else self.shortcut(out)
        if self.branch_skipped:
            return skip
        out = self.conv1(out)
        out = self.conv2(self.act(self.bn2(out)))
        return self.scaled(out, self.step) + skip


class ResNet(ScalableModel):
    """conv3x3 stem, stages of residual blocks (stride 2 opening every stage after the first), GAP + linear.

    Pre-activation networks keep the stem a bare conv and normalise in the head instead.
    """

    def __init__(
        self,
        block: type[BasicBlock | PreActBlock],
        depths: tuple[int, ...],
        base_channels: tuple[int, ...],
        in_channels: int,
        num_classes: int,
        width: float = 1.0,
        norm: str = "bn",
    ) -> None:
        super().__init__(width, num_classes, norm, head_norm=block.preactivated)
        self.block_type = block
        self.stage_depths = depths
        self.base_channels = base_channels
        if len(depths) != len(base_channels):
            raise ValueError(f"got {len(depths)} stage depths but {len(base_channels)} channel counts")
        gin, cin = "stage1", self.channels("stage1", base_channels[0])
        stem_conv = self.couple(conv3x3(in_channels, cin), None, gin)
        if block.preactivated:
            self.stem: nn.Module = stem_conv
        else:
            self.stem = nn.Sequential(stem_conv, make_norm(self, cin, norm, gin), nn.ReLU(inplace=True))

        blocks: list[nn.Module] = []
        for s, (depth, base) in enumerate(zip(depths, base_channels)):
            gout = f"stage{s + 1}"
            cout = self.channels(gout, base)
            for j in range(depth):
                stride = 2 if s > 0 and j == 0 else 1
                ginner = f"body.{len(blocks)}.inner"
                inner = self.channels(ginner, base)
                blocks.append(block(self, cin, inner, cout, stride, (gin, ginner, gout), norm))
                # Only a block with an identity shortcut keeps the feature shape.
                self.declare_block(gin, gout, droppable=stride == 1 and gin == gout)
                gin, cin = gout, cout
        self.body = nn.ModuleList(blocks)
        self.head = ClassifierHead(self, gin, cin, num_classes, norm=norm if block.preactivated else None)


@MODELS.register("preresnet20")
def preresnet20(in_channels: int, num_classes: int, width: float = 1.0, norm: str = "bn") -> ResNet:
    return ResNet(PreActBlock, (3, 3, 3), CIFAR_CHANNELS, in_channels, num_classes, width, norm)


@MODELS.register("resnet18")
def resnet18(in_channels: int, num_classes: int, width: float = 1.0, norm: str = "bn") -> ResNet:
    return ResNet(BasicBlock, (2, 2, 2, 2), IMAGENET_CHANNELS, in_channels, num_classes, width, norm)


@MODELS.register("resnet34")
def resnet34(in_channels: int, num_classes: int, width: float = 1.0, norm: str = "bn") -> ResNet:
    return ResNet(BasicBlock, (3, 4, 6, 3), IMAGENET_CHANNELS, in_channels, num_classes, width, norm)


@MODELS.register("resnet56")
def resnet56(in_channels: int, num_classes: int, width: float = 1.0, norm: str = "bn") -> ResNet:
    return ResNet(BasicBlock, (9, 9, 9), CIFAR_CHANNELS, in_channels, num_classes, width, norm)


@MODELS.register("resnet110")
def resnet110(in_channels: int, num_classes: int, width: float = 1.0, norm: str = "bn") -> ResNet:
    return ResNet(BasicBlock, (18, 18, 18), CIFAR_CHANNELS, in_channels, num_classes, width, norm)
