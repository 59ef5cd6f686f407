"""MobileNetV2 for 32x32 inputs (Sandler et al. 2018, "MobileNetV2: Inverted Residuals and Linear
Bottlenecks").

The block table is the paper's (t, c, n, s) and torchvision's, so at width 1 the model holds exactly
torchvision's `mobilenet_v2` parameters. For 32x32 inputs the stem conv3x3 (32 channels) and the
first block of the c=24 stage run at stride 1 instead of 2, as the common CIFAR variant does (e.g.
kuangliu/pytorch-cifar): those are the paper's first two down-samplings, which would leave a 32x32
input at 1x1 after the c=160 stage. The remaining three stride-2 stages (c=32, 64, 160) down-sample
32x32 to 4x4 and an 8x8 input to 1x1. Strides change no parameter count.

Every channel count, the last conv's 1280 included, is ceil(width * base) of a coupled group (torchvision
keeps 1280 below width 1 and rounds to multiples of 8; hfl's sub-models are slices of one global
model, so every group scales alike). Groups: `stem` and `stage{k}` are the residual streams (a
stage's blocks share its group), `body.{i}.hidden` a block's expanded channels, `last` the 1280.
A depthwise conv's output channels are coupled to its group and its weight's dim 1 (one input
channel per group) to none, so a width slice keeps groups == channels. No dropout before the classifier.
"""

from __future__ import annotations

from torch import Tensor, nn

from hfl.models.base import ClassifierHead, ResidualBlock, ScalableModel, make_norm
from hfl.registry import MODELS

# (expansion t, output channels c, blocks n, stride s of the stage's first block); paper Table 2.
IMAGENET_BLOCKS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))
CIFAR_BLOCKS = tuple((t, c, n, 1 if c == 24 else s) for t, c, n, s in IMAGENET_BLOCKS)
STEM_CHANNELS = 32
LAST_CHANNELS = 1280


def conv_norm_act(
    model: ScalableModel, conv: nn.Conv2d, groups: tuple[str | None, str], channels: int, norm: str
) -> list[nn.Module]:
    """conv, norm, ReLU6, with the conv coupled to (input group, output group)."""
    gin, gout = groups
    return [model.couple(conv, gin, gout), make_norm(model, channels, norm, gout), nn.ReLU6(inplace=True)]


def linear_bottleneck(
    model: ScalableModel, channels: tuple[int, int, int], stride: int, groups: tuple[str, str, str], norm: str
) -> nn.Sequential:
    """Expansion conv1x1 -> depthwise conv3x3 -> projection conv1x1 with no activation after it
    (the linear bottleneck). Without expansion (hidden == input group) the depthwise conv reads the
    input directly, as in the paper's t=1 block."""
    cin, hidden, cout = channels
    gin, ghidden, gout = groups
    layers: list[nn.Module] = []
    if ghidden != gin:
        layers += conv_norm_act(model, nn.Conv2d(cin, hidden, 1, bias=False), (gin, ghidden), hidden, norm)
    depthwise = nn.Conv2d(hidden, hidden, 3, stride=stride, padding=1, groups=hidden, bias=False)
    layers += conv_norm_act(model, depthwise, (None, ghidden), hidden, norm)
    layers += [model.couple(nn.Conv2d(hidden, cout, 1, bias=False), ghidden, gout), make_norm(model, cout, norm, gout)]
    return nn.Sequential(*layers)


class InvertedResidual(ResidualBlock):
    """Y + s * bottleneck(Y): a block at stride 1 whose input and output channels are equal."""

    def __init__(self, branch: nn.Sequential) -> None:
        super().__init__()
        self.branch = branch

    def forward(self, x: Tensor) -> Tensor:
        return x + self.scaled(self.branch(x), self.step)


class MobileNetV2(ScalableModel):
    """Stem conv3x3-norm-ReLU6, inverted residual blocks (`blocks`: (t, c, n, s) rows), a conv1x1 to
    1280 channels as the last body block, global pooling and a linear classifier.

    A block that changes the channels or the resolution has no shortcut (a plain linear bottleneck:
    it cannot be dropped, and step sizes do not apply to it)."""

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        width: float = 1.0,
        norm: str = "bn",
        blocks: tuple[tuple[int, int, int, int], ...] = CIFAR_BLOCKS,
    ) -> None:
        super().__init__(width, num_classes, norm, head_norm=False)
        gin, cin = "stem", self.channels("stem", STEM_CHANNELS)
        self.stem = nn.Sequential(*conv_norm_act(self, nn.Conv2d(in_channels, cin, 3, padding=1, bias=False), (None, gin), cin, norm))
        base_in = STEM_CHANNELS
        body: list[nn.Module] = []
        for k, (expansion, base_out, count, first_stride) in enumerate(blocks, start=1):
            gout = f"stage{k}"
            cout = self.channels(gout, base_out)
            for j in range(count):
                stride = first_stride if j == 0 else 1
                ghidden = gin if expansion == 1 else f"body.{len(body)}.hidden"
                hidden = self.channels(ghidden, base_in * expansion)
                branch = linear_bottleneck(self, (cin, hidden, cout), stride, (gin, ghidden, gout), norm)
                residual = stride == 1 and base_in == base_out
                body.append(InvertedResidual(branch) if residual else branch)
                # A stride-1 block with equal channels joins the stage's stream: it keeps the feature shape.
                self.declare_block(gin, gout, droppable=residual)
                gin, cin, base_in = gout, cout, base_out
        clast = self.channels("last", LAST_CHANNELS)
        body.append(nn.Sequential(*conv_norm_act(self, nn.Conv2d(cin, clast, 1, bias=False), (gin, "last"), clast, norm)))
        self.declare_block(gin, "last", droppable=False)
        self.body = nn.ModuleList(body)
        self.head = ClassifierHead(self, "last", clast, num_classes, norm=None)


@MODELS.register("mobilenetv2")
def mobilenetv2(in_channels: int, num_classes: int, width: float = 1.0, norm: str = "bn") -> MobileNetV2:
    return MobileNetV2(in_channels, num_classes, width, norm)
