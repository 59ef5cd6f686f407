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

from hfl.errors import check
from hfl.methods.base import Method, MethodConfig, MethodState, Resources
from hfl.pruning.masks import magnitude_masks, prunable_keys
from hfl.registry import METHODS
from hfl.seeding import MODEL_STREAM, derive_seed
from hfl.submodel.spec import full_spec
from hfl.types import ClientTask, RoundContext, StateDict


@dataclass(frozen=True)
class FLPQSUConfig(MethodConfig):
    name: str = "flpqsu"
    sparsity: float = 0.9
    """Share of the prunable weights (convolutions and linear layers) pruned once, before training."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(0 <= self.sparsity < 1, "sparsity", self.sparsity, "a number in [0, 1)")


@METHODS.register("flpqsu")
class FLPQSU(Method):
    Config = FLPQSUConfig

    def __init__(self, config: FLPQSUConfig, resources: Resources) -> None:
        super().__init__(config, resources)
        with torch.random.fork_rng(devices=[]):  # the server's initial weights: same seed, same build
            torch.manual_seed(derive_seed(resources.seed, MODEL_STREAM))
            dense = super().initial_global_state()
        self.masks = magnitude_masks(dense, prunable_keys(self.model), config.sparsity)
        """The fixed mask: False entries are pruned for the whole run."""
        self._pruned = {k: v * self.masks[k] if k in self.masks else v for k, v in dense.items()}

    def initial_global_state(self) -> StateDict:
        return {k: v.clone() for k, v in self._pruned.items()}

    def plan(self, ctx: RoundContext, state: MethodState) -> ClientTask | None:
        return ClientTask(ctx, replace(full_spec(), masks=self.masks))
