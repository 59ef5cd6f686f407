"""HeteroFL — Diao, Ding and Tarokh, "HeteroFL: Computation and Communication Efficient Federated
Learning for Heterogeneous Clients", ICLR 2021. Each client trains the upper-left width-r slice of
every layer, r the widest rate of a ladder whose training memory fits its budget; the server
averages each entry over the clients that hold it. With `tier_window` >= 0 a client instead trains
a rate drawn every round from its tier's window (NeFL's dynamic environment, `hfl.submodel.ladder`).

Batch norm is static (`model.norm=static_bn`: batch statistics while training, statistics
recomputed from the training data for evaluation); the scaler divides every conv output by r while
training, so a slice's activations keep the full model's scale; the masking trick zeroes the
logits of classes a client has no data for, and its classifier rows of those classes are left out
of its update (`ClientTask.present_classes_only`). The masked mean counts every client once
(`weighting=clients`), as the paper and the authors' code. A client that fits no rate sits the round out.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hfl.errors import check
from hfl.methods.base import Client, LadderConfig, Method, MethodState, Resources
from hfl.methods.vectorisable import vectorisable
from hfl.registry import METHODS
from hfl.submodel.ladder import Level
from hfl.submodel.spec import SubmodelSpec, width_spec
from hfl.types import ClientTask, RoundContext


@dataclass(frozen=True)
class HeteroFLConfig(LadderConfig):
    name: str = "heterofl"
    weighting: str = "clients"
    """The paper and the authors' code average every entry over the clients that hold it, each once."""
    widths: tuple[float, ...] = (1.0, 0.5, 0.25, 0.125, 0.0625)
    """Width rates a client may train, relative to the global model (the paper's a-e levels)."""
    scaler: bool = True
    """Divide conv outputs by the rate while training (the paper's scaler)."""
    masked_ce: bool = False
    """Zero the logits of classes absent from the client's data (the paper's masking trick, for non-IID data)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(bool(self.widths) and all(0 < w <= 1 for w in self.widths), "widths", list(self.widths), "rates in (0, 1]")


@dataclass(frozen=True)
class WidthOptions:
    """A client of a width ladder: its rate r, relative to the global model."""

    rate: float


@contextmanager
def scaled_conv_outputs(model: nn.Module, rate: float) -> Iterator[None]:
    """While active, every conv output is divided by `rate` (HeteroFL's scaler)."""
    hooks = [m.register_forward_hook(lambda _m, _i, out: out / rate) for m in model.modules() if isinstance(m, nn.Conv2d)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def scaling(model: nn.Module, on: bool, rate: float) -> AbstractContextManager[None]:
    """HeteroFL's scaler while `on` and the rate is not 1."""
    return scaled_conv_outputs(model, rate) if on and rate != 1.0 else nullcontext()


@METHODS.register("heterofl")
class HeteroFL(Method):
    Config = HeteroFLConfig
    preferred_norm = "static_bn"

    def __init__(self, config: HeteroFLConfig, resources: Resources, **ladder_policies: Any) -> None:
        """`ladder_policies`: what a method built on HeteroFL's levels does differently (`Ladder`'s
        evaluated, global_model, place)."""
        super().__init__(config, resources)
        levels = [Level(f"x{rate:g}", self.level_spec(rate), WidthOptions(rate)) for rate in sorted(config.widths)]
        self.ladder = self.make_ladder(levels, tier_window=config.tier_window, **ladder_policies)

    def plan(self, ctx: RoundContext, state: MethodState) -> ClientTask | None:
        """The ladder's task; with the masking trick a client's classifier rows of classes absent
        from its data are left out of its update (the authors' code averages each row over the
        clients holding its label)."""
        task = super().plan(ctx, state)
        return replace(task, present_classes_only=True) if task is not None and self.config.masked_ce else task

    def level_spec(self, rate: float) -> SubmodelSpec:
        return width_spec(self.model, self.model.width * rate)

    @vectorisable
    def objective(self, client: Client, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        with scaling(client.model, self.config.scaler, client.task.options.rate):
            logits = client.model(x)
        if self.config.masked_ce and client.classes is not None:
            # Out of place (no index assignment), so that it vectorises over clients (vmap).
            present = (client.classes.view(-1, 1) == torch.arange(logits.shape[1], device=logits.device)).any(0)
            # Classes run along dim 1; a language model's logits have positions after them.
            logits = logits.masked_fill(~present.view(-1, *[1] * (logits.dim() - 2)), 0.0)
        return {"loss": F.cross_entropy(logits, y)}
