"""Decoupled — the baseline of ScaleFL (Ilhan, Su and Liu, CVPR 2023): one model per complexity
level, each trained only by the clients of that level, with no weights shared between levels.

A level is a width of HeteroFL's ladder, and a client's level the widest whose training memory fits
its budget, so Decoupled and HeteroFL differ only in sharing: HeteroFL's widths are nested slices of
one model, Decoupled's are separate models (kept side by side in the global state under `x<rate>.`).
Each level's model is averaged (FedAvg) over its own clients. "The global model" is the widest
level's; each level's model is also scored on its own, as ScaleFL reports Decoupled's local numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hfl.methods.base import MethodState
from hfl.methods.heterofl import HeteroFL, HeteroFLConfig
from hfl.models.base import ScalableModel
from hfl.registry import METHODS
from hfl.submodel.spec import SubmodelSpec
from hfl.types import ClientUpdate, RoundContext, StateDict


@dataclass(frozen=True)
class DecoupledConfig(HeteroFLConfig):
    name: str = "decoupled"
    scaler: bool = False
    """A level's model is whole, not a slice of a wider one: nothing to rescale."""


def level_prefix(rate: float) -> str:
    return f"x{rate:g}."


@METHODS.register("decoupled")
class Decoupled(HeteroFL):
    Config = DecoupledConfig
    paper = "the Decoupled baseline of Ilhan, Su and Liu, CVPR 2023 (ScaleFL)"
    preferred_norm = "bn"  # every model is trained whole by its clients: running statistics are valid

    def level_spec(self, rate: float) -> SubmodelSpec:
        return SubmodelSpec(width=self.model.width * rate, prefix=level_prefix(rate))

    def initial_global_state(self, build: Callable[[float], ScalableModel]) -> StateDict:
        state: StateDict = {}
        for rate in sorted(self.config.widths, reverse=True):
            for key, value in build(self.model.width * rate).state_dict().items():
                state[level_prefix(rate) + key] = value
        return state

    def spec_for(self, rate: float, ctx: RoundContext) -> SubmodelSpec:
        return self.level_spec(rate)

    def init_state(self) -> MethodState:
        return {"trained_levels": []}

    def aggregate(
        self, global_state: StateDict, updates: list[ClientUpdate], state: MethodState
    ) -> tuple[StateDict, MethodState]:
        new, state = super().aggregate(global_state, updates, state)
        trained = set(state["trained_levels"]) | {u.spec.width / self.model.width for u in updates}
        return new, {**state, "trained_levels": sorted(trained)}

    def global_model_spec(self, state: MethodState) -> SubmodelSpec:
        return self.level_spec(max(self.config.widths))

    def submodels(self, state: MethodState) -> dict[str, SubmodelSpec]:
        """The levels some client has trained: a level no budget maps to is never trained, and its
        untouched initial weights would only drag the worst and mean accuracy to chance."""
        rates = [r for r in sorted(self.config.widths) if any(abs(r - t) < 1e-9 for t in state.get("trained_levels", []))]
        return {f"x{rate:g}": self.level_spec(rate) for rate in rates}
