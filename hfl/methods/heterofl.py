"""HeteroFL — Diao, Ding and Tarokh, "HeteroFL: Computation and Communication Efficient Federated
Learning for Heterogeneous Clients", ICLR 2021. Each client trains the upper-left width-r slice of
every layer, r the widest rate of a ladder whose training memory fits its budget; the server
averages each entry over the clients that hold it.

Batch norm is static (`model.norm=static_bn`: batch statistics while training, statistics
recomputed from the training data for evaluation); the scaler divides every conv output by r while
training, so a slice's activations keep the full model's scale; the masking trick zeroes the
logits of classes a client has no data for.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.nn.functional as F
from torch import Tensor, nn

from hfl.config import check
from hfl.methods.base import Method, MethodConfig, MethodState
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

    def __post_init__(self) -> None:
        check(bool(self.widths) and all(0 < w <= 1 for w in self.widths), "widths", list(self.widths), "rates in (0, 1]")


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

    def rate_for(self, ctx: RoundContext) -> float:
        """The widest rate whose estimated training memory fits the client's budget."""
        rates = sorted(self.config.widths, reverse=True)
        budget = ctx.budget.memory_bytes if ctx.budget else None
        if budget is None or self.accountant is None:
            return rates[0]
        batch = min(ctx.train.batch_size, ctx.num_samples)
        for rate in rates:
            if self.accountant.cost(self.model.width * rate, batch).peak_bytes <= budget:
                return rate
        log.warning("client %d: even rate %g exceeds its budget of %d bytes", ctx.client_id, rates[-1], budget)
        return rates[-1]

    def spec_for(self, rate: float, ctx: RoundContext) -> SubmodelSpec:
        return width_spec(self.model, self.model.width * rate)

    def plan(self, ctx: RoundContext, state: MethodState) -> ClientTask:
        rate = self.rate_for(ctx)
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
