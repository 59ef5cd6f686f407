"""ScaleFL — Ilhan, Su and Liu, "ScaleFL: Resource-Adaptive Federated Learning with Heterogeneous
Clients", CVPR 2023. The global model is scaled down in width and depth at once into one sub-model
per complexity level; early exits sit where the shallower levels are cut; clients train their
level's model with self-distillation from its deepest exit; the server divides each entry by the
number of clients that trained it (Algorithm 3).

Levels: target cost ratios r_l (`ratios`, the paper's 12.5/25/50/100 % of the parameters) or the
centres of a 1-D k-means over the clients' memory budgets (`levels_from=budgets`). For each level
the grid search picks the most uniform (s_w, s_d), min |s_w - s_d| subject to
|cost(split(M; s_w, s_d)) / (r_l cost(M)) - 1| <= epsilon, over s_w in `width_step` steps and
s_d in {d/N}. split(M) keeps the first floor(s_d N) body blocks at width s_w (the upper-left slice
of every tensor) with an exit classifier at the cut, plus the exits of the levels solved before it
(levels are solved in ascending order and never get shallower, so the level-j model holds exits
1..j as in the paper's Figure 6). FLOPs are torch's count, 2 per multiply-add: twice Table 1's.
A client trains the highest level whose training memory fits its budget; with no budgets the
clients are split into equal shares, one per level (the slides: "uniform (25% each level)"; the
authors' code splits a random permutation into quarters, hfl the client ids, which carry no data
order, as the other methods' tiers do, so that a comparison puts the same clients at each level).

Deliberate deviations and choices:
- cost(M) is the plain global model (no exits), so level L = (1, 1) reports r_L slightly above 1.
- `levels_from=budgets` costs splits by estimated training memory (the accountant's, at the
  experiment's batch size) against the absolute budget centre, and accepts only splits within
  [1 - epsilon, 1] of it, so that a client at the centre can train its level.
- The loss is the authors' code's (`loss=authors`, `train.py` and `KDLoss` in git-disl/scale-fl):
  sum_i i (CE(y_i, y) + alpha KL_tau(y_i, y_j)) / (j(j+1)/2), the weighted mean over the exits with the
  full cross-entropy at each, KL as `KLDivLoss`'s default mean over batch and classes
  (`kl_reduction=mean`), distillation switched on after `distill_after` (a quarter) of the rounds.
  Their ResNet-110 command leaves the distillation weight at 0 (0.05 is their BERT command's), so
  `alpha` defaults to 0. `loss=slides` is the paper slides' form, 1/(j(j+1)) sum_i i (alpha KL +
  (1 - alpha) CE): half the weighted mean, so at one learning rate it trains at about half the rate.
- The teacher (deepest exit) is not detached, as in the authors' code (`detach_teacher` to change).
- Static batch norm and HeteroFL's scaler while training, as in the authors' code; the exits are
  the authors' (`exit_kind=convs`: three conv3x3-norm-ReLU layers, pooling and a linear layer).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from torch import Tensor, nn

from hfl.accounting.analytic import AnalyticCosts
from hfl.errors import ConfigError, check, check_choice
from hfl.losses import SCALEFL_LOSSES, self_distillation_loss
from hfl.methods.base import Client, Method, MethodConfig, Resources
from hfl.methods.heterofl import scaling
from hfl.methods.vectorisable import vectorisable
from hfl.models.base import ScalableModel, scaled_channels
from hfl.models.exits import EXIT_KINDS, add_exits
from hfl.registry import METHODS
from hfl.submodel.ladder import Level, budget_centres
from hfl.submodel.scaling import Split, solve_splits
from hfl.submodel.spec import SubmodelSpec, truncate, width_spec
from hfl.types import RoundContext

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScaleFLConfig(MethodConfig):
    name: str = "scalefl"
    weighting: str = "clients"
    """Algorithm 3 divides every entry by the number of clients that trained it."""
    levels_from: str = "ratios"
    """Where the complexity levels come from: 'ratios' (the configured `ratios` of `cost`) or
    'budgets' (k-means over the clients' memory budgets; the grid search then costs training memory)."""
    ratios: tuple[float, ...] = (0.125, 0.25, 0.5, 1.0)
    """Target cost reduction ratio r_l of each level, ascending (the paper's 12.5, 25, 50, 100 %)."""
    cost: str = "params"
    """What `ratios` measure: 'params' (the paper's Table 1) or 'flops' (forward FLOPs per sample)."""
    num_levels: int = 4
    """Clusters of client budgets with `levels_from=budgets` (fewer when fewer budgets differ)."""
    epsilon: float = 0.05
    """Tolerance of the achieved cost ratio around each target (the paper's epsilon_l)."""
    width_step: float = 0.01
    """Resolution of the s_w grid; s_d runs over d/N for the N body blocks."""
    loss: str = "authors"
    """'authors': sum_i i (CE + alpha KL) / (j(j+1)/2), as the authors' code; 'slides':
    sum_i i ((1 - alpha) CE + alpha KL) / (j(j+1)), as the paper's slides write it."""
    alpha: float = 0.0
    """Weight of the distillation term (the authors' ResNet-110 command: 0; their BERT command: 0.05)."""
    kl_reduction: str = "mean"
    """'mean': KL averaged over batch and classes (`nn.KLDivLoss()`'s default, the authors'); 'batchmean':
    the KL divergence per sample, averaged over the batch."""
    distill_after: float = 0.25
    """Share of the rounds after which distillation switches on (the authors': round > rounds / 4)."""
    temperature: float = 3.0
    """Softmax temperature tau of the distillation (the authors' code uses 3); KL is scaled by tau^2."""
    detach_teacher: bool = False
    """Stop gradients through the deepest exit's soft labels (the authors' code lets them flow)."""
    scaler: bool = True
    """Divide conv outputs by s_w while training (HeteroFL's scaler, used by the authors' code)."""
    exit_kind: str = "convs"
    """Early-exit classifier: 'convs' (the authors': three conv3x3-norm-ReLU, pooling, linear), 'linear'
    (pooling and a linear layer) or 'bottleneck'."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("loss", self.loss, SCALEFL_LOSSES)
        check_choice("kl_reduction", self.kl_reduction, ("mean", "batchmean"))
        check(0 <= self.distill_after <= 1, "distill_after", self.distill_after, "a share of the rounds in [0, 1]")
        check_choice("levels_from", self.levels_from, ("ratios", "budgets"))
        ascending = all(a < b for a, b in zip(self.ratios, self.ratios[1:]))
        check(bool(self.ratios) and ascending and all(0 < r <= 1 for r in self.ratios), "ratios", list(self.ratios),
              "ascending ratios in (0, 1]")
        check_choice("cost", self.cost, ("params", "flops"))
        check(self.num_levels >= 1, "num_levels", self.num_levels, "an integer >= 1")
        check(0 < self.epsilon < 1, "epsilon", self.epsilon, "a number in (0, 1)")
        check(0 < self.width_step <= 0.5, "width_step", self.width_step, "a number in (0, 0.5]")
        check(0 <= self.alpha <= 1, "alpha", self.alpha, "a number in [0, 1]")
        check(self.temperature > 0, "temperature", self.temperature, "a positive number")
        check_choice("exit_kind", self.exit_kind, EXIT_KINDS)


@dataclass(frozen=True)
class ScaleFLOptions:
    level: int
    """The level's number, from 1."""
    rate: float
    """Its width ratio s_w (the scaler divides conv outputs by it)."""


def held_exits(exit_blocks: Sequence[int], depth: int, blocks: int) -> frozenset[int]:
    """Exits a model cut after `depth` blocks holds: the given ones before the cut, and one at it."""
    cut = {depth - 1} if depth < blocks else set()
    return frozenset(e for e in exit_blocks if e < depth - 1) | cut


@METHODS.register("scalefl")
class ScaleFL(Method):
    Config = ScaleFLConfig
    preferred_norm = "static_bn"

    def __init__(self, config: ScaleFLConfig, resources: Resources) -> None:
        super().__init__(config, resources)
        self.blocks = len(self.model.blocks())
        step = config.width_step
        self.widths = [round(k * step, 6) for k in range(1, int(1 / step + 1e-6) + 1)]
        self.costs = AnalyticCosts(self.model, config.exit_kind, resources.accountant.input_shape, resources.accountant.input_dtype)
        self._bases = sorted({(group.base, group.unit) for group in self.model.channel_groups()})
        search = partial(solve_splits, widths=self.widths, blocks=self.blocks, epsilon=config.epsilon)
        if config.levels_from == "ratios":
            self.splits = search(list(config.ratios), self._analytic_ratio)
        else:  # k-means over the clients' memory budgets, relative to the plain global model's training memory
            if not any(b is not None and b.memory_bytes is not None for b in resources.budgets):
                raise ConfigError("method.levels_from", "budgets", "ratios, unless clients have memory budgets (budgets.scenario)")
            full = self._plain_memory()
            targets = sorted({min(1.0, centre / full) for centre in budget_centres(resources.budgets, config.num_levels)})
            self.splits = search(targets, self._memory_ratio, one_sided=True)
        self.exit_blocks = tuple(sorted({sp.depth - 1 for sp in self.splits if sp.depth < self.blocks}))
        """Blocks followed by an early exit: the cut of every level shallower than the whole body."""
        self.model = self.adapt_model(self.model)
        levels = [Level(f"level{n}", self.spec_for(sp), ScaleFLOptions(n, sp.width)) for n, sp in enumerate(self.splits, start=1)]
        # Without budgets each level gets an equal share of the clients, as in the paper. The global
        # model is the highest trained level: level L is the whole model when its clients can train
        # it; where exits push the whole model past the top budget (its level is then a slightly
        # smaller split) or no client fits level L, the whole model's head is never trained. Each
        # trained level's model is scored at its deepest exit (the paper's "local" accuracy).
        self.ladder = self.make_ladder(levels, unbudgeted="shares", evaluated="trained", global_model="largest_trained",
                                       table=self.level_table, title="ScaleFL's Table 1; r_l: the achieved cost ratio beside its target")

    # -- costs of candidate splits ------------------------------------------------------------
    def _analytic_ratio(self, width: float, depth: int, cuts: Sequence[int]) -> float:
        measure = self.costs.params if self.config.cost == "params" else self.costs.flops
        full = measure(self.model.width, self.blocks, frozenset())
        return measure(self.model.width * width, depth, held_exits(cuts, depth, self.blocks)) / full

    def _plain_memory(self) -> int:
        return self.resources.accountant.plain_cost(self.model.width, self.resources.batch_size).peak_bytes

    def _split_memory(self, width: float, depth: int, exits: frozenset[int]) -> int:
        """Estimated training memory of a split, as the accountant estimates a client's; widths with
        the same channel counts share one measurement."""
        absolute = self.model.width * width
        channels = tuple(scaled_channels(base, absolute, unit) for base, unit in self._bases)

        def build() -> nn.Module:
            model = self.resources.build(absolute)
            add_exits(model, sorted(exits), self.config.exit_kind)
            if depth < self.blocks:
                model.truncate(depth)
            return model

        return self.resources.accountant.cost(("split", channels, depth, exits), build, self.resources.batch_size, count_flops=False).peak_bytes

    def _memory_ratio(self, width: float, depth: int, cuts: Sequence[int]) -> float:
        return self._split_memory(width, depth, held_exits(cuts, depth, self.blocks)) / self._plain_memory()

    def adapt_model(self, model: ScalableModel) -> ScalableModel:
        add_exits(model, self.exit_blocks, self.config.exit_kind)
        return model

    def spec_for(self, split: Split) -> SubmodelSpec:
        spec = width_spec(self.model, self.model.width * split.width)
        return spec if split.depth == self.blocks else truncate(spec, self.model, split.depth)

    # -- the client loss and the table --------------------------------------------------------
    @vectorisable
    def objective(self, client: Client, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        with scaling(client.model, self.config.scaler, client.task.options.rate):
            outputs = client.model.forward_exits(x)
        c = self.config
        distilling = client.task.ctx.round > c.distill_after * self.resources.rounds
        return self_distillation_loss(outputs, y, c.alpha if distilling else 0.0, c.temperature, c.detach_teacher,
                                      c.loss, c.kl_reduction)

    def level_table(self, ctx: RoundContext) -> list[dict[str, Any]]:
        """ScaleFL's Table 1: per level s_d, s_w, parameters, forward FLOPs per sample, and the
        achieved cost ratio r_l (in the cost the levels were searched in) beside its target."""
        rows = []
        plain = frozenset()
        full_params = self.costs.params(self.model.width, self.blocks, plain)
        full_flops = self.costs.flops(self.model.width, self.blocks, plain)
        for n, split in enumerate(self.splits, start=1):
            width, exits = self.model.width * split.width, held_exits(self.exit_blocks, split.depth, self.blocks)
            params, flops = self.costs.params(width, split.depth, exits), self.costs.flops(width, split.depth, exits)
            if self.config.levels_from == "budgets":
                achieved = self._split_memory(split.width, split.depth, exits) / self._plain_memory()
            else:
                achieved = params / full_params if self.config.cost == "params" else flops / full_flops
            rows.append({"level": n, "name": f"level{n}", "s_d": split.depth / self.blocks, "s_w": split.width,
                         "depth": split.depth, "params": params, "flops": flops, "r_l": achieved, "target": split.target,
                         "cost": "memory" if self.config.levels_from == "budgets" else self.config.cost})
        return rows
