"""torchvision's ImageNet ResNet-18/34 weights, read from a local file into hfl's ResNets.

NeFL (Kang et al., Table 2 and appendix B.6) starts its global ResNet-18/34 from PyTorch's
ImageNet-1k weights. hfl never downloads them: `model.pretrained` names the `.pth` file, or a folder
holding it under torchvision's file name (the torch hub cache, `~/.cache/torch/hub/checkpoints`,
its parent folders included).

hfl's ResNets have a CIFAR stem (one 3x3 conv, no max-pool) and a classifier sized for the data
set, so the 7x7 stem conv and, unless there are 1000 classes, the final linear layer keep hfl's
initialisation; everything else (stem BN, every block, every projection shortcut) is loaded.
Running statistics are loaded only where the model keeps them (not with static batch norm).
"""

from __future__ import annotations

import functools
import logging
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from hfl.errors import ConfigError
from hfl.models.resnet import IMAGENET_CHANNELS, BasicBlock, ResNet
from hfl.models.sources import TORCHVISION_FILES

logger = logging.getLogger(__name__)

STAGE_DEPTHS = {"resnet18": (2, 2, 2, 2), "resnet34": (3, 4, 6, 3)}
DOWNLOAD_URL = "https://download.pytorch.org/models/"
FIELD = "model.pretrained"
OPTIONAL = ("stem.0.weight", "head.fc.weight", "head.fc.bias")
"""hfl tensors that keep their initialisation when the file's shape differs (CIFAR stem, class count)."""


@dataclass(frozen=True)
class PretrainedLoad:
    """What `load_torchvision_resnet` did."""

    path: Path
    loaded: tuple[str, ...]
    """hfl state keys filled from the file."""
    skipped: tuple[tuple[str, str], ...]
    """(hfl state key, why) for tensors that kept hfl's initialisation."""
    unused: tuple[str, ...]
    """Keys of the file that went nowhere (e.g. running statistics for static batch norm)."""


def pretrained_path(source: str, arch: str) -> Path:
    """The weights file `source` stands for: the file itself, or torchvision's file for `arch` in
    the folder `source`, its `checkpoints/` or its `hub/checkpoints/` (torch's cache layout)."""
    name = TORCHVISION_FILES[arch]
    path = Path(source).expanduser()
    candidates = [path, path / name, path / "checkpoints" / name, path / "hub" / "checkpoints" / name]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    looked = ", ".join(str(c) for c in candidates)
    raise ConfigError(
        FIELD,
        source,
        f"torchvision's ImageNet weights for {arch}: a state-dict file, or a folder holding {name} "
        f"(looked for {looked}; hfl does not download: fetch {DOWNLOAD_URL}{name})",
    )


@functools.lru_cache(maxsize=2)
def _read(path: str, mtime_ns: int) -> dict[str, Tensor]:
    """The file's tensors, cached: models at full width are built several times per run."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as error:  # truncated, or a pickled model
        raise ConfigError(FIELD, path, f"a readable torchvision state-dict file ({type(error).__name__}: {str(error).splitlines()[0]})") from None
    if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ConfigError(FIELD, path, "a state dict (a mapping of names to tensors), as torchvision saves its weights")
    return dict(state)


def _module_pairs(model: ResNet) -> list[tuple[str, str]]:
    """(hfl module, torchvision module) names of corresponding layers."""
    pairs = [("stem.0", "conv1"), ("stem.1", "bn1")]
    index = 0
    for s, depth in enumerate(model.stage_depths):
        for j in range(depth):
            ours, theirs = f"body.{index}", f"layer{s + 1}.{j}"
            pairs += [(f"{ours}.{layer}", f"{theirs}.{layer}") for layer in ("conv1", "bn1", "conv2", "bn2")]
            pairs += [(f"{ours}.shortcut.{k}", f"{theirs}.downsample.{k}") for k in (0, 1)]
            index += 1
    pairs.append(("head.fc", "fc"))
    return pairs


def load_torchvision_resnet(model: ResNet, arch: str, source: str) -> PretrainedLoad:
    """Load torchvision's ImageNet weights for `arch` (resnet18 or resnet34) from `source` into
    `model`, a full-width hfl ResNet of that architecture; reports (and logs) what it skipped."""
    if arch not in TORCHVISION_FILES:
        raise ConfigError(FIELD, source, f"empty unless model.name is one of {', '.join(TORCHVISION_FILES)} (got {arch})")
    if not (
        isinstance(model, ResNet)
        and model.block_type is BasicBlock
        and tuple(model.stage_depths) == STAGE_DEPTHS[arch]
        and tuple(model.base_channels) == IMAGENET_CHANNELS
    ):
        raise ValueError(f"torchvision's {arch} weights fit only hfl's {arch}, got a {type(model).__name__}")
    if model.width != 1:
        raise ValueError(f"torchvision's weights fit only width 1, the model has width {model.width}")
    path = pretrained_path(source, arch)
    stat = path.stat()
    source_state = _read(str(path.resolve()), stat.st_mtime_ns)
    modules = dict(model.named_modules())
    target = model.state_dict()
    new: dict[str, Tensor] = {}
    skipped: list[tuple[str, str]] = []
    used: set[str] = set()
    for ours, theirs in _module_pairs(model):
        if ours not in modules:  # no projection shortcut in this block, or a skipped block
            continue
        for name in modules[ours].state_dict():
            key, their_key = f"{ours}.{name}", f"{theirs}.{name}"
            if their_key not in source_state:
                raise ConfigError(FIELD, str(path), f"torchvision's {arch} weights (the file has no {their_key})")
            used.add(their_key)
            want, have = tuple(target[key].shape), tuple(source_state[their_key].shape)
            if want == have:
                new[key] = source_state[their_key]
            elif key in OPTIONAL:
                skipped.append((key, f"{their_key} has shape {have}, the model {want}"))
            else:
                raise ConfigError(FIELD, str(path), f"torchvision's {arch} weights ({their_key} has shape {have}, expected {want})")
    unused = tuple(k for k in source_state if k not in used)
    stray = [k for k in unused if k.startswith("layer") and not k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    if stray:
        raise ConfigError(FIELD, str(path), f"torchvision's {arch} weights (the file has layers {arch} lacks, e.g. {stray[0]})")
    model.load_state_dict(new, strict=False)
    logger.info("loaded %d tensors of torchvision's %s ImageNet weights from %s", len(new), arch, path)
    for key, why in skipped:
        logger.info("kept the initialisation of %s: %s", key, why)
    if unused:
        logger.info("left unused from %s: %s", path.name, ", ".join(unused))
    return PretrainedLoad(path, tuple(new), tuple(skipped), unused)

