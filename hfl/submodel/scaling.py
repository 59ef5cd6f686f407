"""Solvers that turn a target size into a sub-model's width and depth: NeFL's width bisection and
block omission (depth scaling by exact subset sum), ScaleFL's most uniform width-depth split, and
FeDepth's decomposition of the body into block groups that fit a budget."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hfl.errors import ConfigError
from hfl.models.base import ResidualBlock, ScalableModel

log = logging.getLogger(__name__)

Group = tuple[int, int]
"""First and last body block of a group, inclusive (FeDepth)."""
CostRatio = Callable[[float, int, Sequence[int]], float]
"""(s_w, blocks kept, cuts of the exits before) -> cost of that split relative to the global model."""


@dataclass(frozen=True)
class Split:
    """A sub-model scaled in width and depth: width ratio s_w of the global model, body blocks kept."""

    width: float
    depth: int
    target: float
    """The target cost ratio it was searched for."""


def omittable_blocks(model: ScalableModel) -> set[int]:
    """Residual body blocks a sub-model may omit (their branch, or all but their projection shortcut)."""
    return {b.index for b in model.blocks() if isinstance(model.body[b.index], ResidualBlock)
            and (b.droppable or model.body[b.index].shortcut_modules)}


def stages_of(model: ScalableModel) -> list[list[int]]:
    """Body blocks grouped by stage (consecutive blocks with the same output channel group)."""
    blocks = model.blocks()
    stages: list[list[int]] = []
    for b in blocks:
        if stages and blocks[stages[-1][-1]].out_group == b.out_group:
            stages[-1].append(b.index)
        else:
            stages.append([b.index])
    return stages


def omission_order(model: ScalableModel) -> list[int]:
    """Body blocks in the order NeFL-D omits them (see the module docstring)."""
    omittable, stages = omittable_blocks(model), stages_of(model)
    tails = [[i for i in stage[1:] if i in omittable] for stage in stages]
    order = []
    while any(tails):
        for tail in reversed(tails):
            if tail:
                order.append(tail.pop())
    return order + [stage[0] for stage in reversed(stages) if stage[0] in omittable]


def blocks_to_omit(order: Sequence[int], saved: dict[int, int], total: int, target: float) -> frozenset[int]:
    """The blocks whose omission leaves the most parameters within `target * total` (omitting block
    b saves `saved[b]`), or among those within 1 % of the parameters of it the one omitting fewest
    blocks: an exact subset sum over the distinct block sizes; blocks of one size are
    interchangeable for the count, so they go in `order`'s preference."""
    need = total - target * total * (1 + 1e-9)
    if need <= 0:
        return frozenset()
    classes: dict[int, list[int]] = {}
    for block in order:
        classes.setdefault(saved[block], []).append(block)
    reachable: dict[int, tuple[int, ...]] = {0: ()}  # parameters saved -> blocks omitted per size class
    for size, blocks in classes.items():
        grown: dict[int, tuple[int, ...]] = {}
        for removed, counts in reachable.items():
            for count in range(len(blocks) + 1):
                key, choice = removed + count * size, (*counts, count)
                if key not in grown or sum(choice) < sum(grown[key]):
                    grown[key] = choice
        reachable = grown
    enough = [r for r in reachable if r >= need] or [max(reachable)]
    # Within 1 % of the parameters of the closest fit, omit as few blocks as possible (depth is
    # what a depth-scaled sub-model loses; many small blocks for a near-exact ratio is the worse trade).
    close = [r for r in enough if r <= min(enough) + 0.01 * total]
    counts = min((reachable[r] for r in close), key=lambda c: (sum(c), 0))
    return frozenset(b for blocks, count in zip(classes.values(), counts) for b in blocks[:count])


def per_stage_omission(stages: Sequence[Sequence[int]], omittable: set[int], saved: dict[int, int], total: int,
                       target: float, at_least: float = 0.0) -> frozenset[int]:
    """Every stage keeps its first n blocks, the same n in every stage (as the NeFL authors'
    ResNet-56 NeFL-WD sub-models, Table 12): the n whose share of the `total` parameters is closest to
    `target`, among those holding at least `at_least` of them (NeFL-WD: the sub-model's whole
    share, which the width then trims to). Both grow with the sub-model, so sub-models nest."""
    def omitted(n: int) -> frozenset[int]:
        return frozenset(b for stage in stages for b in stage[n:] if b in omittable)

    def share(n: int) -> float:
        return 1 - sum(saved[b] for b in omitted(n)) / total

    longest = max(len(stage) for stage in stages)
    candidates = [n for n in range(1, longest + 1) if share(n) >= at_least * (1 - 1e-9)] or [longest]
    return omitted(min(candidates, key=lambda n: (abs(share(n) - target), n)))


def largest_width(params: Callable[[float], int], target: float) -> float:
    """The largest width ratio in (0, 1] whose sub-model holds at most `target` parameters
    (`params(width)`, monotone in the width); bisection to 2^-30."""
    if params(1.0) <= target:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        if mid > 0 and params(mid) <= target:
            lo = mid
        else:
            hi = mid
    return max(lo, 1e-3)


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


def solve_splits(
    targets: Sequence[float], cost_ratio: CostRatio, *, widths: Sequence[float], blocks: int, epsilon: float, one_sided: bool = False
) -> list[Split]:
    """ScaleFL's levels for target cost ratios, in ascending order: for each the most uniform split
    (`most_uniform_split`) whose cost ratio lies within `epsilon` of the target (`one_sided`: within
    [1 - epsilon, 1] of it). A level is at least as deep as the one before, so that the level-j
    model holds exits 1..j (the paper's Figure 6) and is costed with exactly those: `cost_ratio`
    gets the cuts of the levels before. A target the whole model meets ends the list with it."""
    window = (1 - epsilon, 1.0) if one_sided else (1 - epsilon, 1 + epsilon)
    splits: list[Split] = []
    for number, target in enumerate(targets, start=1):
        cuts = tuple(sorted({sp.depth - 1 for sp in splits if sp.depth < blocks}))
        whole = cost_ratio(1.0, blocks, cuts) <= target if one_sided else target == 1.0
        if whole:
            splits.append(Split(1.0, blocks, target))
            break
        splits.append(_solve_level(number, target, cuts, cost_ratio, widths, blocks, epsilon, window, splits[-1].depth if splits else 1))
    log.info("levels (s_w, depth): %s", [(sp.width, sp.depth) for sp in splits])
    return splits


def _solve_level(
    number: int, target: float, cuts: tuple[int, ...], cost_ratio: CostRatio, widths: Sequence[float], blocks: int,
    epsilon: float, window: tuple[float, float], min_depth: int,
) -> Split:
    values: dict[tuple[int, int], float] = {}

    def ratio(i: int, depth: int) -> float:
        if (i, depth) not in values:
            values[i, depth] = cost_ratio(widths[i], depth, cuts) / target
        return values[i, depth]

    found = most_uniform_split(ratio, widths, blocks, window, min_depth)
    if found is None:
        closest = min(values.values(), key=lambda r: abs(r - 1)) * target
        raise ConfigError("method.epsilon", epsilon, f"a tolerance level {number} can meet: its target "
                          f"cost ratio is {target:g}, the closest split found costs {closest:.4f} of the model")
    return Split(widths[found[0]], found[1], target)


def decompose(num_blocks: int, fits: Callable[[Group], bool]) -> tuple[list[Group], list[int]]:
    """Memory-adaptive decomposition (Figure 3): consecutive blocks are packed into one group while
    `fits(group)` (the group's training fits the budget); a block that does not fit alone is
    skipped (partial training) and ends the group before it. Returns (groups, skipped blocks)."""
    groups: list[Group] = []
    skipped: list[int] = []
    first = None
    for block in range(num_blocks):
        if first is not None and fits((first, block)):
            continue
        if first is not None:
            groups.append((first, block - 1))
            first = None
        if fits((block, block)):
            first = block
        else:
            skipped.append(block)
    if first is not None:
        groups.append((first, num_blocks - 1))
    return groups, skipped


@dataclass(frozen=True)
class Layout:
    """How one budget trains the model depth-wise (FeDepth's task options): models trained together,
    block groups in order (`decompose`), skipped blocks."""

    models: int
    groups: tuple[Group, ...]
    skipped: tuple[int, ...]

    def __str__(self) -> str:
        """E.g. "blocks 4 | 5 | 6-9, skips 1-3; 2 models" (blocks counted from 1, as `hfl budget`)."""
        def span(first: int, last: int) -> str:
            return f"{first + 1}" if first == last else f"{first + 1}-{last + 1}"

        text = "blocks " + " | ".join(span(*g) for g in self.groups)
        if self.skipped:
            text += ", skips " + ", ".join(str(b + 1) for b in self.skipped)
        return text + (f"; {self.models} models" if self.models > 1 else "")
