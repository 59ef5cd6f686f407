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
levels are drawn uniformly, once per client, as in the paper's experiments.

Deliberate deviations and choices:
- cost(M) is the plain global model (no exits), so level L = (1, 1) reports r_L slightly above 1.
- `levels_from=budgets` costs splits by estimated training memory (the accountant's, at the
  experiment's batch size) against the absolute budget centre, and accepts only splits within
  [1 - epsilon, 1] of it, so that a client at the centre can train its level.
- The loss is the slide's: 1/(j(j+1)) sum_i i (alpha KL_tau(y_i, y_j) + (1 - alpha) CE(y_i, y)). The
  authors' code divides by j(j+1)/2, keeps full CE weight at every exit, takes KLDivLoss's mean over
  classes and batch, and switches distillation on after a quarter of the rounds; none of that here.
- The teacher (deepest exit) is not detached, as in the authors' code (`detach_teacher` to change).
- Static batch norm and HeteroFL's scaler while training, as in the authors' code; exits are the
  platform's (`exit_kind`), not the authors' three-conv classifiers.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hfl.accounting.accountant import Accountant
from hfl.accounting.budgets import ClientBudget
from hfl.config import check, check_choice
from hfl.errors import ConfigError
from hfl.methods.base import Method, MethodConfig, MethodState
from hfl.methods.heterofl import scaled_conv_outputs
from hfl.models.base import EXIT_KINDS, ScalableModel, scaled_channels
from hfl.registry import METHODS
from hfl.seeding import LEVEL_STREAM, derive_seed
from hfl.submodel.aggregate import masked_weighted_mean
from hfl.submodel.spec import SubmodelSpec, truncate, width_spec
from hfl.types import ClientTask, ClientUpdate, RoundContext, StateDict

if TYPE_CHECKING:
    from hfl.client import ClientModule

log = logging.getLogger(__name__)


CostRatio = Callable[[float, int, Sequence[int]], float]
"""(s_w, blocks kept, cuts of the exits before) -> cost of that split relative to the global model."""


@dataclass(frozen=True)
class ScaleFLConfig(MethodConfig):
    name: str = "scalefl"
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
    alpha: float = 0.05
    """Weight of the distillation term against cross-entropy (the authors' README passes 0.05)."""
    temperature: float = 3.0
    """Softmax temperature tau of the distillation (the authors' code uses 3); KL is scaled by tau^2."""
    detach_teacher: bool = False
    """Stop gradients through the deepest exit's soft labels (the authors' code lets them flow)."""
    scaler: bool = True
    """Divide conv outputs by s_w while training (HeteroFL's scaler, used by the authors' code)."""
    exit_kind: str = "linear"
    """Early-exit classifier: 'linear' (pooling and a linear layer) or 'bottleneck'."""

    def __post_init__(self) -> None:
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
class Level:
    """One complexity level: width ratio s_w of the global model and the body blocks it keeps."""

    width: float
    depth: int
    target: float
    """The target cost ratio r_l it was searched for."""


def held_exits(exit_blocks: Sequence[int], depth: int, blocks: int) -> frozenset[int]:
    """Exits a model cut after `depth` blocks holds: the given ones before the cut, and one at it."""
    cut = {depth - 1} if depth < blocks else set()
    return frozenset(e for e in exit_blocks if e < depth - 1) | cut


class AnalyticCosts:
    """Parameters and forward FLOPs per sample of any split, without building it: a tensor of the
    split has every coupled dimension at ceil(width * base) channels; a conv or linear layer costs
    2 * weight entries * output positions FLOPs (what torch's FLOP counter counts), output positions
    from one forward of the global model with an exit after every block."""

    def __init__(self, model: ScalableModel, exit_kind: str, input_shape: tuple[int, ...] | None) -> None:
        probe = copy.deepcopy(model)  # exits are added to the copy only
        self.blocks = len(probe.blocks())
        missing = [b for b in range(self.blocks - 1) if str(b) not in probe.exits]
        probe.add_exits(missing, exit_kind)
        coupled: dict[str, dict[int, int]] = {}
        for group in probe.channel_groups():
            for key, dim in group.members:
                coupled.setdefault(key, {})[dim] = group.base
        positions = _output_positions(probe, input_shape) if input_shape else None
        parts = {"stem": probe.stem, "head": probe.head}
        parts.update({f"body.{i}": probe.body[i] for i in range(self.blocks)})
        parts.update({f"exits.{b}": module for b, module in probe.exits.items()})
        # Per part: (shape, coupled dims) of each parameter, and (weight shape, coupled dims, positions) of each layer.
        self._params = {
            name: [(tuple(p.shape), coupled.get(f"{name}.{k}", {})) for k, p in part.named_parameters()]
            for name, part in parts.items()
        }
        self._layers = None if positions is None else {
            name: [(tuple(m.weight.shape), coupled.get(".".join(filter(None, (name, k, "weight"))), {}), positions[id(m)])
                   for k, m in part.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
            for name, part in parts.items()
        }
        self._cache: dict[tuple[str, float], tuple[int, int | None]] = {}

    @staticmethod
    def _entries(shape: tuple[int, ...], dims: dict[int, int], width: float) -> int:
        return int(np.prod([scaled_channels(dims[d], width) if d in dims else n for d, n in enumerate(shape)]))

    def _part(self, name: str, width: float) -> tuple[int, int | None]:
        if (name, width) not in self._cache:
            params = sum(self._entries(shape, dims, width) for shape, dims in self._params[name])
            flops = None if self._layers is None else sum(
                2 * self._entries(shape, dims, width) * n for shape, dims, n in self._layers[name])
            self._cache[name, width] = (params, flops)
        return self._cache[name, width]

    def _parts(self, depth: int, exits: frozenset[int]) -> list[str]:
        names = ["stem", *(f"body.{i}" for i in range(depth)), *(f"exits.{b}" for b in sorted(exits))]
        return names + (["head"] if depth == self.blocks else [])

    def params(self, width: float, depth: int, exits: frozenset[int]) -> int:
        return sum(self._part(name, width)[0] for name in self._parts(depth, exits))

    def flops(self, width: float, depth: int, exits: frozenset[int]) -> int | None:
        counts = [self._part(name, width)[1] for name in self._parts(depth, exits)]
        return None if None in counts else sum(counts)


@torch.no_grad()
def _output_positions(model: ScalableModel, input_shape: tuple[int, ...]) -> dict[int, int]:
    """Output positions (pixels; 1 for a linear layer) of every conv and linear layer, by module id."""
    positions: dict[int, int] = {}

    def record(module: nn.Module, _inputs: object, out: Tensor) -> None:
        channels = out.shape[1] if isinstance(module, nn.Conv2d) else out.shape[-1]
        positions[id(module)] = out[0].numel() // channels

    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    hooks = [m.register_forward_hook(record) for m in layers]
    try:
        model.train()  # batch statistics: static batch norm has no others
        model.forward_exits(torch.zeros(2, *input_shape))
    finally:
        for hook in hooks:
            hook.remove()
    return positions


def most_uniform_split(
    ratio: Callable[[int, int], float],
    widths: Sequence[float],
    blocks: int,
    window: tuple[float, float],
    min_depth: int = 1,
) -> tuple[int, int] | None:
    """(width index, depth) minimising |widths[i] - depth / blocks| over the grid points, depth at
    least `min_depth`, whose cost `ratio(i, depth)` lies in `window`; ties go to the ratio nearest 1.
    None when no point does.

    The cost grows with width and with depth, so the diagonal (each depth at its nearest width)
    crosses the window once: where it lies inside, those depths win; otherwise the best feasible
    point is at the first feasible depth below the crossing or above it, found by bisection."""
    lo, hi = window
    grid = np.asarray(widths)
    nearest = [0] + [int(np.argmin(np.abs(grid - d / blocks))) for d in range(1, blocks + 1)]

    def first(pred: Callable[[int], bool], start: int, stop: int) -> int:
        """Smallest k in [start, stop) with pred(k), pred monotone; stop if none."""
        while start < stop:
            mid = (start + stop) // 2
            start, stop = (start, mid) if pred(mid) else (mid + 1, stop)
        return start

    below = first(lambda d: ratio(nearest[d], d) >= lo, min_depth, blocks + 1)  # first depth not under the window
    above = first(lambda d: ratio(nearest[d], d) > hi, below, blocks + 1)  # first depth over it
    candidates = [(nearest[d], d) for d in range(below, above)]
    if not candidates:
        for d in range(below - 1, min_depth - 1, -1):  # too cheap on the diagonal: widen
            i = first(lambda k, d=d: ratio(k, d) >= lo, 0, len(grid))
            if i == len(grid):  # too cheap even at full width, and so is every shallower depth
                break
            if ratio(i, d) <= hi:
                candidates.append((i, d))
                break
        for d in range(above, blocks + 1):  # too costly on the diagonal: narrow
            i = first(lambda k, d=d: ratio(k, d) > hi, 0, len(grid)) - 1
            if i < 0:  # too costly even at the narrowest width, and so is every deeper depth
                break
            if ratio(i, d) >= lo:
                candidates.append((i, d))
                break
    if not candidates:
        return None
    return min(candidates, key=lambda c: (abs(grid[c[0]] - c[1] / blocks), abs(ratio(*c) - 1)))


def kmeans_1d(values: Sequence[float], k: int) -> list[float]:
    """Optimal k-means on a line, ascending: the k contiguous groups of the sorted values with the
    least squared error, by dynamic programming over the distinct values (no seed, no local optima);
    fewer centres when fewer values differ."""
    distinct, counts = np.unique(np.asarray(values, dtype=float), return_counts=True)
    m, k = len(distinct), min(k, len(distinct))
    n, s1, s2 = (np.concatenate([[0.0], np.cumsum(counts * distinct**p)]) for p in (0, 1, 2))

    def sse(i: np.ndarray, j: int) -> np.ndarray:  # squared error of the group of distinct values i..j-1
        return s2[j] - s2[i] - (s1[j] - s1[i]) ** 2 / (n[j] - n[i])

    best = np.full((k + 1, m + 1), np.inf)  # best[c, j]: the first j distinct values in c groups
    best[0, 0] = 0.0
    start = np.zeros((k + 1, m + 1), dtype=int)  # where the last of those c groups starts
    for c in range(1, k + 1):
        for j in range(c, m + 1):
            i = np.arange(c - 1, j)
            total = best[c - 1, i] + sse(i, j)
            start[c, j], best[c, j] = i[np.argmin(total)], total.min()
    centres, j = [], m
    for c in range(k, 0, -1):
        i = start[c, j]
        centres.append(float((s1[j] - s1[i]) / (n[j] - n[i])))
        j = i
    return sorted(centres)


def kl_divergence(student: Tensor, teacher: Tensor, temperature: float) -> Tensor:
    """sum(sigma(t/tau) log(sigma(t/tau) / sigma(s/tau))) tau^2, averaged over the batch."""
    log_s = F.log_softmax(student / temperature, dim=1)
    log_t = F.log_softmax(teacher / temperature, dim=1)
    return F.kl_div(log_s, log_t, reduction="batchmean", log_target=True) * temperature**2


def self_distillation_loss(
    outputs: Sequence[Tensor], y: Tensor, alpha: float, temperature: float, detach_teacher: bool = False
) -> dict[str, Tensor]:
    """ScaleFL's objective over the exits 1..j of a level-j model (shallowest first):
    L = 1/(j(j+1)) sum_i i (alpha KL_tau(y_i, y_j) + (1 - alpha) CE(y_i, y))."""
    j = len(outputs)
    teacher = outputs[-1].detach() if detach_teacher else outputs[-1]
    ce = torch.stack([F.cross_entropy(logits, y) for logits in outputs])
    # The deepest exit's KL with itself is 0; it is left out rather than computed.
    kl = torch.stack([kl_divergence(logits, teacher, temperature) for logits in outputs[:-1]] + [ce.new_zeros(())])
    weights = torch.arange(1, j + 1, dtype=ce.dtype, device=ce.device)
    loss = (weights * (alpha * kl + (1 - alpha) * ce)).sum() / (j * (j + 1))
    return {"loss": loss, "ce": ce.detach().mean(), "kl": kl[:-1].detach().mean() if j > 1 else kl[0].detach()}


@METHODS.register("scalefl")
class ScaleFL(Method):
    Config = ScaleFLConfig
    paper = "Ilhan, Su and Liu, CVPR 2023 (github.com/git-disl/scale-fl)"
    preferred_norm = "static_bn"
    level_table_title = "ScaleFL's Table 1; r_l: the achieved cost ratio beside its target"

    def __init__(self, config: ScaleFLConfig, model: ScalableModel, accountant: Accountant | None = None) -> None:
        super().__init__(config, model, accountant)
        self.blocks = len(model.blocks())
        step = config.width_step
        self.widths = [round(k * step, 6) for k in range(1, int(1 / step + 1e-6) + 1)]
        self.costs = AnalyticCosts(model, config.exit_kind, accountant.input_shape if accountant else None)
        self.batch_size: int | None = None
        """The batch size budgets were costed at (`levels_from=budgets`)."""
        self._memory: dict[tuple[tuple[int, ...], int, frozenset[int]], int] = {}
        self._bases = sorted({group.base for group in model.channel_groups()})
        self.levels: list[Level] = []
        if config.levels_from == "ratios":
            self.levels = self.levels_for_targets(list(config.ratios), self._analytic_ratio)

    # -- levels -----------------------------------------------------------------------------
    def use_budgets(self, budgets: Sequence[ClientBudget | None], batch_size: int) -> None:
        """With `levels_from=budgets`: the levels from k-means over the clients' memory budgets,
        relative to the plain global model's training memory at `batch_size`."""
        if self.config.levels_from != "budgets":
            return
        memory = [b.memory_bytes for b in budgets if b is not None and b.memory_bytes is not None]
        if not memory or self.accountant is None:
            raise ConfigError("method.levels_from", "budgets", "ratios, unless clients have memory budgets (budgets.scenario)")
        self.batch_size = batch_size
        full = self._plain_memory()
        targets = sorted({min(1.0, centre / full) for centre in kmeans_1d(memory, self.config.num_levels)})
        self.levels = self.levels_for_targets(targets, self._memory_ratio, one_sided=True)

    def levels_for_targets(self, targets: list[float], cost_ratio: CostRatio, one_sided: bool = False) -> list[Level]:
        """Solve the levels in ascending order. A level is at least as deep as the one before, so that
        the level-j model holds exits 1..j (the paper's Figure 6) and is costed with exactly those."""
        eps = self.config.epsilon
        window = (1 - eps, 1.0) if one_sided else (1 - eps, 1 + eps)
        levels: list[Level] = []
        for number, target in enumerate(targets, start=1):
            cuts = tuple(sorted({lv.depth - 1 for lv in levels if lv.depth < self.blocks}))
            # split(M; 1, 1) is M: the paper's last level, or any budget the whole model fits.
            whole = cost_ratio(1.0, self.blocks, cuts) <= target if one_sided else target == 1.0
            if whole:
                levels.append(Level(1.0, self.blocks, target))
                break
            min_depth = levels[-1].depth if levels else 1
            levels.append(self._search(number, target, cuts, cost_ratio, window, min_depth))
        log.info("scalefl levels (s_w, depth): %s", [(lv.width, lv.depth) for lv in levels])
        return levels

    def _search(self, number: int, target: float, cuts: tuple[int, ...], cost_ratio: CostRatio,
                window: tuple[float, float], min_depth: int) -> Level:
        values: dict[tuple[int, int], float] = {}

        def ratio(i: int, depth: int) -> float:
            if (i, depth) not in values:
                values[i, depth] = cost_ratio(self.widths[i], depth, cuts) / target
            return values[i, depth]

        found = most_uniform_split(ratio, self.widths, self.blocks, window, min_depth)
        if found is None:
            closest = min(values.values(), key=lambda r: abs(r - 1)) * target
            raise ConfigError("method.epsilon", self.config.epsilon, f"a tolerance level {number} can meet: its target "
                              f"cost ratio is {target:g}, the closest split found costs {closest:.4f} of the model")
        return Level(self.widths[found[0]], found[1], target)

    def _analytic_ratio(self, width: float, depth: int, cuts: Sequence[int]) -> float:
        measure = self.costs.params if self.config.cost == "params" else self.costs.flops
        full = measure(self.model.width, self.blocks, frozenset())
        if full is None:
            raise ConfigError("method.cost", "flops", "params, unless the method knows the input shape (an accountant)")
        return measure(self.model.width * width, depth, held_exits(cuts, depth, self.blocks)) / full

    def _plain_memory(self) -> int:
        return self.accountant.cost(self.model.width, self.batch_size, adapted=False).peak_bytes

    def _split_memory(self, width: float, depth: int, exits: frozenset[int]) -> int:
        """Estimated training memory of a split, as the accountant estimates a client's; widths with
        the same channel counts share one measurement."""
        absolute = self.model.width * width
        key = (tuple(scaled_channels(base, absolute) for base in self._bases), depth, exits)
        if key not in self._memory:
            acc = self.accountant
            model = acc.build(absolute)
            model.add_exits(sorted(exits), self.config.exit_kind)
            if depth < self.blocks:
                model.truncate(depth)
            self._memory[key] = acc.measure(model, self.batch_size, count_flops=False).peak_bytes
        return self._memory[key]

    def _memory_ratio(self, width: float, depth: int, cuts: Sequence[int]) -> float:
        return self._split_memory(width, depth, held_exits(cuts, depth, self.blocks)) / self._plain_memory()

    @property
    def exit_blocks(self) -> tuple[int, ...]:
        """Blocks followed by an early exit: the cut of every level shallower than the whole body."""
        if not self.levels:
            raise ConfigError("method.levels_from", "budgets", "ratios, unless the method is given the clients' budgets")
        return tuple(sorted({lv.depth - 1 for lv in self.levels if lv.depth < self.blocks}))

    def adapt_model(self, model: ScalableModel) -> ScalableModel:
        model.add_exits(self.exit_blocks, self.config.exit_kind)
        return model

    def spec_for(self, level: Level) -> SubmodelSpec:
        spec = width_spec(self.model, self.model.width * level.width)
        return spec if level.depth == self.blocks else truncate(spec, self.model, level.depth)

    # -- the three roles --------------------------------------------------------------------
    def level_for(self, ctx: RoundContext) -> int | None:
        """Index of the highest level whose training memory fits the client's budget (None: none
        fits); without a budget a uniform draw, fixed for the run."""
        budget = ctx.budget.memory_bytes if ctx.budget else None
        if budget is None or self.accountant is None:
            return int(np.random.default_rng(derive_seed(ctx.seed, LEVEL_STREAM, ctx.client_id)).integers(len(self.levels)))
        batch = min(ctx.train.batch_size, ctx.num_samples)
        for index in reversed(range(len(self.levels))):
            level = self.levels[index]
            if self.accountant.cost(self.model.width * level.width, batch, self.spec_for(level)).peak_bytes <= budget:
                return index
        log.info("client %d: even level 1 exceeds its budget of %d bytes", ctx.client_id, budget)
        return None

    def plan(self, ctx: RoundContext, state: MethodState) -> ClientTask | None:
        index = self.level_for(ctx)
        if index is None:
            return None
        level = self.levels[index]
        return ClientTask(ctx, self.spec_for(level), {"level": index + 1, "rate": level.width})

    def objective(self, client: ClientModule, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        rate = client.task.options["rate"]
        with scaled_conv_outputs(client.model, rate) if self.config.scaler and rate != 1.0 else nullcontext():
            outputs = client.model.forward_exits(x)
        c = self.config
        return self_distillation_loss(outputs, y, c.alpha, c.temperature, c.detach_teacher)

    def aggregate(
        self, global_state: StateDict, updates: list[ClientUpdate], state: MethodState
    ) -> tuple[StateDict, MethodState]:
        # Algorithm 3 divides every entry by the number of clients that trained it: unit weights.
        new = masked_weighted_mean(global_state, [replace(u, weight=1.0) for u in updates])
        trained = set(state.get("trained_levels", [])) | {self.level_of(u.spec) for u in updates}
        return new, {**state, "trained_levels": sorted(trained)}

    def init_state(self) -> MethodState:
        return {"trained_levels": []}

    def level_of(self, spec: SubmodelSpec) -> int:
        """The level number (from 1) whose spec `spec` is."""
        depth = self.blocks if spec.depth is None else spec.depth
        width = self.model.width if spec.width is None else spec.width
        return next(n for n, lv in enumerate(self.levels, start=1)
                    if lv.depth == depth and abs(self.model.width * lv.width - width) < 1e-9)

    # -- reporting ----------------------------------------------------------------------------
    def trained_levels(self, state: MethodState) -> list[int]:
        """Numbers of the levels some client has trained (every level, before round 1)."""
        return list(state.get("trained_levels", [])) or list(range(1, len(self.levels) + 1))

    def global_model_spec(self, state: MethodState) -> SubmodelSpec:
        """The highest trained level's model: level L is the whole model when its clients can train
        it; where exits push the whole model past the top budget (its level is then a slightly
        smaller split) or no client fits level L, the whole model's head is never trained and would
        score chance."""
        return self.spec_for(self.levels[self.trained_levels(state)[-1] - 1])

    def submodels(self, state: MethodState) -> dict[str, SubmodelSpec]:
        """Each trained level's own model, scored at its deepest exit (the paper's "local" accuracy)."""
        return {f"level{n}": self.spec_for(self.levels[n - 1]) for n in self.trained_levels(state)}

    def level_table(self) -> list[dict[str, Any]]:
        """ScaleFL's Table 1: per level s_d, s_w, parameters, forward FLOPs per sample, and the
        achieved cost ratio r_l (in the cost the levels were searched in) beside its target."""
        rows = []
        plain = frozenset()
        full_params = self.costs.params(self.model.width, self.blocks, plain)
        full_flops = self.costs.flops(self.model.width, self.blocks, plain)
        for n, level in enumerate(self.levels, start=1):
            width, exits = self.model.width * level.width, held_exits(self.exit_blocks, level.depth, self.blocks)
            params, flops = self.costs.params(width, level.depth, exits), self.costs.flops(width, level.depth, exits)
            if self.config.levels_from == "budgets":
                achieved = self._split_memory(level.width, level.depth, exits) / self._plain_memory()
            else:
                achieved = params / full_params if self.config.cost == "params" else flops / full_flops
            rows.append({"level": n, "name": f"level{n}", "s_d": level.depth / self.blocks, "s_w": level.width,
                         "depth": level.depth, "params": params, "flops": flops, "r_l": achieved, "target": level.target,
                         "cost": "memory" if self.config.levels_from == "budgets" else self.config.cost})
        return rows

