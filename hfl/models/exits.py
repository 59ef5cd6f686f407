"""Early exits: classifiers attached after chosen body blocks (DepthFL, ScaleFL, FeDepth's auxiliary
classifiers). A 'linear' exit is (norm + ReLU for pre-activation nets,) pooling and a linear layer; a
'bottleneck' exit first down-samples with a stride-2 separable conv per later stage, up to the last
stage's channels, as in DepthFL and "Be Your Own Teacher", so a shallow exit sees features of the
final shape. A 'convs' exit is ScaleFL's (the authors' `Classifier`): three conv3x3-norm-ReLU layers
that keep the features' channels, then pooling and a linear layer. Exits are coupled to the model's channel groups like every layer, so width specs slice them.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from hfl.models.base import ClassifierHead, ScalableModel, make_norm

EXIT_KINDS = ("linear", "bottleneck", "convs")
EXIT_CONVS = 3
"""Conv layers of a 'convs' exit (ScaleFL's authors' `num_conv_layers`)."""


def add_exits(model: ScalableModel, after_blocks: Sequence[int], kind: str = "linear") -> ScalableModel:
    """Attach a classifier of `kind` after each of `after_blocks` (the last block has the head)."""
    if kind not in EXIT_KINDS:
        raise ValueError(f"exit kind must be one of {EXIT_KINDS}, got {kind!r}")
    blocks = model.blocks()
    for b in sorted(set(after_blocks)):
        if not 0 <= b < len(blocks) - 1:
            raise ValueError(f"an exit must follow a block in 0..{len(blocks) - 2}, got {b}")
        group = blocks[b].out_group
        later = list(dict.fromkeys(blk.out_group for blk in blocks[b + 1 :] if blk.out_group != group))
        targets = [model._group_base[g] for g in later] if kind == "bottleneck" else []
        name = f"exits.{b}"
        convs = EXIT_CONVS if kind == "convs" else 0
        model.exits[str(b)] = model.exit_classifier(name, group, targets) or ExitClassifier(model, name, group, targets, convs)
    return model


class SeparableDownsample(nn.Module):
    """Depthwise conv3x3 with stride 2, pointwise conv1x1, norm, ReLU."""

    def __init__(self, model: ScalableModel, cin: int, cout: int, gin: str, gout: str) -> None:
        super().__init__()
        self.depthwise = model.couple(nn.Conv2d(cin, cin, 3, stride=2, padding=1, groups=cin, bias=False), None, gin)
        self.pointwise = model.couple(nn.Conv2d(cin, cout, 1, bias=False), gin, gout)
        self.norm = make_norm(model, cout, model.norm, gout)
        self.act = nn.ReLU(inplace=True)

    def forward(self, h: Tensor) -> Tensor:
        return self.act(self.norm(self.pointwise(self.depthwise(h))))


class ConvNormReLU(nn.Module):
    """conv3x3 that keeps the channels, norm, ReLU."""

    def __init__(self, model: ScalableModel, channels: int, group: str) -> None:
        super().__init__()
        self.conv = model.couple(nn.Conv2d(channels, channels, 3, padding=1, bias=False), group, group)
        self.norm = make_norm(model, channels, model.norm, group)
        self.act = nn.ReLU(inplace=True)

    def forward(self, h: Tensor) -> Tensor:
        return self.act(self.norm(self.conv(h)))


class ExitClassifier(nn.Module):
    """An early exit: optional down-sampling convs (one per later stage) or `convs` channel-keeping
    conv layers, then a classifier head."""

    def __init__(self, model: ScalableModel, name: str, group: str, target_bases: Sequence[int], convs: int = 0) -> None:
        super().__init__()
        gin, cin = group, model.group_channels(group)
        layers: list[nn.Module] = [ConvNormReLU(model, cin, gin) for _ in range(convs)]
        for k, base in enumerate(target_bases):
            gout = f"{name}.{k}"
            cout = model.channels(gout, base)
            layers.append(SeparableDownsample(model, cin, cout, gin, gout))
            gin, cin = gout, cout
        self.convs = nn.Sequential(*layers)
        norm = model.norm if model.head_norm and not layers else None
        self.classifier = ClassifierHead(model, gin, cin, model.num_classes, norm)

    def forward(self, h: Tensor) -> Tensor:
        return self.classifier(self.convs(h))
