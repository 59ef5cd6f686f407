"""Decoupled — the baseline of ScaleFL (Ilhan, Su and Liu, CVPR 2023): one model per complexity
level, each trained only by the clients of that level, with no weights shared between levels.

A level is a width of HeteroFL's ladder, and a client's level the widest whose training memory fits
its budget, so Decoupled and HeteroFL differ only in sharing: HeteroFL's widths are nested slices of
one model, Decoupled's are separate models (kept side by side in the global state under `x<rate>.`).
Each level's model is averaged (FedAvg) over its own clients. "The global model" is the widest
level's; each level's model some client has trained is also scored on its own, as ScaleFL reports
Decoupled's local numbers (a level no budget maps to keeps its initial weights and is not scored).
"""

from __future__ import annotations

from dataclasses import dataclass

from hfl.methods.base import Resources
from hfl.methods.heterofl import HeteroFL, HeteroFLConfig
from hfl.registry import METHODS
from hfl.submodel.spec import SubmodelSpec
from hfl.types import StateDict


@dataclass(frozen=True)
class DecoupledConfig(HeteroFLConfig):
    name: str = "decoupled"
    weighting: str = "samples"
    """Each level's model is averaged by FedAvg over its own clients."""
    scaler: bool = False
    """A level's model is whole, not a slice of a wider one: nothing to rescale."""


def level_prefix(rate: float) -> str:
    return f"x{rate:g}."


@METHODS.register("decoupled")
class Decoupled(HeteroFL):
    Config = DecoupledConfig
    preferred_norm = "bn"  # every model is trained whole by its clients: running statistics are valid

    def __init__(self, config: DecoupledConfig, resources: Resources) -> None:
        super().__init__(config, resources, evaluated="trained", global_model="largest")

    def level_spec(self, rate: float) -> SubmodelSpec:
        return SubmodelSpec(width=self.model.width * rate, prefix=level_prefix(rate))

    def initial_global_state(self) -> StateDict:
        state: StateDict = {}
        for rate in sorted(self.config.widths, reverse=True):
            for key, value in self.build(self.model.width * rate).state_dict().items():
                state[level_prefix(rate) + key] = value
        return state
