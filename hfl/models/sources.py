"""What `model.pretrained` names, and where `hfl pretrain` writes a family's files: plain names and
paths, without torch, so that the config checks a source and the pretraining and loading code agree
on the layout (`hfl.models.family` loads the weights, `hfl.pretrain` writes them)."""

from __future__ import annotations

import re
from pathlib import Path

TORCHVISION_FILES = {"resnet18": "resnet18-f37072fd.pth", "resnet34": "resnet34-b627a593.pth"}
"""torchvision's file names of its IMAGENET1K_V1 weights (as its download cache keeps them)."""
FIELD = "model.pretrained"
FAMILIES_FOLDER = "pretrained"
"""The folder of `<cache_dir>` that holds one folder per family."""
FAMILY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
MEMBER = re.compile(r"^(?P<family>[A-Za-z0-9][A-Za-z0-9_.-]*):(?P<depth>\d+)$")
"""`model.pretrained=FAMILY:L`: the member with L blocks of a family."""
CONFIG_FOLDER = Path("experiments") / "pretrain"
"""Where the pretraining configs live, relative to the repository (and to the working directory)."""


def family_dir(cache_dir: str | Path, family: str) -> Path:
    return Path(cache_dir) / FAMILIES_FOLDER / family


def weights_path(cache_dir: str | Path, family: str, depth: int) -> Path:
    return family_dir(cache_dir, family) / f"l{depth}.safetensors"


def card_path(cache_dir: str | Path, family: str, depth: int) -> Path:
    return family_dir(cache_dir, family) / f"l{depth}.json"


def checkpoint_path(cache_dir: str | Path, family: str, depth: int) -> Path:
    return family_dir(cache_dir, family) / f"l{depth}.checkpoint.pt"


def is_family_source(source: str) -> bool:
    """Whether `model.pretrained=source` names a pretrained transformer (`family:l` or a
    `.safetensors` file) rather than torchvision's ResNet weights."""
    return bool(MEMBER.match(source)) or source.endswith(".safetensors")
