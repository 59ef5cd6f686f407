"""`hfl pretrain`: centrally pretrain a family of tiny transformers (CAFF's F_l, l = 3, 6, 9, 12).

Pfeiffer et al. 2024 ("Efficient Federated Finetuning of Tiny Transformers with Resource-Constrained
Devices", section 4.1) start federated finetuning from transformers pretrained centrally: language
models (embedding 96, 3 heads, context 256) on OpenWebText, ViTs (embedding 192, 6 heads, patch 4)
on downscaled ImageNet, AdamW (betas 0.9, 0.95; weight decay 0.1 on linear layers) with a cosine
decay of the learning rate. Neither corpus is available offline, so hfl pretrains on local data
that is not the downstream task's (`hfl.data.corpora`): SST-2 and AG News text for the language
models, CIFAR-10 classes 0-4 for the ViTs. Each member trains on the same data order (windows or
image order drawn from (seed, step)), so the family differs only in depth.

The loop is plain torch, not Lightning: one model, one optimiser, one data stream, and exact
resumption mid-run needs the optimiser state, the step and the loss history in one atomic file,
which a 60-line loop makes obvious and Lightning's checkpoint/fit-loop state would only hide. Every
random draw is a function of (seed, step), so a run killed at any moment (SIGKILL included)
resumes from its last checkpoint to the same final weights, bit for bit, as an uninterrupted run
on the same device.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hfl
from hfl.checkpoint import atomic_write
from hfl.config import apply_overrides, build_dataclass, read_yaml_mapping
from hfl.data.corpora import (
    IMAGE_CORPORA,
    PRETRAIN_CLASSES,
    TEXT_CORPORA,
    ImageCorpus,
    TextCorpus,
    load_image_corpus,
    load_text_corpus,
)
from hfl.data.datasets import default_cache_dir, default_data_root
from hfl.data.text import TOKENIZERS
from hfl.data.transforms import AUGMENTS, BatchTransform
from hfl.errors import ConfigError, check, check_choice
from hfl.models.family import (
    FAMILY_NAME,
    card_path,
    checkpoint_path,
    family_dir,
    member_model_name,
    weights_path,
)
from hfl.models.gpt import GPT
from hfl.models.vit import ViT
from hfl.seeding import (
    MODEL_STREAM,
    PRETRAIN_AUGMENT_STREAM,
    PRETRAIN_DATA_STREAM,
    derive_seed,
)

IMAGE_SIZE = 32
CHECKPOINT_FORMAT = 1
TRAIN_LOSS_STEPS = 100
"""The card's final training loss is the mean over this many last steps (fewer if the run is shorter)."""
RESUMABLE = ("family", "depths", "checkpoint_every", "device", "threads", "data_root", "cache_dir")
"""Fields that may differ between a run and its resumption: they do not change what is computed
(the corpus files are compared by hash instead of by path)."""

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


# -- the loop ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepInfo:
    depth: int
    step: int
    """Steps done (1-based after the step)."""
    steps: int
    loss: Tensor
    """The step's loss, a 0-dim tensor on the training device (`.item()` synchronises)."""


class PretrainCallback(Protocol):
    """What the CLI's progress display (or a test's hook) is told."""

    def on_member_start(self, depth: int, steps: int, done: int, config: PretrainConfig) -> None: ...

    def on_step(self, info: StepInfo) -> None: ...

    def on_member_end(self, card: dict[str, Any]) -> None: ...


def build_member(config: PretrainConfig, depth: int, outputs: int) -> nn.Module:
    """A member of the family with `outputs` token ids (gpt) or classes (vit), at its seeded initialisation."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(config.seed, MODEL_STREAM, depth))
        if config.model == "gpt":
            return GPT(outputs, dim=config.dim, depth=depth, heads=config.heads, context=config.context)
        return ViT(3, outputs, patch_size=config.patch_size, dim=config.dim, depth=depth, heads=config.heads, image_size=IMAGE_SIZE)


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: the weights of linear layers (and of the ViT's patch projection, a linear map
    of each patch) decay, as in CAFF; biases, norms and embeddings do not."""
    decayed = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))}
    params = list(model.parameters())
    return [
        {"params": [p for p in params if id(p) in decayed], "weight_decay": weight_decay},
        {"params": [p for p in params if id(p) not in decayed], "weight_decay": 0.0},
    ]


class TextBatches:
    """Random contiguous windows of the training tokens; step s's windows depend on (seed, s) only."""

    def __init__(self, corpus: TextCorpus, config: PretrainConfig, device: torch.device) -> None:
        check(len(corpus.train) > config.context, "context", config.context,
              f"fewer than the corpus' {len(corpus.train)} training tokens")
        check(len(corpus.val) > config.context, "eval_fraction", config.eval_fraction,
              f"a share whose {len(corpus.val)} held-out tokens exceed the context ({config.context})")
        self.config, self.device = config, device
        self.train, self.val = corpus.train.to(device), corpus.val.to(device)
        self.offsets = torch.arange(config.context + 1, device=device)

    def batch(self, step: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(derive_seed(self.config.seed, PRETRAIN_DATA_STREAM, step))
        starts = torch.randint(0, len(self.train) - self.config.context, (self.config.batch_size,), generator=g)
        windows = self.train[starts.to(self.device)[:, None] + self.offsets]
        return windows[:, :-1], windows[:, 1:]

    def validation(self) -> list[tuple[Tensor, Tensor]]:
        """The held-out tail as consecutive, non-overlapping windows, in batches."""
        c = self.config.context
        n = (len(self.val) - 1) // c
        x, y = self.val[: n * c].view(n, c), self.val[1 : n * c + 1].view(n, c)
        b = self.config.batch_size
        return [(x[i : i + b], y[i : i + b]) for i in range(0, n, b)]


class ImageBatches:
    """Every training image once per epoch, in an order drawn from (seed, epoch); step s's
    augmentation is drawn from (seed, s)."""

    def __init__(self, corpus: ImageCorpus, config: PretrainConfig, device: torch.device) -> None:
        self.config, self.device = config, device
        self.train_x, self.train_y = corpus.train_x.to(device), corpus.train_y.to(device)
        self.val_x, self.val_y = corpus.val_x.to(device), corpus.val_y.to(device)
        self.transform = BatchTransform(corpus.mean, corpus.std, config.augment, device)
        self._orders: dict[int, Tensor] = {}

    def _order(self, epoch: int) -> Tensor:
        if epoch not in self._orders:
            if len(self._orders) > 1:
                self._orders.pop(min(self._orders))
            g = torch.Generator().manual_seed(derive_seed(self.config.seed, PRETRAIN_DATA_STREAM, epoch))
            self._orders[epoch] = torch.randperm(len(self.train_y), generator=g)
        return self._orders[epoch]

    def batch(self, step: int) -> tuple[Tensor, Tensor]:
        n, b = len(self.train_y), self.config.batch_size
        sample = torch.arange(step * b, (step + 1) * b)
        epochs = sample // n
        index = torch.empty(b, dtype=torch.int64)
        for epoch in epochs.unique().tolist():  # one epoch, or the end of one and the start of the next
            here = epochs == epoch
            index[here] = self._order(epoch)[sample[here] % n]
        index = index.to(self.device)
        g = torch.Generator().manual_seed(derive_seed(self.config.seed, PRETRAIN_AUGMENT_STREAM, step))
        return self.transform(self.train_x[index], train=True, generator=g), self.train_y[index]

    def validation(self) -> list[tuple[Tensor, Tensor]]:
        b = self.config.batch_size
        return [(self.transform(self.val_x[i : i + b], train=False), self.val_y[i : i + b]) for i in range(0, len(self.val_y), b)]


def _comparable(config: PretrainConfig, sources: Sequence[Any]) -> dict[str, Any]:
    """What a checkpoint or card must agree on with the config that resumes or reuses it."""
    values = {k: v for k, v in dataclasses.asdict(config).items() if k not in RESUMABLE}
    values["betas"] = list(values["betas"])
    values["corpus_sha256"] = [s.sha256 for s in sources]
    return values


def _check_same(saved: dict[str, Any], now: dict[str, Any], what: Path) -> None:
    changed = {k: (saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)}
    if changed:
        shown = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())
        raise ConfigError("family", what.parent.name,
                          f"the config {what.name} was written with, or a new family name (differs in {shown}); "
                          f"delete {what} to start that member again")


def _device(config: PretrainConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "cuda", "auto or cpu: this machine has no CUDA device")
    return torch.device(config.device)


def _mean_loss(model: nn.Module, batches: list[tuple[Tensor, Tensor]]) -> tuple[float, float]:
    """Mean cross-entropy over every prediction of `batches` and the share of correct top-1 predictions."""
    total, correct, count = 0.0, 0, 0
    model.eval()
    with torch.no_grad():
        for x, y in batches:
            logits = model(x)
            total += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(1) == y).sum())
            count += y.numel()
    model.train()
    return total / count, correct / count


def _member_done(config: PretrainConfig, depth: int) -> dict[str, Any] | None:
    card = card_path(config.cache_dir, config.family, depth)
    if card.is_file() and weights_path(config.cache_dir, config.family, depth).is_file():
        return json.loads(card.read_text())
    return None


def pretrain_member(config: PretrainConfig, depth: int, data: TextBatches | ImageBatches, corpus: TextCorpus | ImageCorpus,
                    callback: PretrainCallback | None = None) -> dict[str, Any]:
    """Pretrain (or resume, or reuse) the member with `depth` blocks; returns its card."""
    from safetensors.torch import save as safetensors_bytes

    device = data.device
    outputs = corpus.vocab_size if isinstance(corpus, TextCorpus) else corpus.num_classes
    comparable = _comparable(config, corpus.sources)
    cards, checkpoint = card_path(config.cache_dir, config.family, depth), checkpoint_path(config.cache_dir, config.family, depth)
    done_card = _member_done(config, depth)
    if done_card is not None:
        _check_same(done_card["config_compared"], comparable, cards)
        if callback:
            callback.on_member_end(done_card)
        return done_card
    model = build_member(config, depth, outputs).to(device)
    optimizer = torch.optim.AdamW(parameter_groups(model, config.weight_decay), lr=config.lr, betas=tuple(config.betas))
    losses = torch.zeros(config.steps, device=device)
    step, elapsed = 0, 0.0
    if checkpoint.is_file():
        saved = torch.load(checkpoint, map_location=device, weights_only=True)
        _check_same(saved["config_compared"], comparable, checkpoint)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step, elapsed = int(saved["step"]), float(saved["elapsed_seconds"])
        losses[:step] = saved["losses"].to(device)
    if callback:
        callback.on_member_start(depth, config.steps, step, config)
    family_dir(config.cache_dir, config.family).mkdir(parents=True, exist_ok=True)
    model.train()
    start = time.perf_counter() - elapsed
    while step < config.steps:
        for group in optimizer.param_groups:
            group["lr"] = config.lr_at(step)
        x, y = data.batch(step)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if config.grad_clip:
            nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        losses[step] = loss.detach()
        step += 1
        if step % config.checkpoint_every == 0 and step < config.steps:
            payload = {
                "format": CHECKPOINT_FORMAT, "config_compared": comparable, "step": step,
                "elapsed_seconds": time.perf_counter() - start, "losses": losses[:step].cpu(),
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            }
            atomic_write(checkpoint, lambda f, payload=payload: torch.save(payload, f))
        if callback:
            callback.on_step(StepInfo(depth, step, config.steps, loss.detach()))
    val_loss, val_accuracy = _mean_loss(model, data.validation())
    wall = time.perf_counter() - start
    shape = config.shape(depth, outputs)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    # The same run writes the same bytes: the metadata holds only what the weights are, as one key
    # (safetensors writes several keys in an order that changes from process to process).
    about = json.dumps({"family": config.family, "depth": depth, "shape": shape}, sort_keys=True)
    blob = safetensors_bytes(state, metadata={"hfl": about})
    atomic_write(weights_path(config.cache_dir, config.family, depth), lambda f: f.write(blob))
    card = {
        "family": config.family,
        "depth": depth,
        "shape": shape,
        "parameters": sum(p.numel() for p in model.parameters()),
        "weights_sha256": hashlib.sha256(blob).hexdigest(),
        "model_name": member_model_name(shape),
        "corpus": {
            "name": config.corpus,
            "sources": [dataclasses.asdict(s) for s in corpus.sources],
            **({"train_tokens": len(corpus.train), "val_tokens": len(corpus.val)} if isinstance(corpus, TextCorpus)
               else {"classes": list(PRETRAIN_CLASSES), "train_images": len(corpus.train_y), "val_images": len(corpus.val_y)}),
        },
        "tokenizer": config.tokenizer if config.model == "gpt" else None,
        "steps": config.steps,
        "batch_size": config.batch_size,
        "tokens_seen": config.steps * config.units_per_step * (1 if config.model == "gpt" else (IMAGE_SIZE // config.patch_size) ** 2),
        **({"images_seen": config.steps * config.batch_size} if config.model == "vit" else {}),
        "final_train_loss": float(losses[-TRAIN_LOSS_STEPS:].mean()),
        "final_train_loss_steps": min(TRAIN_LOSS_STEPS, config.steps),
        "final_val_loss": val_loss,
        "final_val_accuracy": val_accuracy,
        "seed": config.seed,
        "wall_seconds": round(wall, 3),
        "device": str(device),
        "hfl_version": hfl.__version__,
        "torch_version": torch.__version__,
        "config": {**dataclasses.asdict(config), "betas": list(config.betas), "depths": list(config.depths)},
        "config_compared": comparable,
    }
    atomic_write(cards, lambda f: f.write((json.dumps(card, indent=2) + "\n").encode()))
    checkpoint.unlink(missing_ok=True)
    if callback:
        callback.on_member_end(card)
    return card


def pretrain(config: PretrainConfig, callback: PretrainCallback | None = None) -> list[dict[str, Any]]:
    """Pretrain every member of the family in `config.depths` order (finished members are reused,
    interrupted ones resumed); returns their cards."""
    device = _device(config)
    corpus: TextCorpus | ImageCorpus
    if config.model == "gpt":
        corpus = load_text_corpus(config.corpus, config.data_root, config.tokenizer, config.eval_fraction)
        data: TextBatches | ImageBatches = TextBatches(corpus, config, device)
    else:
        corpus = load_image_corpus(config.corpus, config.data_root, config.cache_dir, config.eval_fraction)
        data = ImageBatches(corpus, config, device)
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return [pretrain_member(config, depth, data, corpus, callback) for depth in config.depths]
    finally:
        torch.set_num_threads(threads)
