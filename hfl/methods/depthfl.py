"""DepthFL — Kim, Yu, Kim and Moon, "DepthFL: Depthwise Federated Learning for Heterogeneous
Clients", ICLR 2023. The global model carries a classifier after every stage (a bottleneck of
separable convs, then a linear layer); a client trains the prefix of the body up to one of these
classifiers, with cross-entropy at every classifier it holds plus mutual self-distillation among
them (each learns from the others' detached predictions, KL averaged over the others); the server
averages each tensor over the clients that hold it, each client counted once as the authors' code
does (`weighting=samples` weights by sample counts instead). The global model predicts with every exit, and
with their ensemble. With `tier_window` >= 0 a client instead trains a prefix drawn every round
from its tier's window (NeFL's dynamic environment, `hfl.submodel.ladder`).

Deliberate deviations:
- The prefix a client trains is the deepest whose estimated training memory fits its budget, as
  the FeDepth paper reproduces DepthFL ("to conform to our predefined memory budgets, rather than
  the original fixed-depth allocation"); a client that fits no prefix sits the round out.
- Local training is plain SGD: the paper's default adds FedDyn's dynamic regularisation, which is
  the variant its tables call "DepthFL (FedAvg)" without it.
- The bottleneck is the platform's (`hfl.models.exits`): one separable conv per later stage,
  without the authors' attention modules; `exits=blocks` adds finer prefixes than the paper's.
- The authors' code ramps the distillation weight up over 300 rounds (exp(-5 (1 - t/300)^2));
  the paper's loss has no such weight, so the ramp is off unless `distill_rampup_rounds` is set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import Tensor

from hfl.errors import ConfigError, check, check_choice
from hfl.losses import mutual_distillation
from hfl.methods.base import Client, LadderConfig, Method, Resources
from hfl.methods.vectorisable import vectorisable
from hfl.models.base import ScalableModel
from hfl.models.exits import EXIT_KINDS, add_exits
from hfl.registry import METHODS
from hfl.submodel.ladder import Level
from hfl.submodel.spec import SubmodelSpec, full_spec, truncate

EXIT_PLACEMENTS = ("stages", "blocks")


@dataclass(frozen=True)
class DepthFLConfig(LadderConfig):
    name: str = "depthfl"
    weighting: str = "clients"
    """The authors' code divides every layer by the number of clients that trained it."""
    exits: str = "stages"
    """Where classifiers attach: 'stages' after the last block of every stage (the paper's ResNet
    with one classifier per stage), 'blocks' after every block (finer prefixes for tight budgets)."""
    exit_blocks: tuple[int, ...] = ()
    """Explicit exit positions, overriding `exits`: the 1-based body blocks a classifier follows
    (e.g. prefixes matched to other methods' sub-model sizes, as NeFL's comparison does)."""
    exit_kind: str = "bottleneck"
    """Early-exit classifier: 'bottleneck' (separable convs down to the last stage's shape, as in
    the paper) or 'linear' (pooling and a linear layer)."""
    distillation: bool = True
    """Mutual self-distillation among a client's classifiers (False: cross-entropy only)."""
    temperature: float = 1.0
    """Softmax temperature of the distillation (the authors' code uses 1); the KL is scaled by T^2."""
    distill_rampup_rounds: int = 0
    """Rounds over which the distillation weight ramps up as exp(-5 (1 - t/R)^2), as the authors'
    code does with R = 300; 0: full weight from the first round, as the paper's loss."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("exits", self.exits, EXIT_PLACEMENTS)
        check_choice("exit_kind", self.exit_kind, EXIT_KINDS)
        check(self.temperature > 0, "temperature", self.temperature, "a positive number")
        check(self.distill_rampup_rounds >= 0, "distill_rampup_rounds", self.distill_rampup_rounds, "a round count >= 0")


@dataclass(frozen=True)
class DepthOptions:
    depth: int
    """Body blocks of the prefix the client trains."""


def exit_positions(model: ScalableModel, placement: str) -> tuple[int, ...]:
    """Body blocks an early exit follows: the last block of every stage but the last (where the
    next block's output channel group differs), or every block but the last."""
    blocks = model.blocks()
    if placement == "blocks":
        return tuple(b.index for b in blocks[:-1])
    return tuple(b.index for b, after in pairwise(blocks) if after.out_group != b.out_group)


@METHODS.register("depthfl")
class DepthFL(Method):
    Config = DepthFLConfig
    preferred_norm = "bn"

    def __init__(self, config: DepthFLConfig, resources: Resources) -> None:
        super().__init__(config, resources)
        count = len(self.model.blocks())
        if not all(1 <= b < count for b in config.exit_blocks) or list(config.exit_blocks) != sorted(set(config.exit_blocks)):
            raise ConfigError("method.exit_blocks", list(config.exit_blocks), f"ascending distinct blocks in 1..{count - 1} ({type(self.model).__name__} has {count})")
        self.exit_after = tuple(b - 1 for b in config.exit_blocks) or exit_positions(self.model, config.exits)
        """Blocks followed by an early exit in every model this method builds."""
        self.model = self.adapt_model(self.model)
        depths = (*(b + 1 for b in self.exit_after), count)
        """Body blocks of each prefix a client may train, shallowest first; the last is the whole model."""
        levels = [Level(f"depth{d}", self.spec_for(d), DepthOptions(d)) for d in depths]
        # The global model is the deepest trained prefix: where budgets never admit the whole model
        # (its classifiers cost more memory than the plain model a top-tier budget is written as),
        # the head stays at its initial weights and would score chance; the exits' ensemble is
        # `ensemble_accuracy`. Every prefix up to the deepest trained one is scored at its deepest classifier.
        self.ladder = self.make_ladder(levels, tier_window=config.tier_window, evaluated="nested", global_model="largest_trained")

    def adapt_model(self, model: ScalableModel) -> ScalableModel:
        add_exits(model, self.exit_after, self.config.exit_kind)
        return model

    def spec_for(self, depth: int) -> SubmodelSpec:
        """The prefix of `depth` body blocks with the classifiers inside it (the head only when whole)."""
        return full_spec() if depth == len(self.model.blocks()) else truncate(full_spec(), self.model, depth)

    def distill_weight(self, round_: int) -> float:
        """The distillation weight in round `round_` (the authors' ramp, or 1)."""
        ramp = self.config.distill_rampup_rounds
        if ramp == 0:
            return 1.0
        progress = min(max(round_ - 1, 0), ramp) / ramp
        return math.exp(-5.0 * (1.0 - progress) ** 2)

    @vectorisable
    def objective(self, client: Client, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        outputs = client.model.forward_exits(x)
        ce = torch.stack([F.cross_entropy(logits, y) for logits in outputs]).sum()
        if not self.config.distillation or len(outputs) < 2:
            return {"loss": ce, "ce": ce.detach()}
        distill = mutual_distillation(outputs, self.config.temperature)
        loss = ce + self.distill_weight(client.task.ctx.round) * distill
        return {"loss": loss, "ce": ce.detach(), "distillation": distill.detach()}
