"""DepthFL — Kim, Yu, Kim and Moon, "DepthFL: Depthwise Federated Learning for Heterogeneous
Clients", ICLR 2023. The global model carries a classifier after every stage (a bottleneck of
separable convs, then a linear layer); a client trains the prefix of the body up to one of these
classifiers, with cross-entropy at every classifier it holds plus mutual self-distillation among
them (each learns from the others' detached predictions, KL averaged over the others); the server
averages each tensor over the clients that hold it. The global model predicts with every exit, and
with their ensemble. With `tier_window` >= 0 a client instead trains a prefix drawn every round
from its tier's window (NeFL's dynamic environment, `hfl.methods.tiers`).

Deliberate deviations:
- The prefix a client trains is the deepest whose estimated training memory fits its budget, as
  the FeDepth paper reproduces DepthFL ("to conform to our predefined memory budgets, rather than
  the original fixed-depth allocation"); a client that fits no prefix sits the round out.
- Local training is plain SGD: the paper's default adds FedDyn's dynamic regularisation, which is
  the variant its tables call "DepthFL (FedAvg)" without it.
- The average is weighted by sample counts (FedAvg) where the authors' code counts clients; the two
  agree for equal-sized (IID) partitions.
- The bottleneck is the model's (`ScalableModel.add_exits`): one separable conv per later stage,
  without the authors' attention modules; `exits=blocks` adds finer prefixes than the paper's.
- The authors' code ramps the distillation weight up over 300 rounds (exp(-5 (1 - t/300)^2));
  the paper's loss has no such weight, so the ramp is off unless `distill_rampup_rounds` is set.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from hfl.accounting.accountant import Accountant
from hfl.accounting.budgets import ClientBudget
from hfl.config import check, check_choice
from hfl.errors import ConfigError
from hfl.methods.base import Method, MethodConfig, MethodState
from hfl.methods.tiers import DynamicTiers
from hfl.models.base import EXIT_KINDS, ScalableModel
from hfl.registry import METHODS
from hfl.submodel.spec import SubmodelSpec, full_spec, truncate
from hfl.types import ClientTask, ClientUpdate, RoundContext, StateDict

if TYPE_CHECKING:
    from hfl.client import ClientModule

log = logging.getLogger(__name__)

EXIT_PLACEMENTS = ("stages", "blocks")


@dataclass(frozen=True)
class DepthFLConfig(MethodConfig):
    name: str = "depthfl"
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
    tier_window: int = -1
    """-1: off (each client trains the largest level fitting its budget, as before). k >= 0: NeFL's
    dynamic tiers (appendix B.7, `hfl.methods.tiers`): each round a client trains a level drawn
    uniformly within k levels of its tier (the paper's setting is 2 with five levels)."""

    def __post_init__(self) -> None:
        check_choice("exits", self.exits, EXIT_PLACEMENTS)
        check_choice("exit_kind", self.exit_kind, EXIT_KINDS)
        check(self.temperature > 0, "temperature", self.temperature, "a positive number")
        check(self.distill_rampup_rounds >= 0, "distill_rampup_rounds", self.distill_rampup_rounds, "a round count >= 0")
        window = self.tier_window
        check(isinstance(window, int) and not isinstance(window, bool) and window >= -1, "tier_window", window, "an integer >= -1")


def exit_positions(model: ScalableModel, placement: str) -> tuple[int, ...]:
    """Body blocks an early exit follows: the last block of every stage but the last (where the
    next block's output channel group differs), or every block but the last."""
    blocks = model.blocks()
    if placement == "blocks":
        return tuple(b.index for b in blocks[:-1])
    return tuple(b.index for b, after in pairwise(blocks) if after.out_group != b.out_group)


def mutual_distillation(logits: list[Tensor], temperature: float = 1.0) -> Tensor:
    """DepthFL's self-distillation: sum over classifiers i of (1/(n-1)) sum_{j != i} KL(p_j || p_i),
    p = softmax(logits / T), teachers p_j detached, each KL a batch mean, scaled by T^2."""
    n = len(logits)
    if n < 2:
        raise ValueError("mutual distillation needs at least two classifiers")
    log_probs = [F.log_softmax(z / temperature, dim=1) for z in logits]
    total = logits[0].new_zeros(())
    for i, student in enumerate(log_probs):
        for j, teacher in enumerate(log_probs):
            if i != j:
                total = total + F.kl_div(student, teacher.detach(), reduction="batchmean", log_target=True)
    return total * temperature**2 / (n - 1)


@METHODS.register("depthfl")
class DepthFL(Method):
    Config = DepthFLConfig
    paper = "Kim, Yu, Kim and Moon, ICLR 2023 (openreview.net/forum?id=pf8RIZTMU58)"
    preferred_norm = "bn"

    def __init__(self, config: DepthFLConfig, model: ScalableModel, accountant: Accountant | None = None) -> None:
        super().__init__(config, model, accountant)
        count = len(model.blocks())
        if not all(1 <= b < count for b in config.exit_blocks) or list(config.exit_blocks) != sorted(set(config.exit_blocks)):
            raise ConfigError("method.exit_blocks", list(config.exit_blocks), f"ascending distinct blocks in 1..{count - 1} ({type(model).__name__} has {count})")
        self.exit_after = tuple(b - 1 for b in config.exit_blocks) or exit_positions(model, config.exits)
        """Blocks followed by an early exit in every model this method builds."""
        self.depths = (*(b + 1 for b in self.exit_after), len(model.blocks()))
        """Body blocks of each prefix a client may train, shallowest first; the last is the whole model."""
        window = config.tier_window
        self.tiers = DynamicTiers.for_window(len(self.depths), window)
        """NeFL's dynamic tiers over the prefixes; None: each client trains its deepest fitting prefix."""

    def use_budgets(self, budgets: Sequence[ClientBudget | None], batch_size: int) -> None:
        super().use_budgets(budgets, batch_size)
        if self.tiers is not None:  # clients without a budget split into tiers by their share of the run
            self.tiers.use_budgets(budgets)

    def adapt_model(self, model: ScalableModel) -> ScalableModel:
        model.add_exits(self.exit_after, self.config.exit_kind)
        return model

    def spec_for(self, depth: int) -> SubmodelSpec:
        """The prefix of `depth` body blocks with the classifiers inside it (the head only when whole)."""
        return full_spec() if depth == self.depths[-1] else truncate(full_spec(), self.model, depth)

    def depth_fits(self, depth: int, ctx: RoundContext) -> bool:
        """Whether training the `depth`-block prefix fits the client's memory budget (always, without a budget or an accountant)."""
        budget = ctx.budget.memory_bytes if ctx.budget else None
        if budget is None or self.accountant is None:
            return True
        batch = min(ctx.train.batch_size, ctx.num_samples)
        return self.accountant.cost(self.model.width, batch, self.spec_for(depth)).peak_bytes <= budget

    def depth_for(self, ctx: RoundContext) -> int | None:
        """The deepest prefix whose estimated training memory fits the client's budget; None if none does."""
        depth = next((d for d in reversed(self.depths) if self.depth_fits(d, ctx)), None)
        if depth is None:
            log.info("client %d: even the %d-block prefix exceeds its budget of %d bytes",
                     ctx.client_id, self.depths[0], ctx.budget.memory_bytes)
        return depth

    def distill_weight(self, round_: int) -> float:
        """The distillation weight in round `round_` (the authors' ramp, or 1)."""
        ramp = self.config.distill_rampup_rounds
        if ramp == 0:
            return 1.0
        progress = min(max(round_ - 1, 0), ramp) / ramp
        return math.exp(-5.0 * (1.0 - progress) ** 2)

    def plan(self, ctx: RoundContext, state: MethodState) -> ClientTask | None:
        if self.tiers is None:
            depth = self.depth_for(ctx)
        else:
            level = self.tiers.draw(ctx, lambda k: self.depth_fits(self.depths[k], ctx))
            depth = None if level is None else self.depths[level]
        if depth is None:
            return None
        return ClientTask(ctx, self.spec_for(depth), {"depth": depth, "distill_weight": self.distill_weight(ctx.round)})

    def objective(self, client: ClientModule, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        outputs = client.model.forward_exits(x)
        ce = torch.stack([F.cross_entropy(logits, y) for logits in outputs]).sum()
        if not self.config.distillation or len(outputs) < 2:
            return {"loss": ce, "ce": ce.detach()}
        distill = mutual_distillation(outputs, self.config.temperature)
        loss = ce + client.task.options.get("distill_weight", 1.0) * distill
        return {"loss": loss, "ce": ce.detach(), "distillation": distill.detach()}

    def init_state(self) -> MethodState:
        return {"trained_depth": 0}

    def aggregate(
        self, global_state: StateDict, updates: list[ClientUpdate], state: MethodState
    ) -> tuple[StateDict, MethodState]:
        new, state = super().aggregate(global_state, updates, state)
        deepest = max((u.spec.depth or self.depths[-1] for u in updates), default=0)
        return new, {**state, "trained_depth": max(state.get("trained_depth", 0), deepest)}

    def trained_depths(self, state: MethodState) -> tuple[int, ...]:
        """The prefixes whose deepest classifier some client has trained (all, before round 1)."""
        trained = state.get("trained_depth", 0)
        return tuple(d for d in self.depths if d <= trained) or self.depths

    def global_model_spec(self, state: MethodState) -> SubmodelSpec:
        """The deepest trained prefix: where budgets never admit the whole model (its classifiers
        cost more memory than the plain model a top-tier budget is written as), the head stays at
        its initial weights and would score chance; its exits' ensemble is `ensemble_accuracy`."""
        return self.spec_for(self.trained_depths(state)[-1])

    def submodels(self, state: MethodState) -> dict[str, SubmodelSpec]:
        """Every trained prefix, scored at its deepest classifier."""
        return {f"depth{depth}": self.spec_for(depth) for depth in self.trained_depths(state)}
