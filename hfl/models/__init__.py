"""Models that declare their blocks, coupled channel groups and exit points."""

from hfl.models import cnn, resnet  # noqa: F401  (registers the models)
from hfl.models.base import (
    Block,
    ChannelGroup,
    ExitPoint,
    ScalableModel,
    scaled_channels,
)
from hfl.registry import MODELS


def build_model(name: str, in_channels: int, num_classes: int, width: float = 1.0, norm: str = "bn") -> ScalableModel:
    """Build registered model `name` at width ratio `width`."""
    return MODELS.get(name, field="model.name")(in_channels, num_classes, width=width, norm=norm)


__all__ = ["Block", "ChannelGroup", "ExitPoint", "ScalableModel", "build_model", "scaled_channels"]
