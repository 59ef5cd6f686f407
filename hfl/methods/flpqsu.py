"""FL-PQSU's pruning — Xu, Hu, Zhu, Wu and Chen, "Accelerating Federated Learning for IoT in Big
Data Analytics With Pruning, Quantization and Selective Updating", IEEE Access 2021 — as FedMef's
comparison runs it (its Table 1 baseline): the initial global model is pruned once by weight
magnitude (L1), then FedAvg trains it with the mask fixed. Quantisation and selective updating are
not part of that comparison and are not implemented.

Deliberate choices: the layer densities follow the ERK split at `sparsity` (the initial density of
FedMef, FedTiny and FedDST, so every pruning method starts from the same per-layer budget); within a
layer the largest |θ| are kept. The mask is a function of the seed (the initial weights are drawn
under the run's model seed), so a resumed run rebuilds the same one; pruned entries are held at zero
and never sent.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from hfl.methods.base import Method, MethodState
from hfl.methods.sparse import SparseConfig, SparseStart
from hfl.pruning.masks import magnitude_masks, prunable_keys
from hfl.registry import METHODS
from hfl.seeding import MODEL_STREAM, derive_seed
from hfl.submodel.spec import full_spec
from hfl.types import ClientTask, RoundContext


@dataclass(frozen=True)
class FLPQSUConfig(SparseConfig):
    name: str = "flpqsu"


@METHODS.register("flpqsu")
class FLPQSU(SparseStart):
    Config = FLPQSUConfig

    def first_masks(self) -> dict[str, Tensor]:
        """The fixed mask, by magnitude of the server's initial weights (same seed, same build)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.resources.seed, MODEL_STREAM))
            dense = Method.initial_global_state(self)
        return magnitude_masks(dense, prunable_keys(self.model), self.config.sparsity)

    def plan(self, ctx: RoundContext, state: MethodState) -> ClientTask | None:
        return ClientTask(ctx, replace(full_spec(), masks=self.initial_masks))
