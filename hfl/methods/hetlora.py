"""HetLoRA — Cho, Liu, Xu, Fahrezi and Joshi, "Heterogeneous LoRA for Federated Fine-tuning of
On-Device Foundation Models", 2024 (arXiv:2401.06432), as CAFF (Pfeiffer et al. 2024, appendix B)
runs it: low-rank adapters of a rank fitted to each client's budget on a pretrained transformer.

Every linear layer of the transformer blocks (attention q, k, v and output projection, MLP fc1 and
fc2; the GPT's and the ViT's) gets an adapter, y = W x + b + scale * B (A x), A of shape (r, in), B of
shape (out, r). A starts kaiming-uniform (as Hu et al.'s LoRA) and B at zero, so the adapted model
starts equal to the pretrained one. The adapters live beside the layer's own weights (parameters
`lora_A`, `lora_B` and a forward hook), so the pretrained state keys are unchanged and
`model.pretrained` loads as for any method.

The global state holds adapters of the largest rank r_max of `ranks`. A client of rank r holds the
upper-left slices A[:r, :] and B[:, :r], r being the largest rank whose training fits its memory,
FLOPs and upload budgets (a client no rank fits sits the round out). It trains the adapters, every
LayerNorm and the output layer (final norm and head: CAFF saw bad results with adapters there);
the block linears' own weights and the embeddings (the `stem`: token and position embeddings, or
the ViT's patch projection and positions; it has no class token) stay frozen, never sent back.
The server averages every entry over the clients that hold it, each client once
(`weighting=clients`, as HeteroFL), which is how CAFF aggregates the adapters ("similarly to
HeteroFL"), rather than HetLoRA's zero-padded sparsity-weighted average with rank self-pruning.

The adapter term is scaled by alpha / r_max for every client, not by LoRA's alpha / r: a rank-r
client's adapter is the first r components of the shared one, and with one scale its model is the
global model with the adapter cut to those components, each component adding the same change to W
for every client that holds it. With alpha / r a small client would apply the shared components
r_max / r times as strongly as the global model does, and the average would mix entries trained
under different scales.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hfl.errors import check
from hfl.methods.base import LadderConfig, Method, Resources
from hfl.methods.transformer import (
    block_linears,
    check_ranks,
    embedding_keys,
    level_costs,
    require_transformer,
)
from hfl.models.base import ScalableModel
from hfl.registry import METHODS
from hfl.submodel.ladder import Level
from hfl.submodel.spec import SubmodelSpec, shape_model


@dataclass(frozen=True)
class HetLoRAConfig(LadderConfig):
    name: str = "hetlora"
    weighting: str = "clients"
    """Every adapter entry is averaged over the clients that hold it, each once (HeteroFL's rule,
    which CAFF's appendix B applies to the adapters)."""
    ranks: tuple[int, ...] = (3, 6, 12, 24, 48)
    """Adapter ranks a client may train; the global adapters have the largest (CAFF's figure 1 uses 3, 12, 24)."""
    alpha: float = 48.0
    """LoRA's alpha: every client scales the adapter term by alpha / max(ranks) (1 at the defaults)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ranks(self.ranks)
        check(isinstance(self.alpha, (int, float)) and not isinstance(self.alpha, bool) and self.alpha > 0, "alpha", self.alpha, "a positive number")


@dataclass(frozen=True)
class RankOptions:
    """A client of the rank ladder: its adapters' rank."""

    rank: int


def add_low_rank_term(linear: nn.Linear, args: tuple[Tensor, ...], output: Tensor) -> Tensor:
    """The adapter's forward hook. It reads the adapter from the module it is called on, so a copied
    model (the accountant's) or swapped weights (`torch.func.functional_call`) use their own."""
    return output + linear.lora_scale * F.linear(F.linear(args[0], linear.lora_A), linear.lora_B)


def add_adapters(model: ScalableModel, rank: int, scale: float) -> ScalableModel:
    """Give every linear layer of the model's transformer blocks a rank-`rank` adapter (A random, B
    zero: the model's outputs are unchanged until B trains)."""
    for linear in block_linears(model).values():
        weight = linear.weight
        linear.lora_A = nn.Parameter(nn.init.kaiming_uniform_(weight.new_empty(rank, linear.in_features), a=math.sqrt(5)))
        linear.lora_B = nn.Parameter(weight.new_zeros(linear.out_features, rank))
        linear.lora_scale = scale
        linear.register_forward_hook(add_low_rank_term)
    return model


@METHODS.register("hetlora")
class HetLoRA(Method):
    Config = HetLoRAConfig

    def __init__(self, config: HetLoRAConfig, resources: Resources) -> None:
        super().__init__(config, resources)
        model = resources.model
        require_transformer(model, "hetlora")
        self.max_rank = max(config.ranks)
        self.scale = config.alpha / self.max_rank
        self.model = self.adapt_model(model)
        linears = block_linears(self.model)
        self.adapter_keys = [(f"{name}.lora_A", f"{name}.lora_B") for name in linears]
        self.frozen = frozenset(
            [f"{name}.{key}" for name, linear in linears.items() for key in ("weight", "bias") if getattr(linear, key) is not None]
        ) | embedding_keys(self.model)
        levels = [Level(f"r{rank}", self.rank_spec(rank), RankOptions(rank)) for rank in sorted(config.ranks)]
        self.ladder = self.make_ladder(levels, tier_window=config.tier_window, table=lambda ctx: level_costs(self, ctx))

    def rank_spec(self, rank: int) -> SubmodelSpec:
        """Rows 0..rank-1 of every A and columns 0..rank-1 of every B; block weights and embeddings frozen."""
        kept = torch.arange(rank)
        indices: dict[str, dict[int, Tensor]] = {}
        for a, b in self.adapter_keys:
            indices[a], indices[b] = {0: kept}, {1: kept}
        return SubmodelSpec(indices=indices, frozen=self.frozen, variant=(("rank", rank),))

    def rank_of(self, spec: SubmodelSpec) -> int:
        """The adapters' rank a spec's model has (the global model's, r_max, unless the spec says)."""
        variant: dict[str, Any] = dict(spec.variant)
        return variant.get("rank", self.max_rank)

    def adapt_model(self, model: ScalableModel) -> ScalableModel:
        return add_adapters(model, self.max_rank, self.scale)

    def client_model(self, spec: SubmodelSpec, norm: str | None = None) -> nn.Module:
        plain = self.resources.build(self.width_of(spec), norm)
        return shape_model(add_adapters(plain, self.rank_of(spec), self.scale), spec)
