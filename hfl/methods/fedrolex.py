"""FedRolex — Alam et al., "FedRolex: Model-Heterogeneous Federated Learning with Rolling Sub-Model
Extraction", NeurIPS 2022. HeteroFL with a window of channels that rolls by one every round, so
every channel is trained over time even when no client fits the full model.

The index rule is the CAFF paper's appendix B, Eq. 8-9: in round r a width-s client holds a window
of consecutive channels of a Q-channel layer, wrapping around, starting at r' = r mod Q (hfl's
rounds count from 1, so round 1 starts at channel 0). The window keeps ceil(s Q) channels, as the
authors' code and every width method here (the appendix writes floor(s Q)). The paper's window moves
forward; the authors' code rolls the channel order the other way (`torch.roll(arange(Q), r)[:k]`,
a window starting at -r mod Q): `roll` picks either."""

from __future__ import annotations

from dataclasses import dataclass

from hfl.errors import check_choice
from hfl.methods.base import Resources
from hfl.methods.heterofl import HeteroFL, HeteroFLConfig, WidthOptions
from hfl.registry import METHODS
from hfl.submodel.ladder import Level
from hfl.submodel.spec import SubmodelSpec, width_spec
from hfl.types import RoundContext

ROLLS = ("forward", "backward")


@dataclass(frozen=True)
class FedRolexConfig(HeteroFLConfig):
    name: str = "fedrolex"
    roll: str = "forward"
    """Which way the window moves each round: 'forward' (the paper, channel r mod Q first) or
    'backward' (the authors' code, channel -r mod Q first)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("roll", self.roll, ROLLS)


@METHODS.register("fedrolex")
class FedRolex(HeteroFL):
    Config = FedRolexConfig

    def __init__(self, config: FedRolexConfig, resources: Resources) -> None:
        super().__init__(config, resources, place=self.rolled)

    def rolled(self, level: Level, ctx: RoundContext) -> tuple[SubmodelSpec, WidthOptions]:
        """The level's window of every channel group, started at channel (round - 1) mod Q, or
        -(round - 1) mod Q rolling backward."""
        shift = ctx.round - 1 if self.config.roll == "forward" else 1 - ctx.round
        offsets = {g.name: shift % g.size for g in self.model.channel_groups()}
        return width_spec(self.model, self.model.width * level.options.rate, offsets), level.options
