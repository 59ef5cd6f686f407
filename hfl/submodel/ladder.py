"""A ladder of sub-models: the shared core of every method whose clients train one of several levels.

HeteroFL's widths, FjORD's ladder widths, DepthFL's prefixes, ScaleFL's levels, NeFL's nested
sub-models, SplitMix's number of bases and Decoupled's separate models are each an ordered list of
`Level`s, smallest first: a name (the key of `submodel_accuracy`), a `SubmodelSpec` and the method's
typed options for a client that trains it. The ladder owns what those methods share:

- fitting a level to a client's budgets: a level fits when the method's estimated training cost of
  it stays within the client's memory, FLOPs (per client-round) and upload budgets, and, with a time
  budget (`fl.deadline_plans`), when its download, training and upload end within the deadline on
  the client's device;
- choosing a client's level each round: the largest that fits; or, with `tier_window` >= 0, NeFL's
  dynamic tiers (appendix B.7): tier t draws uniformly among the levels within `tier_window` of its
  own, the tier being the largest fitting level (clients with neither a memory nor a time budget
  split into equal tiers); a client no level fits sits the round out;
- which levels were trained (the server records the level of every update in the method state),
  which sub-models are scored every evaluation and which one is "the global model";
- the rows `hfl budget` prints about the levels.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dataclasses import replace

import numpy as np
import torch

from hfl.accounting.amounts import ClientBudget
from hfl.accounting.cost import TrainingCost
from hfl.submodel.spec import SubmodelSpec, full_spec
from hfl.types import ClientTask, RoundContext

log = logging.getLogger(__name__)

TIER_STREAM = 5  # seed tag of a client-round's level draw (data order is tag 1, FjORD's per-batch widths tag 3)
UNBUDGETED = ("largest", "shares")
EVALUATED = ("all", "nested", "trained", "none")
GLOBAL = ("whole", "largest", "largest_trained")


@dataclass(frozen=True)
class Level:
    """One sub-model a client may train."""

    name: str
    spec: SubmodelSpec
    options: Any = None
    """The method's settings for a client of this level (a frozen dataclass), handed to its objective."""


Cost = Callable[[ClientTask, int], TrainingCost]
"""(task, batch size) -> what training it costs per step: the method's `training_cost`."""
Place = Callable[[Level, RoundContext], tuple[SubmodelSpec, Any]]
"""(level, client-round) -> the client's spec and options, where they depend on the client-round
(FedRolex's rolling window, SplitMix's choice of bases); shapes stay the level's."""


def equal_share(client_id: int, num_clients: int | None, levels: int) -> int:
    """Level (0-based) of the client's equal share of the clients by id (ids carry no data order),
    the first ids at the lowest level; shares differ by at most one client, the larger ones at the
    top levels (NeFL's appendix B.7: 3, 3 and 4 of 10 clients). Without the number of clients, the id
    modulo the levels."""
    if num_clients is None:
        return client_id % levels
    base, extra = divmod(num_clients, levels)
    small = (levels - extra) * base  # the ids in the lower levels' shares of `base` clients
    return client_id // base if client_id < small else levels - extra + (client_id - small) // (base + 1)


class DynamicTiers:
    """NeFL's dynamic tiers over `levels` levels (index 0 the smallest)."""

    def __init__(self, levels: int, window: int, num_clients: int | None = None) -> None:
        if levels < 1 or window < 0:
            raise ValueError(f"need at least one level and a window >= 0, got {levels} levels and window {window}")
        self.levels, self.window, self.num_clients = levels, window, num_clients

    def tier(self, ctx: RoundContext, fits: Callable[[int], bool]) -> int | None:
        """The client's tier: the largest level fitting its memory and time budgets (None if none does), or
        its equal share of the clients when it has neither (client ids carry no data order)."""
        if not sizes_levels(ctx.budget):
            return equal_share(ctx.client_id, self.num_clients, self.levels)
        return next((k for k in reversed(range(self.levels)) if fits(k)), None)

    def allowed(self, ctx: RoundContext, fits: Callable[[int], bool]) -> list[int]:
        """The levels the client may train this round: its tier's window, within its budget."""
        tier = self.tier(ctx, fits)
        if tier is None:
            return []
        window = range(max(0, tier - self.window), min(self.levels - 1, tier + self.window) + 1)
        return [k for k in window if not sizes_levels(ctx.budget) or (k <= tier and fits(k))]

    @staticmethod
    def pick(ctx: RoundContext, allowed: Sequence[int]) -> int | None:
        """One of `allowed`, uniformly, seeded by the client-round; None when it is empty."""
        if not allowed:
            return None
        return allowed[int(torch.randint(len(allowed), (), generator=ctx.generator(TIER_STREAM)))]


class Ladder:
    """Levels, smallest first, with the policies a method chooses (see the module docstring).

    `unbudgeted`: what a client without a memory budget trains: 'largest', or 'shares' (ScaleFL: an
    equal share of the clients at each level, fixed for the run). `evaluated`: the sub-models scored
    every evaluation: 'all' levels, the 'nested' ones up to the largest trained (training a level
    trains the smaller ones inside it: FjORD, DepthFL), the 'trained' ones (before round 1 all), or
    'none' (CAFF: every level holds the same weights, so only the global model is scored).
    `global_model`: what is scored as the global model: the 'whole' global state, the 'largest'
    level, or the 'largest_trained' one. `table(ctx)`: rows `hfl budget` prints (default one per
    level), a row whose `name` is a level's getting that level's training memory."""

    def __init__(
        self,
        levels: Sequence[Level],
        cost: Cost,
        *,
        budgets: Sequence[ClientBudget | None] = (),
        tier_window: int = -1,
        unbudgeted: str = "largest",
        evaluated: str = "all",
        global_model: str = "whole",
        place: Place | None = None,
        upload: Callable[[SubmodelSpec], int] | None = None,
        table: Callable[[RoundContext], list[dict[str, Any]]] | None = None,
        title: str = "",
    ) -> None:
        if not levels or len({lv.name for lv in levels}) != len(levels):
            raise ValueError(f"a ladder needs levels with distinct names, got {[lv.name for lv in levels]}")
        for value, allowed in ((unbudgeted, UNBUDGETED), (evaluated, EVALUATED), (global_model, GLOBAL)):
            if value not in allowed:
                raise ValueError(f"{value!r} is not one of {allowed}")
        self.levels = tuple(levels)
        self.cost, self.place, self.upload, self.table, self.title = cost, place, upload, table, title
        self.unbudgeted, self.evaluated_policy, self.global_policy = unbudgeted, evaluated, global_model
        self.num_clients = len(budgets) or None
        self.tiers = DynamicTiers(len(self.levels), tier_window, self.num_clients) if tier_window >= 0 else None
        self._index = {lv.name: k for k, lv in enumerate(self.levels)}

    def __getitem__(self, name: str) -> Level:
        return self.levels[self._index[name]]

    # -- fitting and planning -----------------------------------------------------------------
    def task_for(self, ctx: RoundContext, level: Level, choices: Sequence[str] = ()) -> ClientTask:
        spec, options = self.place(level, ctx) if self.place else (level.spec, level.options)
        return ClientTask(ctx, spec, options, level=level.name, choices=tuple(choices))

    def fits(self, level: Level, ctx: RoundContext) -> bool:
        """Whether training `level` stays within the client's memory, FLOPs, upload and time budgets."""
        budget = ctx.budget
        if budget is None or (budget.memory_bytes is None and budget.flops is None and budget.upload_bytes is None and budget.time is None):
            return True
        cost = self.cost(ClientTask(ctx, level.spec, level.options, level=level.name), min(ctx.train.batch_size, ctx.num_samples))
        flops = cost.train_flops_per_sample * ctx.num_samples * ctx.train.local_epochs
        return (
            (budget.memory_bytes is None or cost.peak_bytes <= budget.memory_bytes)
            and (budget.flops is None or flops <= budget.flops)
            and (budget.upload_bytes is None or self.upload is None or self.upload(level.spec) <= budget.upload_bytes)
            and (budget.time is None or self.upload is None or self.in_time(budget, level.spec, flops, ctx))
        )

    def in_time(self, budget: ClientBudget, spec: SubmodelSpec, flops: int, ctx: RoundContext) -> bool:
        """Whether a client-round of `spec` ends within the time budget. A client receives its client
        model's tensors, what it would send back with nothing frozen (as the round records bytes down)."""
        down = self.upload(replace(spec, frozen=frozenset()))
        return budget.time.admits(down, flops, ctx.num_samples, ctx.train.local_epochs, self.upload(spec))

    def task(self, ctx: RoundContext) -> ClientTask | None:
        """This client-round's task: its level's spec and options; None when no level fits."""
        count = len(self.levels)
        choices: list[int] = []
        if self.tiers is not None:
            choices = self.tiers.allowed(ctx, lambda k: self.fits(self.levels[k], ctx))
            index = self.tiers.pick(ctx, choices)
        elif self.unbudgeted == "shares" and not sizes_levels(ctx.budget):
            index = equal_share(ctx.client_id, self.num_clients, count)  # as the tiers split clients without budgets
        else:
            index = next((k for k in reversed(range(count)) if self.fits(self.levels[k], ctx)), None)
        if index is None:
            log.info("client %d: not even level %s fits its budget %s", ctx.client_id, self.levels[0].name, ctx.budget)
            return None
        return self.task_for(ctx, self.levels[index], [self.levels[k].name for k in choices])

    # -- what was trained, and what is evaluated ------------------------------------------------
    def trained(self, trained_levels: frozenset[str]) -> list[Level]:
        return [lv for lv in self.levels if lv.name in trained_levels]

    def evaluated(self, trained_levels: frozenset[str]) -> dict[str, SubmodelSpec]:
        """The sub-models scored every evaluation, by level name."""
        if self.evaluated_policy == "none":
            return {}
        trained = self.trained(trained_levels)
        if self.evaluated_policy == "all" or not trained:
            levels = self.levels
        elif self.evaluated_policy == "nested":
            levels = self.levels[: self._index[trained[-1].name] + 1]
        else:
            levels = tuple(trained)
        return {lv.name: lv.spec for lv in levels}

    def global_spec(self, trained_levels: frozenset[str]) -> SubmodelSpec:
        if self.global_policy == "whole":
            return full_spec()
        trained = self.trained(trained_levels)
        if self.global_policy == "largest" or not trained:
            return self.levels[-1].spec
        return trained[-1].spec

    # -- reporting ------------------------------------------------------------------------------
    def rows(self, ctx: RoundContext) -> list[dict[str, Any]]:
        """The rows `hfl budget` prints, each naming a level with its training memory at `ctx`'s batch."""
        rows = [dict(row) for row in self.table(ctx)] if self.table else [{"name": lv.name} for lv in self.levels]
        batch = min(ctx.train.batch_size, ctx.num_samples)
        for row in rows:
            if row.get("name") in self._index:
                level = self[row["name"]]
                row["peak_bytes"] = self.cost(ClientTask(ctx, level.spec, level.options, level=level.name), batch).peak_bytes
        return rows


def sizes_levels(budget: ClientBudget | None) -> bool:
    """Whether a budget picks the client's level by fitting (a memory or a time budget), rather than
    leaving it to the method's policy for unbudgeted clients (FLOPs and upload budgets only bound it)."""
    return budget is not None and (budget.memory_bytes is not None or budget.time is not None)


def budget_centres(budgets: Sequence[ClientBudget | None], k: int) -> list[float]:
    """Levels from budgets: the centres of an optimal 1-D k-means over the clients' memory budgets."""
    return kmeans_1d([b.memory_bytes for b in budgets if b is not None and b.memory_bytes is not None], k)


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
