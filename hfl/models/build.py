"""Building a registered model at a width, and loading the weights `model.pretrained` names into it."""

from __future__ import annotations

from hfl.data.cache import default_cache_dir
from hfl.models.base import ScalableModel
from hfl.models.family import ClassLabels, load_family_weights
from hfl.models.pretrained import load_torchvision_resnet
from hfl.models.sources import is_family_source
from hfl.registry import MODELS


def build_model(
    name: str,
    in_channels: int,
    num_classes: int,
    width: float = 1.0,
    norm: str = "bn",
    pretrained: str = "",
    cache_dir: str | None = None,
    depth: int = 0,
    labels: ClassLabels | None = None,
) -> ScalableModel:
    """Build registered model `name` at width ratio `width`; `pretrained` names weights to start
    from: a member of a family `hfl pretrain` wrote (`family:l`, looked for in
    `<cache_dir>/pretrained/`, cache_dir defaulting to $HFL_CACHE) or a `.safetensors` file, else
    torchvision's ImageNet weights for resnet18/resnet34 (a file, or a folder holding it); `depth`,
    for a model built in several depths (gpt), its body blocks (0: its own). For a language model
    (gpt) `num_classes` is the vocabulary size and `in_channels` is ignored. `labels`, the task's
    classes, decides whether a family member's classifier is loaded (`load_family_weights`)."""
    options = {"depth": depth} if depth else {}
    model = MODELS.get(name, field="model.name")(in_channels, num_classes, width=width, norm=norm, **options)
    if next(model.parameters()).is_meta:  # built for shapes only (no storage): nothing to load into
        return model
    if pretrained and is_family_source(pretrained):
        load_family_weights(model, pretrained, cache_dir or default_cache_dir(), name, labels)
    elif pretrained:
        load_torchvision_resnet(model, name, pretrained)
    return model
