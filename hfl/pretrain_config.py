"""What `hfl pretrain` trains (`PretrainConfig`, read from YAML) and how long it takes on a 2-core CPU.

Apart from the loop (`hfl.pretrain`), so that a run missing a family names the command that builds
it, with its estimated time, without the model layer importing the pretraining loop.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hfl.data.cache import default_cache_dir, default_data_root
from hfl.data.corpora import IMAGE_CORPORA, TEXT_CORPORA
from hfl.data.text import TOKENIZERS
from hfl.data.transforms import AUGMENTS
from hfl.errors import check, check_choice
from hfl.models.sources import FAMILY_NAME
from hfl.yaml_loader import apply_overrides, build_dataclass, read_yaml_mapping

IMAGE_SIZE = 32
"""Side of the square images a ViT member is pretrained on (CIFAR-10's)."""
# `benchmarks/pretrain_throughput.py` at the paper's shapes (gpt batch 16 x 256, vit batch 32), one
# thread, on the project's 2-core CPU shared with other jobs: the median of 4 runs, which ranged over
# +-30 %. Used for the time a missing family would take to build, and to size lm_cpu / vit_cpu.
CPU_SECONDS_PER_UNIT = {
    ("gpt", 96, 3, 256): {3: 1 / 14_300, 6: 1 / 7_500, 9: 1 / 5_000, 12: 1 / 3_700},
    ("vit", 192, 6, 4): {3: 1 / 81, 6: 1 / 40.5, 9: 1 / 27, 12: 1 / 20},
}
"""Seconds per token (gpt) or per image (vit) on a 2-core CPU by depth (linear in between and beyond)."""


@dataclass(frozen=True)
class PretrainConfig:
    family: str = "family"
    """Name of the family: its folder `<cache_dir>/pretrained/<family>/` and `model.pretrained=<family>:<l>`;
    default: the config file's name."""
    model: str = "gpt"
    """gpt (a decoder-only language model) or vit (a Vision Transformer classifier)."""
    depths: tuple[int, ...] = (3, 6, 9, 12)
    """Blocks of each member, trained one after the other (CAFF: 3, 6, 9, 12)."""
    dim: int = 96
    """Embedding dimension (CAFF: 96 for the language models, 192 for ViTs)."""
    heads: int = 3
    """Attention heads (CAFF: 3 for the language models, 6 for ViTs)."""
    context: int = 256
    """gpt: tokens per training window and the position embedding's length (CAFF: 256)."""
    patch_size: int = 4
    """vit: side of the square patches of the 32x32 images (CAFF: 4)."""
    corpus: str = "sst2_agnews"
    """What to pretrain on: sst2_agnews (gpt: SST-2 training sentences + AG News titles and
    descriptions) or cifar10_jpeg_0_4 (vit: CIFAR-10's training images of classes 0-4)."""
    tokenizer: str = "chars"
    """gpt: chars (LEAF's Shakespeare alphabet + unknown, 81 ids) or bytes (UTF-8, 256 ids)."""
    budget: int = 1_000_000
    """What each member trains on: tokens (gpt; steps = budget // (batch_size * context)) or
    images (vit; steps = budget // batch_size), repeats included."""
    batch_size: int = 32
    """Windows (gpt) or images (vit) per step."""
    lr: float = 5e-4
    """Peak AdamW learning rate, reached at the end of the warmup (CAFF: 5e-4 gpt, 1e-4 vit)."""
    min_lr: float = 5e-5
    """Learning rate at the last step, the end of the cosine decay (CAFF: 5e-5 gpt, 1e-5 vit)."""
    betas: tuple[float, ...] = (0.9, 0.95)
    """AdamW's (beta1, beta2)."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay of linear layers' (and the patch projection's) weights; biases,
    norms and embeddings are not decayed."""
    warmup_steps: int = 100
    """Steps over which the learning rate rises linearly to `lr`; then a cosine to `min_lr`."""
    grad_clip: float = 1.0
    """Clip the gradients' global norm to this; 0 turns clipping off."""
    augment: str = "crop_flip"
    """vit: training augmentation (none, flip, crop_flip)."""
    seed: int = 0
    """Seed of the initial weights, the data order and the augmentation."""
    eval_fraction: float = 0.05
    """Share of the corpus held out for the validation loss: the text's tail, or each class's last images."""
    checkpoint_every: int = 200
    """Write a resumable checkpoint every this many steps."""
    device: str = "auto"
    """auto (CUDA when available), cpu or cuda."""
    threads: int = 1
    """CPU threads for tensor ops (as backend.threads: on the project's 2-core machine, shared with
    another job, one thread ran these models 3-4x faster than two). Resuming with other threads or
    another device continues the run, but not bit for bit."""
    data_root: str = field(default_factory=default_data_root)
    """Folder holding the corpus' datasets (sst2/, ag_news/, cifar10_jpeg/); default env HFL_DATA, else ~/.cache/hfl."""
    cache_dir: str = field(default_factory=default_cache_dir)
    """Where `pretrained/<family>/` is written (and decoded images cached); default env HFL_CACHE, else ~/.cache/hfl."""

    def __post_init__(self) -> None:
        check(bool(FAMILY_NAME.match(self.family)), "family", self.family, "a folder name of letters, digits, '_', '-' and '.'")
        check_choice("model", self.model, ("gpt", "vit"))
        check(bool(self.depths) and len(set(self.depths)) == len(self.depths) and min(self.depths) >= 1,
              "depths", list(self.depths), "a non-empty list of distinct integers >= 1")
        for name in ("dim", "heads", "batch_size", "checkpoint_every", "threads"):
            check(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        check(self.dim % self.heads == 0, "heads", self.heads, f"a divisor of dim ({self.dim})")
        check(self.context >= 2, "context", self.context, "an integer >= 2")
        check(1 <= self.patch_size <= IMAGE_SIZE and IMAGE_SIZE % self.patch_size == 0, "patch_size", self.patch_size,
              f"a divisor of the image size {IMAGE_SIZE}")
        check_choice("corpus", self.corpus, TEXT_CORPORA if self.model == "gpt" else IMAGE_CORPORA)
        check_choice("tokenizer", self.tokenizer, TOKENIZERS)
        check(self.budget >= self.units_per_step, "budget", self.budget,
              f"at least one step's {self.unit}s (batch_size{' * context' if self.model == 'gpt' else ''} = {self.units_per_step})")
        check(self.lr > 0, "lr", self.lr, "a number > 0")
        check(0 <= self.min_lr <= self.lr, "min_lr", self.min_lr, f"a number in [0, lr] (lr is {self.lr})")
        check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas", list(self.betas), "two numbers in [0, 1)")
        check(self.weight_decay >= 0, "weight_decay", self.weight_decay, "a number >= 0")
        check(0 <= self.warmup_steps < self.steps, "warmup_steps", self.warmup_steps,
              f"an integer in [0, steps) (the budget gives {self.steps} steps)")
        check(self.grad_clip >= 0, "grad_clip", self.grad_clip, "a number >= 0 (0: no clipping)")
        check_choice("augment", self.augment, AUGMENTS)
        check(self.seed >= 0, "seed", self.seed, "an integer >= 0")
        check(0 < self.eval_fraction <= 0.5, "eval_fraction", self.eval_fraction, "a number in (0, 0.5]")
        check_choice("device", self.device, ("auto", "cpu", "cuda"))

    @property
    def unit(self) -> str:
        return "token" if self.model == "gpt" else "image"

    @property
    def units_per_step(self) -> int:
        return self.batch_size * (self.context if self.model == "gpt" else 1)

    @property
    def steps(self) -> int:
        return self.budget // self.units_per_step

    def lr_at(self, step: int) -> float:
        """Learning rate of (0-based) step `step`: linear warmup to `lr` over `warmup_steps`, then
        a cosine from `lr` at step `warmup_steps` to `min_lr` at the last step."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = self.steps - 1 - self.warmup_steps
        progress = (step - self.warmup_steps) / span if span > 0 else 1.0
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))

    def shape(self, depth: int, outputs: int) -> dict[str, Any]:
        """A member's architecture, as its card and the loader describe it."""
        common = {"model": self.model, "depth": depth, "dim": self.dim, "heads": self.heads}
        if self.model == "gpt":
            return {**common, "context": self.context, "vocab_size": outputs}
        return {**common, "patch_size": self.patch_size, "image_size": IMAGE_SIZE, "in_channels": 3, "num_classes": outputs}


def load_pretrain_config(path: str | Path, overrides: Sequence[str] = ()) -> PretrainConfig:
    """Read a pretraining YAML file and apply dotted overrides; the family is named after the file
    unless it says otherwise."""
    path = Path(path)
    values = read_yaml_mapping(path, "config", "a pretraining config: family, model, depths, corpus, budget, ...")
    values.setdefault("family", path.stem)
    return build_dataclass(PretrainConfig, apply_overrides(values, overrides), "")


def estimate_cpu_seconds(config: PretrainConfig) -> float | None:
    """Rough wall time of pretraining every member of `config` on a 2-core CPU, or None for shapes
    that were not measured."""
    size = config.context if config.model == "gpt" else config.patch_size
    table = CPU_SECONDS_PER_UNIT.get((config.model, config.dim, config.heads, size))
    if table is None:
        return None
    points = sorted(table.items())

    def per_unit(depth: int) -> float:  # linear between the measured depths, and beyond them
        (l0, s0), (l1, s1) = next((pair for pair in itertools.pairwise(points) if depth <= pair[1][0]), points[-2:])
        return max(s0 + (s1 - s0) * (depth - l0) / (l1 - l0), 0.0)

    return sum(per_unit(depth) * config.steps * config.units_per_step for depth in config.depths)
