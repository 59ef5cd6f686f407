"""What the sparse-training methods share (FL-PQSU, FedDST, FedTiny, FedMef): a sparsity, a global
mask that starts from the run's seed, and initial weights that are zero where it prunes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hfl.errors import check
from hfl.methods.base import Method, MethodConfig, Resources
from hfl.pruning.masks import random_masks
from hfl.seeding import MASK_STREAM, derive_seed
from hfl.types import StateDict


@dataclass(frozen=True)
class SparseConfig(MethodConfig):
    sparsity: float = 0.9
    """Share of the prunable weights (convolutions and linear layers) pruned; each layer's share
    follows the ERK split and stays fixed for the run."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(0 <= self.sparsity < 1, "sparsity", self.sparsity, "a number in [0, 1)")


@dataclass(frozen=True)
class AdjustedSparseConfig(SparseConfig):
    """A sparse method whose masks change every few rounds until a last round."""

    adjust_every: int = 10
    """ΔR: rounds between two mask adjustments, the rounds divisible by it (the papers' 10 at 500 rounds)."""
    stop_round: int = 300
    """The last round whose masks may change (R_stop, r_end: the papers' 300 at 500 rounds)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(isinstance(self.adjust_every, int) and self.adjust_every >= 1, "adjust_every", self.adjust_every, "an integer >= 1")
        check(isinstance(self.stop_round, int) and self.stop_round >= 1, "stop_round", self.stop_round, "an integer >= 1")


class SparseStart(Method):
    """A method whose global model starts sparse: `first_masks` (by default random, with ERK layer
    densities, drawn from the run's seed) and the initial weights zeroed where they prune."""

    def __init__(self, config: SparseConfig, resources: Resources) -> None:
        super().__init__(config, resources)
        self.initial_masks = self.first_masks()
        """The global mask before round 1: {prunable state key: bool tensor}, False entries pruned."""

    def first_masks(self) -> dict[str, Tensor]:
        generator = torch.Generator().manual_seed(derive_seed(self.resources.seed, MASK_STREAM))
        return random_masks(self.model, self.config.sparsity, generator)

    def initial_global_state(self) -> StateDict:
        dense = super().initial_global_state()
        return {k: v * self.initial_masks[k].to(v.device) if k in self.initial_masks else v for k, v in dense.items()}
