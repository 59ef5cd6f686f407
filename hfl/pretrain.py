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
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hfl
from hfl.data.corpora import (
    PRETRAIN_CLASSES,
    ImageCorpus,
    TextCorpus,
    load_image_corpus,
    load_text_corpus,
)
from hfl.data.transforms import BatchTransform
from hfl.errors import ConfigError, check
from hfl.models.family import (
    card_path,
    checkpoint_path,
    family_dir,
    member_model_name,
    weights_path,
)
from hfl.models.gpt import GPT
from hfl.models.vit import ViT
from hfl.pretrain_config import (  # noqa: F401  (the config and its estimate are `hfl pretrain`'s API too)
    IMAGE_SIZE,
    PretrainConfig,
    estimate_cpu_seconds,
    load_pretrain_config,
)
from hfl.seeding import (
    MODEL_STREAM,
    PRETRAIN_AUGMENT_STREAM,
    PRETRAIN_DATA_STREAM,
    derive_seed,
)
from hfl.storage import atomic_write

CHECKPOINT_FORMAT = 1
TRAIN_LOSS_STEPS = 100
"""The card's final training loss is the mean over this many last steps (fewer if the run is shorter)."""
RESUMABLE = ("family", "depths", "checkpoint_every", "device", "threads", "data_root", "cache_dir")
"""Fields that may differ between a run and its resumption: they do not change what is computed
(the corpus files are compared by hash instead of by path)."""


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
