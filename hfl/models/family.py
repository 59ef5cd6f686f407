"""Pretrained transformer families: where `hfl pretrain` writes them and how a run loads one.

A family (CAFF, Pfeiffer et al. 2024: the same transformer at l = 3, 6, 9 and 12 blocks) lives in
`<cache_dir>/pretrained/<family>/` (cache_dir: `$HFL_CACHE`, else ~/.cache/hfl): per member
`l<l>.safetensors` (the state dict) and `l<l>.json` (its card: shape, corpus, tokenizer, tokens
seen, losses, seed, wall time, hfl version). `model.pretrained=<family>:<l>`, or a path to a
`.safetensors` file, loads one into the configured model. Every tensor must have the model's shape,
except a classifier's rows (a ViT pretrained on 5 classes starting a 10-class task): those keep the
model's initialisation, and the load reports them. A classifier pretrained on other classes than the
task's keeps its initialisation too, whatever its shape: CAFF finetunes an ImageNet-pretrained ViT
on CIFAR, so the downstream head is new, and a head whose rows mean other classes (cat, where the
task's label 3 is ship) starts each method below chance.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hfl.data.cache import default_cache_dir
from hfl.errors import ConfigError
from hfl.models.sources import (
    CONFIG_FOLDER,
    FIELD,
    MEMBER,
    card_path,
    checkpoint_path,
    family_dir,
    weights_path,
)
from hfl.pretrain_config import estimate_cpu_seconds, load_pretrain_config

logger = logging.getLogger(__name__)

MEMBER_MODELS = {
    ("gpt", 96, 3, 256): {3: "gpt_l3", 6: "gpt_l6", 9: "gpt_l9", 12: "gpt"},
    ("vit", 192, 6, 4): {3: "vit_caff_l3", 6: "vit_caff_l6", 9: "vit_caff_l9", 12: "vit_caff_l12"},
}
"""Registered model names by (model, dim, heads, context or patch size) and depth: CAFF's shapes."""


def member_model_name(shape: dict[str, Any]) -> str | None:
    """The registered model that has a card's `shape`, if there is one."""
    size = shape.get("context") if shape.get("model") == "gpt" else shape.get("patch_size")
    return MEMBER_MODELS.get((shape.get("model"), shape.get("dim"), shape.get("heads"), size), {}).get(shape.get("depth"))


def family_members(model_name: str) -> dict[int, str]:
    """The registered models of every depth in the family `model_name` belongs to, by depth; empty
    when it belongs to none."""
    return next((dict(members) for members in MEMBER_MODELS.values() if model_name in members.values()), {})


def format_duration(seconds: float) -> str:
    """A rough duration: minutes, hours or days."""
    if seconds < 3600:
        return f"{max(1, round(seconds / 60))} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} days"


def build_command(family: str, cache_dir: str | Path) -> str:
    """The `hfl pretrain` command that builds `family`, and roughly how long it takes on a 2-core
    CPU when its config is at hand to estimate from."""
    config_file = CONFIG_FOLDER / f"{family}.yaml"
    command = f"hfl pretrain {config_file.as_posix()}"
    if Path(cache_dir).resolve() != Path(default_cache_dir()).resolve():
        command += f" cache_dir={cache_dir}"
    repo_file = Path(__file__).resolve().parents[2] / config_file
    found = next((p for p in (config_file, repo_file) if p.is_file()), None)
    if found is None:
        return f"`{command}` (write {config_file} first, e.g. from {CONFIG_FOLDER.as_posix()}/lm_cpu.yaml)"
    try:
        seconds = estimate_cpu_seconds(load_pretrain_config(found))
    except ConfigError:
        seconds = None
    when = f"about {format_duration(seconds)} on a 2-core CPU" if seconds else "time not estimated for its shape"
    return f"`{command}` ({when})"


def resolve_source(source: str, cache_dir: str | Path) -> Path:
    """The `.safetensors` file `model.pretrained=source` names; a missing one is a ConfigError
    that says how to build it."""
    match = MEMBER.match(source)
    if not match:
        path = Path(source).expanduser()
        if not path.is_file():
            raise ConfigError(FIELD, source, f"an existing .safetensors file (not found: {path}) or FAMILY:L, e.g. lm_cpu:3")
        return path
    family, depth = match["family"], int(match["depth"])
    path = weights_path(cache_dir, family, depth)
    if path.is_file() and card_path(cache_dir, family, depth).is_file():
        return path
    folder = family_dir(cache_dir, family)
    have = sorted(int(p.stem[1:]) for p in folder.glob("l*.json") if p.stem[1:].isdigit()) if folder.is_dir() else []
    if checkpoint_path(cache_dir, family, depth).is_file():
        state = f"its pretraining of l{depth} was interrupted; run the same command again to resume:"
    elif have:
        state = f"{folder} holds l{', l'.join(map(str, have))} but not l{depth}; add {depth} to its depths and run"
    else:
        state = f"{folder} holds no pretrained family; build it with"
    raise ConfigError(FIELD, source, f"a pretrained family member ({state} {build_command(family, cache_dir)})")


def read_card(weights: Path) -> dict[str, Any]:
    """The card beside a weights file (`l3.json` for `l3.safetensors`), or {} without one."""
    card = weights.with_suffix(".json")
    return json.loads(card.read_text()) if card.is_file() else {}


@dataclass(frozen=True)
class FamilyLoad:
    """What `load_family_weights` did."""

    path: Path
    loaded: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]
    """(state key, why) of classifier tensors that kept the model's initialisation."""
    card: dict[str, Any]


ClassLabels = tuple[str, tuple[int, ...]]
"""What a classifier's rows mean: (dataset, the dataset's class id of each row)."""


def pretrained_labels(card: dict[str, Any]) -> ClassLabels | None:
    """The classes a member's classifier was pretrained to predict, from its card: for an image
    corpus; None for a language model, whose head predicts its tokenizer's ids."""
    from hfl.data.corpora import IMAGE_CORPUS_DATASETS

    corpus = card.get("corpus", {})
    dataset = IMAGE_CORPUS_DATASETS.get(corpus.get("name"))
    return (dataset, tuple(corpus["classes"])) if dataset and "classes" in corpus else None


def describe_labels(labels: ClassLabels) -> str:
    dataset, classes = labels
    return f"classes {', '.join(map(str, classes))} of {dataset}"


def _blocks(keys: Any) -> int:
    return len({k.split(".")[1] for k in keys if k.startswith("body.")})


def load_family_weights(
    model: nn.Module, source: str, cache_dir: str | Path, model_name: str, labels: ClassLabels | None = None
) -> FamilyLoad:
    """Load the pretrained transformer `source` (`family:l` or a `.safetensors` file) into `model`,
    the full-width model `model_name` for a task predicting `labels` (None: not a classification
    task). Shapes must match, except a classifier's; a classifier of another shape, or pretrained on
    other classes than `labels`, keeps the model's initialisation (reported)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = resolve_source(source, cache_dir)
    try:
        state = load_file(path)
    except (SafetensorError, OSError) as error:
        raise ConfigError(FIELD, source, f"a readable .safetensors file ({path}: {error})") from None
    card = read_card(path)
    pretrained_on = pretrained_labels(card)
    relabelled = labels is not None and pretrained_on is not None and pretrained_on != labels
    target = model.state_dict()
    classifier = set(model.classifier_keys()) if hasattr(model, "classifier_keys") else set()
    new: dict[str, torch.Tensor] = {}
    skipped: list[tuple[str, str]] = []
    problems: list[str] = []
    missing, extra = sorted(set(target) - set(state)), sorted(set(state) - set(target))
    if _blocks(state) != _blocks(target):
        problems.append(f"{_blocks(state)} blocks in the file, {_blocks(target)} in the model")
    if missing or extra:
        problems.append(f"tensors only in the model: {', '.join(missing[:3]) or '-'}; only in the file: {', '.join(extra[:3]) or '-'}")
    for key in sorted(set(target) & set(state)):
        have, want = tuple(state[key].shape), tuple(target[key].shape)
        if key in classifier and relabelled:
            skipped.append((key, f"pretrained to predict {describe_labels(pretrained_on)}, the task's are {describe_labels(labels)}"))
        elif have == want:
            new[key] = state[key]
        elif key in classifier:
            skipped.append((key, f"the file's {key} has shape {have}, the model's {want}"))
        elif len(problems) < 3:
            problems.append(f"{key} has shape {have} in the file, {want} in the model")
    if problems:
        shape = card.get("shape", {})
        about = f"; {source} is {json.dumps(shape)}" if shape else ""
        member = member_model_name(shape)
        hint = f" (model.name={member} has its shape)" if member and member != model_name else ""
        raise ConfigError(FIELD, source, f"weights whose shapes match model.name={model_name}: {'; '.join(problems)}{about}{hint}")
    model.load_state_dict(new, strict=False)
    logger.info("loaded %d tensors of %s from %s", len(new), source, path)
    for key, why in skipped:
        logger.info("kept the initialisation of %s: %s", key, why)
    return FamilyLoad(path, tuple(new), tuple(skipped), card)
