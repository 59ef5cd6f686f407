"""HeteroFL — Diao, Ding and Tarokh, "HeteroFL: Computation and Communication Efficient Federated
Learning for Heterogeneous Clients", ICLR 2021. Each client trains the upper-left width-r slice of
every layer, r the widest rate of a ladder whose training memory fits its budget; the server
averages each entry over the clients that hold it. With `tier_window` >= 0 a client instead trains
a rate drawn every round from its tier's window (NeFL's dynamic environment, `hfl.methods.tiers`).

Batch norm is static (`model.norm=static_bn`: batch statistics while training, statistics
recomputed from the training data for evaluation); the scaler divides every conv output by r while
training, so a slice's activations keep the full model's scale; the masking trick zeroes the
logits of classes a client has no data for.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.nn.functional as F
from torch import Tensor, nn

from hfl.accounting.accountant import Accountant
from hfl.accounting.budgets import ClientBudget
from hfl.config import check
from hfl.methods.base import Method, MethodConfig, MethodState
from hfl.methods.tiers import DynamicTiers
from hfl.models.base import ScalableModel
from hfl.registry import METHODS
from hfl.submodel.spec import SubmodelSpec, width_spec
from hfl.types import ClientTask, RoundContext

if TYPE_CHECKING:
    from hfl.client import ClientModule

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeteroFLConfig(MethodConfig):
    name: str = "heterofl"
    widths: tuple[float, ...] = (1.0, 0.5, 0.25, 0.125, 0.0625)
    """Width rates a client may train, relative to the global model (the paper's a-e levels)."""
    scaler: bool = True
    """Divide conv outputs by the rate while training (the paper's scaler)."""
    masked_ce: bool = False
    """Zero the logits of classes absent from the client's data (the paper's masking trick, for non-IID data)."""
    tier_window: int = -1
    """-1: off (each client trains the largest level fitting its budget, as before). k >= 0: NeFL's
    dynamic tiers (appendix B.7, `hfl.methods.tiers`): each round a client trains a level drawn
    uniformly within k levels of its tier (the paper's setting is 2 with five levels)."""

    def __post_init__(self) -> None:
        check(bool(self.widths) and all(0 < w <= 1 for w in self.widths), "widths", list(self.widths), "rates in (0, 1]")
        window = self.tier_window
        check(isinstance(window, int) and not isinstance(window, bool) and window >= -1, "tier_window", window, "an integer >= -1")


@contextmanager
def scaled_conv_outputs(model: nn.Module, rate: float) -> Iterator[None]:
    """While active, every conv output is divided by `rate` (HeteroFL's scaler)."""
    hooks = [m.register_forward_hook(lambda _m, _i, out: out / rate) for m in model.modules() if isinstance(m, nn.Conv2d)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


@METHODS.register("heterofl")
class HeteroFL(Method):
    Config = HeteroFLConfig
    paper = "Diao, Ding and Tarokh, ICLR 2021 (arXiv:2010.01264)"
    preferred_norm = "static_bn"

    def __init__(self, config: HeteroFLConfig, model: ScalableModel, accountant: Accountant | None = None) -> None:
        super().__init__(config, model, accountant)
        window = config.tier_window
        self.tiers = DynamicTiers.for_window(len(config.widths), window)
        """NeFL's dynamic tiers over the rates, smallest first; None: each client trains its widest fitting rate."""

    def use_budgets(self, budgets: Sequence[ClientBudget | None], batch_size: int) -> None:
        super().use_budgets(budgets, batch_size)
        if self.tiers is not None:  # clients without a budget split into tiers by their share of the run
            self.tiers.use_budgets(budgets)

    def rate_fits(self, rate: float, ctx: RoundContext) -> bool:
        """Whether training at `rate` fits the client's memory budget (always, without a budget or an accountant)."""
        budget = ctx.budget.memory_bytes if ctx.budget else None
        if budget is None or self.accountant is None:
            return True
        batch = min(ctx.train.batch_size, ctx.num_samples)
        return self.accountant.cost(self.model.width * rate, batch).peak_bytes <= budget

    def rate_for(self, ctx: RoundContext) -> float:
        """The widest rate whose estimated training memory fits the client's budget."""
        rates = sorted(self.config.widths, reverse=True)
        rate = next((r for r in rates if self.rate_fits(r, ctx)), None)
        if rate is None:
            log.warning("client %d: even rate %g exceeds its budget of %d bytes", ctx.client_id, rates[-1], ctx.budget.memory_bytes)
            return rates[-1]
        return rate

    def spec_for(self, rate: float, ctx: RoundContext) -> SubmodelSpec:
        return width_spec(self.model, self.model.width * rate)

    def plan(self, ctx: RoundContext, state: MethodState) -> ClientTask | None:
        if self.tiers is None:
            rate = self.rate_for(ctx)
        else:
            rates = sorted(self.config.widths)
            level = self.tiers.draw(ctx, lambda k: self.rate_fits(rates[k], ctx))
            if level is None:  # nothing fits: sit out rather than break the budget
                return None
            rate = rates[level]
        return ClientTask(ctx, self.spec_for(rate, ctx), {"rate": rate})

    def objective(self, client: ClientModule, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        rate = client.task.options["rate"]
        scaling = self.config.scaler and rate != 1.0
        with scaled_conv_outputs(client.model, rate) if scaling else nullcontext():
            logits = client.model(x)
        if self.config.masked_ce and client.classes is not None:
            present = logits.new_zeros(logits.shape[1], dtype=bool)
            present[client.classes] = True
            logits = logits.masked_fill(~present, 0.0)
        return {"loss": F.cross_entropy(logits, y)}

    def submodels(self, state: MethodState) -> dict[str, SubmodelSpec]:
        return {f"x{rate:g}": width_spec(self.model, self.model.width * rate) for rate in sorted(self.config.widths)}
