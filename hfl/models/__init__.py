"""Models that declare their blocks, coupled channel groups and exit points.

Models are declared here with the module that registers each, so that the config checks their
names without importing torch; a model's module is imported when a run builds it. The names below
(`hfl.models.build_model`, ...) are imported on first use, for the same reason.
"""

from __future__ import annotations

import importlib
from typing import Any

from hfl.registry import MODELS

_MODEL_MODULES = {
    "hfl.models.cnn": ("cnn",),
    "hfl.models.resnet": ("preresnet20", "resnet18", "resnet34", "resnet56", "resnet110"),
    "hfl.models.mobilenetv2": ("mobilenetv2",),
    "hfl.models.vit": ("vit", "vit_tiny", "vit_caff_l3", "vit_caff_l6", "vit_caff_l9", "vit_caff_l12"),
    "hfl.models.gpt": ("gpt", "gpt_l3", "gpt_l6", "gpt_l9"),
}
for _module, _names in _MODEL_MODULES.items():
    for _name in _names:
        MODELS.declare(_name, _module)

NORMS = ("bn", "static_bn", "none")
"""Normalisation kinds `make_norm` builds: batch norm with running statistics, batch norm with batch
statistics only (HeteroFL's static BN), or none (an identity: FedMef's NSConv models, ReLU -> conv)."""

_LAZY = {
    "Block": "hfl.models.base",
    "ChannelGroup": "hfl.models.base",
    "ExitPoint": "hfl.models.base",
    "ResidualBlock": "hfl.models.base",
    "ScalableModel": "hfl.models.base",
    "scaled_channels": "hfl.models.base",
    "build_model": "hfl.models.build",
    "ClassLabels": "hfl.models.family",
    "FamilyLoad": "hfl.models.family",
    "load_family_weights": "hfl.models.family",
    "PretrainedLoad": "hfl.models.pretrained",
    "load_torchvision_resnet": "hfl.models.pretrained",
    "is_family_source": "hfl.models.sources",
}
"""Public names and the module each comes from."""
__all__ = ["NORMS", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hfl.models' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
