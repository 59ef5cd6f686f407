"""A small two-block CNN for digits and MNIST-sized inputs."""

from __future__ import annotations

from torch import nn

from hfl.models.base import ClassifierHead, ScalableModel
from hfl.registry import MODELS


class SmallCNN(ScalableModel):
    """conv3x3-ReLU-maxpool twice (32 and 64 channels at width 1), global pooling, linear."""

    def __init__(self, in_channels: int, num_classes: int, width: float = 1.0, norm: str = "bn") -> None:
        super().__init__(width, num_classes, norm, head_norm=False)
        c1, c2 = self.channels("block0", 32), self.channels("block1", 64)
        self.stem = nn.Identity()
        self.body = nn.ModuleList([self._conv_block(in_channels, c1, None, "block0"), self._conv_block(c1, c2, "block0", "block1")])
        self.declare_block(None, "block0", droppable=False)
        self.declare_block("block0", "block1", droppable=False)
        self.head = ClassifierHead(self, "block1", c2, num_classes, norm=None)

    def _conv_block(self, cin: int, cout: int, gin: str | None, gout: str) -> nn.Sequential:
        conv = self.couple(nn.Conv2d(cin, cout, 3, padding=1), gin, gout)
        return nn.Sequential(conv, nn.ReLU(inplace=True), nn.MaxPool2d(2, ceil_mode=True))


@MODELS.register("cnn")
def cnn(in_channels: int, num_classes: int, width: float = 1.0, norm: str = "bn") -> SmallCNN:
    return SmallCNN(in_channels, num_classes, width, norm)
