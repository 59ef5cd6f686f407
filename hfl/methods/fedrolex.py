"""FedRolex — Alam et al., "FedRolex: Model-Heterogeneous Federated Learning with Rolling Sub-Model
Extraction", NeurIPS 2022. HeteroFL with a window of channels that rolls by one every round, so
every channel is trained over time even when no client fits the full model.

The index rule is the CAFF paper's appendix B, Eq. 8-9: in round r a width-s client holds channels
{r', ..., r' + floor(s Q) - 1} of a Q-channel layer, wrapping around, with r' = r mod Q (hfl's
rounds count from 1, so round 1 starts at channel 0)."""

from __future__ import annotations

from dataclasses import dataclass

from hfl.methods.base import Resources
from hfl.methods.heterofl import HeteroFL, HeteroFLConfig, WidthOptions
from hfl.registry import METHODS
from hfl.submodel.ladder import Level
from hfl.submodel.spec import SubmodelSpec, width_spec
from hfl.types import RoundContext


@dataclass(frozen=True)
class FedRolexConfig(HeteroFLConfig):
    name: str = "fedrolex"


@METHODS.register("fedrolex")
class FedRolex(HeteroFL):
    Config = FedRolexConfig

    def __init__(self, config: FedRolexConfig, resources: Resources) -> None:
        super().__init__(config, resources)
        self.ladder.place = self.rolled

    def rolled(self, level: Level, ctx: RoundContext) -> tuple[SubmodelSpec, WidthOptions]:
        """The level's window of every channel group, started at channel (round - 1) mod Q."""
        offsets = {g.name: (ctx.round - 1) % g.size for g in self.model.channel_groups()}
        return width_spec(self.model, self.model.width * level.options.rate, offsets), level.options
