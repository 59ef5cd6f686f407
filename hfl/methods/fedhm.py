"""FedHM — Yao, Pan, O'Neill, Dai, Wan, Jin and Sun, "FedHM: Efficient Federated Learning for
Heterogeneous Models via Low-rank Factorization", 2021 (arXiv:2111.14655), as CAFF (Pfeiffer et al.
2024, appendix B, Eq. 6) adapts it to transformers: clients train low-rank factors of the dense model.

The server keeps the dense model. Every client trains each linear layer of the transformer blocks
(attention q, k, v and output projection, MLP fc1 and fc2; the GPT's and the ViT's) as two factors
of the SVD of the current global weight W (out P x in Q) = U S V^T: x -> `vt` (V_z^T, z x Q, no
bias) -> `us` (U_z diag(S_z), P x z, with the layer's bias), z the largest of `ranks` whose training
fits the client's memory, FLOPs and upload budgets (Eq. 6); a client nothing fits sits the round
out. With `train_dense` a client whose budgets allow trains the dense model instead (the ladder's
top level, `dense`): appendix B picks the member the least constrained client could train without
SVD, but its Table 2 never marks FedHM as degrading to FedAvg where the width baselines do, so its
clients train factors; with dense training allowed, the memory budgets of CAFF's grids let every
client train the dense member, which is FedAvg. The embeddings and the output layer stay dense, as FedHM keeps the first and the last layer
full; with `freeze_embeddings` (CAFF's setting for every method it compares) the embeddings are not
trained at all. LayerNorms and the head train as usual.

Each round every factorised client receives factors computed afresh from the global weights
(`client_state`); the server rebuilds each factorised update to the dense W' = (U S)_z V_z^T and
takes the masked mean of the dense updates, weighted by samples as FedHM (FedAvg's weighting). A
client uploads what it trained (the factors, LayerNorms and head). The global model is scored dense.

Ranks are absolute, as HetLoRA's, so the CAFF comparison sweeps both methods over the same values;
each is at most min(P, Q) of every block linear (the embedding width in these transformers), so one
z holds for every layer (its ratio to min(P, Q) is z / width). Above z = PQ / (P + Q) a factorised
layer holds more weights than the dense one. A lower rank saves upload and FLOPs, hardly memory
(activations dominate: CAFF's figure 4); `hfl budget` prints each rank's costs. CAFF also picks the
depth of the model so that the least constrained client trains it dense: here the configured model.

The SVD runs on the CPU in float64: the factors are the same whichever device trains (cuSOLVER's
signs and rounding differ from LAPACK's), and at full rank they rebuild W to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from hfl.errors import check
from hfl.methods.base import LadderConfig, Method, MethodState, Resources
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
from hfl.types import ClientUpdate, StateDict


@dataclass(frozen=True)
class FedHMConfig(LadderConfig):
    name: str = "fedhm"
    ranks: tuple[int, ...] = (3, 6, 12, 24, 48)
    """Ranks z a client may train, each at most min(out, in) of every block linear (the embedding
    width); with `train_dense`, the dense model is the ladder's top level above them. HetLoRA's defaults."""
    train_dense: bool = False
    """Let a client whose budgets allow it train the dense model instead of factors (see the module docstring)."""
    freeze_embeddings: bool = True
    """Keep the embeddings (token and position, or the ViT's patch projection and positions) frozen
    for every client, as CAFF does for every method it compares."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ranks(self.ranks)
        check(isinstance(self.freeze_embeddings, bool), "freeze_embeddings", self.freeze_embeddings, "true or false")
        check(isinstance(self.train_dense, bool), "train_dense", self.train_dense, "true or false")


@dataclass(frozen=True)
class RankOptions:
    """A client of the ladder: the rank of its factors; None for the dense model."""

    rank: int | None

    def __str__(self) -> str:
        return "the dense model" if self.rank is None else f"rank-{self.rank} factors of every block linear"


class FactorisedLinear(nn.Module):
    """A P x Q linear layer as x -> us(vt(x)): vt is z x Q without bias, us is P x z with the layer's bias."""

    def __init__(self, dense: nn.Linear, rank: int) -> None:
        super().__init__()
        self.in_features, self.out_features = dense.in_features, dense.out_features  # the ViT's attention reads them
        where = {"device": dense.weight.device, "dtype": dense.weight.dtype}  # a meta model stays on meta
        self.vt = nn.Linear(dense.in_features, rank, bias=False, **where)
        self.us = nn.Linear(rank, dense.out_features, bias=dense.bias is not None, **where)

    def forward(self, x: Tensor) -> Tensor:
        return self.us(self.vt(x))


def factorise(model: ScalableModel, rank: int) -> ScalableModel:
    """Replace every linear layer of the model's transformer blocks by a rank-`rank` factorised one."""
    for name, dense in block_linears(model).items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, FactorisedLinear(dense, rank))
    return model


def truncated_svd(weight: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """(U_z diag(S_z), V_z^T) of `weight` = U S V^T, computed on the CPU in float64 (see the module
    docstring), returned in the weight's dtype and device."""
    u, s, vt = torch.linalg.svd(weight.detach().to("cpu", torch.float64), full_matrices=False)
    return (u[:, :rank] * s[:rank]).to(weight), vt[:rank].to(weight)


@METHODS.register("fedhm")
class FedHM(Method):
    Config = FedHMConfig

    def __init__(self, config: FedHMConfig, resources: Resources) -> None:
        super().__init__(config, resources)
        require_transformer(self.model, "fedhm")
        linears = block_linears(self.model)
        self.factorised = tuple(linears)
        """Module names of the layers a factorised client holds as factors."""
        limit = min(min(layer.in_features, layer.out_features) for layer in linears.values())
        check(max(config.ranks) <= limit, "method.ranks", list(config.ranks), f"ranks of at most {limit}, min(out, in) of the model's block linears")
        self.frozen = embedding_keys(self.model) if config.freeze_embeddings else frozenset()
        levels = [Level(f"r{rank}", self.rank_spec(rank), RankOptions(rank)) for rank in sorted(config.ranks)]
        if config.train_dense:
            levels.append(Level("dense", SubmodelSpec(frozen=self.frozen), RankOptions(None)))
        # Scoring a rank level costs an SVD of every block linear and a pass over the test set: only the trained ones.
        self.ladder = self.make_ladder(levels, tier_window=config.tier_window, evaluated="trained", table=lambda ctx: level_costs(self, ctx))

    def rank_spec(self, rank: int) -> SubmodelSpec:
        return SubmodelSpec(frozen=self.frozen, variant=(("rank", rank),))

    @staticmethod
    def rank_of(spec: SubmodelSpec) -> int | None:
        """The factors' rank of a spec's model; None for the dense model."""
        variant: dict[str, Any] = dict(spec.variant)
        return variant.get("rank")

    def client_model(self, spec: SubmodelSpec, norm: str | None = None) -> nn.Module:
        model = self.build(self.width_of(spec), norm)
        rank = self.rank_of(spec)
        return shape_model(model if rank is None else factorise(model, rank), spec)

    def client_state(self, global_state: StateDict, spec: SubmodelSpec) -> StateDict:
        """The dense client's slice of the global state; a factorised client's holds, for every
        block linear, the rank-z truncated SVD factors of the global weight instead of the weight."""
        state = super().client_state(global_state, spec)
        rank = self.rank_of(spec)
        if rank is None:
            return state
        for name in self.factorised:
            state[f"{name}.us.weight"], state[f"{name}.vt.weight"] = truncated_svd(state.pop(f"{name}.weight"), rank)
            if f"{name}.bias" in state:
                state[f"{name}.us.bias"] = state.pop(f"{name}.bias")
        return state

    def dense_update(self, update: ClientUpdate) -> StateDict:
        """The update's tensors in the global state's form: each pair of factors multiplied back to
        W' = (U S)_z V_z^T (in float64, like the factorisation)."""
        sent = dict(update.state)
        if self.rank_of(update.spec) is None:
            return sent
        for name in self.factorised:
            us, vt = sent.pop(f"{name}.us.weight"), sent.pop(f"{name}.vt.weight")
            sent[f"{name}.weight"] = (us.double() @ vt.double()).to(us.dtype)
            if f"{name}.us.bias" in sent:
                sent[f"{name}.bias"] = sent.pop(f"{name}.us.bias")
        return sent

    def aggregate(self, global_state: StateDict, updates: list[ClientUpdate], state: MethodState) -> tuple[StateDict, MethodState]:
        return super().aggregate(global_state, [replace(u, state=self.dense_update(u)) for u in updates], state)
