"""What the methods that finetune a pretrained transformer share (CAFF, HetLoRA, FedHM): the check
that the model is one, its block linears, its embeddings, the check of a rank list, and `hfl budget`'s
row per rank level."""

from __future__ import annotations

from typing import Any

from torch import nn

from hfl.errors import ConfigError, check
from hfl.methods.base import Method
from hfl.models.base import ScalableModel
from hfl.types import RoundContext


def require_transformer(model: ScalableModel, method: str) -> None:
    """A ConfigError unless every body block of `model` is a transformer block (GPT's or ViT's)."""
    from hfl.models.gpt import DecoderBlock
    from hfl.models.vit import EncoderBlock

    if not len(model.body) or not all(isinstance(block, (DecoderBlock, EncoderBlock)) for block in model.body):
        raise ConfigError("model.name", type(model).__name__.lower(), f"a transformer: gpt*, vit* ({method} works on transformer blocks)")


def block_linears(model: ScalableModel) -> dict[str, nn.Linear]:
    """Every linear layer of the model's transformer blocks (attention q, k, v, output projection;
    MLP fc1, fc2), by qualified module name: the layers HetLoRA adapts and FedHM factorises."""
    return {
        f"body.{i}.{name}": module
        for i, block in enumerate(model.body)
        for name, module in block.named_modules()
        if isinstance(module, nn.Linear)
    }


def embedding_keys(model: ScalableModel) -> frozenset[str]:
    """State keys of the model's embeddings, its `stem` (token and position embeddings, or the ViT's
    patch projection and positions), which CAFF keeps frozen for every method it compares."""
    return frozenset(f"stem.{key}" for key in model.stem.state_dict())


def check_ranks(ranks: tuple[int, ...]) -> None:
    """A ConfigError on the field `ranks` unless it is a non-empty list of distinct positive integers
    (HetLoRA's adapter ranks, FedHM's factor ranks)."""
    valid = bool(ranks) and all(isinstance(r, int) and not isinstance(r, bool) and r > 0 for r in ranks)
    check(valid and len(set(ranks)) == len(ranks), "ranks", list(ranks), "distinct positive integers")


def level_costs(method: Method, ctx: RoundContext) -> list[dict[str, Any]]:
    """`hfl budget`'s row per level of `method`'s ladder (`Ladder(table=...)`): its options, what a
    client of it uploads and its forward FLOPs per sample (the ladder adds the training memory).
    Where a level saves upload and FLOPs far more than memory (a rank), this is where it shows."""
    rows = []
    for level in method.ladder.levels:
        cost = method.training_cost(method.ladder.task_for(ctx, level), method.resources.batch_size)
        rows.append({"name": level.name, **vars(level.options), "upload_bytes": method.upload_bytes(level.spec), "flops": cost.forward_flops_per_sample})
    return rows
