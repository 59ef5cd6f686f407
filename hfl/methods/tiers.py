"""Dynamic client tiers (NeFL, Kang et al., appendix B.7): every round each client trains a
sub-model drawn at random from the ones its tier allows.

The paper's five tiers over five sub-models: tier 1 draws among sub-models 1-3, tier 2 among 1-4,
tier 3 among all, tier 4 among 2-5 and tier 5 among 3-5, i.e. tier t allows the sub-models within
`window = 2` of its own. Clients without a budget split into equal tiers (clients 0..M/L-1 are
tier 1, and so on; client ids carry no data order). A client with a memory budget is of the tier of
the largest sub-model whose training fits it (the method's accounting decides), and draws only
among the allowed sub-models that fit, so a budget is never broken.

HeteroFL, FjORD and DepthFL take the same draw over their width or depth levels with
`method.tier_window`, so the paper's Table 1 baselines see the dynamic environment NeFL does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hfl.accounting.budgets import ClientBudget
from hfl.types import RoundContext

TIER_STREAM = 5  # seed tag of a client-round's sub-model draw (data order is tag 1, per-batch widths tag 3)


class DynamicTiers:
    """Draws the level (index into a method's sub-models, smallest first) a client trains each round."""

    def __init__(self, levels: int, window: int) -> None:
        if levels < 1 or window < 0:
            raise ValueError(f"need at least one level and a window >= 0, got {levels} levels and window {window}")
        self.levels, self.window = levels, window
        self.num_clients: int | None = None
        """Clients in the run (from `use_budgets`); without it a client's tier is its id modulo the levels."""

    @classmethod
    def for_window(cls, levels: int, window: int) -> DynamicTiers | None:
        """Tiers over `levels` with a config's `tier_window`; None when it is -1 (off)."""
        return cls(levels, window) if window >= 0 else None

    def use_budgets(self, budgets: Sequence[ClientBudget | None]) -> None:
        self.num_clients = len(budgets)

    def tier(self, ctx: RoundContext, fits: Callable[[int], bool]) -> int | None:
        """The client's tier (0-based): the largest level fitting its memory budget (None if none
        does), or its equal share of the clients when it has no memory budget."""
        if ctx.budget is None or ctx.budget.memory_bytes is None:
            if self.num_clients:
                return min(ctx.client_id * self.levels // self.num_clients, self.levels - 1)
            return ctx.client_id % self.levels
        return next((k for k in reversed(range(self.levels)) if fits(k)), None)

    def allowed(self, ctx: RoundContext, fits: Callable[[int], bool]) -> list[int]:
        """The levels the client may train this round: its tier's window, within its budget."""
        tier = self.tier(ctx, fits)
        if tier is None:
            return []
        window = range(max(0, tier - self.window), min(self.levels - 1, tier + self.window) + 1)
        budgeted = ctx.budget is not None and ctx.budget.memory_bytes is not None
        return [k for k in window if not budgeted or (k <= tier and fits(k))]

    def draw(self, ctx: RoundContext, fits: Callable[[int], bool]) -> int | None:
        """This client-round's level, uniform over `allowed` (seeded by the client-round); None
        when no level fits the budget."""
        return self.pick(ctx, self.allowed(ctx, fits))

    @staticmethod
    def pick(ctx: RoundContext, allowed: Sequence[int]) -> int | None:
        """One of `allowed`, uniformly, seeded by the client-round; None when it is empty."""
        if not allowed:
            return None
        return allowed[int(torch.randint(len(allowed), (), generator=ctx.generator(TIER_STREAM)))]
