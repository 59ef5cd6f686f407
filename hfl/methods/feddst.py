"""FedDST — Bibikar, Vikalo, Wang and Chen, "Federated Dynamic Sparse Training: Computing Less,
Communicating Less, Yet Learning Better", AAAI 2022 (arXiv:2112.09824) — as FedMef compares with it:
clients train a sparse model and readjust their own masks; the server averages and re-prunes.

- The server keeps a global mask at `sparsity` (a random ERK mask at first, drawn from the run's
  seed), in the method's checkpointed state; clients receive the kept entries and the mask.
- Every `adjust_every` rounds until `stop_round`, a client readjusts in the middle of its local
  training (after half its local steps, as FedMef runs it: 5 of 10 epochs): per layer it drops the
  ξ = ⌊α_r·n_l⌋ kept weights of smallest |θ| (n_l its kept count; density (1 − s)(1 − α_r)) and
  grows the ξ pruned entries of largest |dense gradient| of that step's batch (back to density
  1 − s), α_r = α/2·(1 + cos(rπ/r_end)). Grown weights start at 0; the client trains on with its new
  mask and sends its own mask's entries.
- The server averages each entry over the clients whose mask holds it (weighted by samples), takes
  the union of the client masks and keeps, per layer, the count of the global mask (its ERK count)
  with the largest |θ̄| in the union; the rest is zeroed.

Readings where the paper or FedMef's comparison leaves room, chosen deliberately:
- α defaults to 0.4, so that α_r = 0.2·(1 + cos(rπ/r_end)), the pruning number FedMef gives FedDST,
  FedTiny and FedMef alike; FedDST's own examples use α = 0.01–0.05 with rounds 10–15 apart.
- Growth picks among the entries pruned before the readjustment (`hfl.pruning.selection.prune_and_grow`,
  as FedTiny and FedMef grow), so a weight dropped in a readjustment is not regrown by it.
- The readjustment's dense gradient is that of the batch of the step it happens in, computed beside
  the step's own backward; the step then updates the grown weights from 0. hfl's client masks
  weights, not gradients, so the optimiser's momentum at a grown entry is what its gradients built
  while it was pruned.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from hfl.errors import check
from hfl.methods.base import Client, MethodState
from hfl.methods.sparse import AdjustedSparseConfig, SparseStart
from hfl.pruning.schedules import adjustment_count, feddst_adjustment_rate
from hfl.pruning.selection import prune_and_grow
from hfl.registry import METHODS
from hfl.submodel.spec import full_spec
from hfl.types import ClientTask, ClientUpdate, RoundContext, StateDict


@dataclass(frozen=True)
class FedDSTConfig(AdjustedSparseConfig):
    name: str = "feddst"
    alpha: float = 0.4
    """Initial readjustment rate α: α_r = α/2·(1 + cos(rπ/r_end)) of each layer's kept weights is
    dropped and regrown at a readjustment in round r (0.4: FedMef's comparison)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(0 <= self.alpha <= 1, "alpha", self.alpha, "a number in [0, 1]")


@dataclass(frozen=True)
class Readjustment:
    """A client-round that readjusts its mask (`ClientTask.options`)."""

    rate: float
    """α_r: the share of each layer's kept weights dropped and regrown."""
    at_step: int
    """Steps trained before the readjustment: half the client's local steps."""


def keep_largest_in_union(averaged: Mapping[str, Tensor], union: Mapping[str, Tensor], counts: Mapping[str, int]) -> dict[str, Tensor]:
    """The server's re-pruning: per key, the `counts[key]` entries of `union` with the largest |θ̄|."""
    masks = {}
    for key, held in union.items():
        score = averaged[key].abs().flatten().masked_fill(~held.flatten(), -float("inf"))
        kept = torch.zeros(held.numel(), dtype=torch.bool, device=held.device)
        kept[torch.topk(score, min(counts[key], int(held.sum()))).indices] = True
        masks[key] = kept.view(held.shape)
    return masks


@METHODS.register("feddst")
class FedDST(SparseStart):
    Config = FedDSTConfig

    def plan(self, ctx: RoundContext, state: MethodState) -> ClientTask | None:
        config = self.config
        rate = feddst_adjustment_rate(ctx.round, config.alpha, config.stop_round) if ctx.round % config.adjust_every == 0 else 0.0
        readjustment = None
        if rate > 0:
            steps = ctx.train.local_epochs * math.ceil(ctx.num_samples / ctx.train.batch_size)
            readjustment = Readjustment(rate, steps // 2)
        return ClientTask(ctx, replace(full_spec(), masks=state.masks), options=readjustment)

    def objective(self, client: Client, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        loss = F.cross_entropy(client.model(x), y)
        readjustment = client.task.options
        if readjustment is not None and client.steps == readjustment.at_step:
            self._readjust(client, loss, readjustment.rate)
        return {"loss": loss}

    def _readjust(self, client: Client, loss: Tensor, rate: float) -> None:
        params = dict(client.model.named_parameters())
        keys = list(client.masks)
        # retain_graph: the step's own backward runs through the same graph afterwards
        gradients = dict(zip(keys, torch.autograd.grad(loss, [params[k] for k in keys], retain_graph=True), strict=True))
        weights = {k: params[k].detach() for k in keys}
        counts = {k: adjustment_count(rate, int(m.sum())) for k, m in client.masks.items()}
        masks, _ = prune_and_grow(weights, client.masks, gradients, counts)
        client.replace_masks(masks)

    def aggregate(self, global_state: StateDict, updates: list[ClientUpdate], state: MethodState) -> tuple[StateDict, MethodState]:
        if not updates:
            return global_state, state
        averaged, state = super().aggregate(global_state, updates, state)
        union = {}
        for key in state.masks:
            device = averaged[key].device
            union[key] = torch.stack([u.spec.masks[key].to(device) for u in updates]).any(0)
        counts = {k: int(m.sum()) for k, m in state.masks.items()}
        masks = keep_largest_in_union(averaged, union, counts)
        pruned = {k: v * masks[k] if k in masks else v for k, v in averaged.items()}
        return pruned, replace(state, masks={k: m.cpu() for k, m in masks.items()})
