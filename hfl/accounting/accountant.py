"""Training costs of an experiment's models, measured once per key and batch size and cached: for
the experiment alone, or shared with every experiment of the process that builds the same models
(`Accountant.shared_as`), so that a sweep, a resumed run or a suite of runs measures nothing twice;
with `HFL_COST_STORE`, shared with the other processes of a session too (`hfl.accounting.cost_store`)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor, nn

from hfl.accounting.cost import (
    Step,
    TrainingCost,
    cross_entropy_step,
    measure_training_cost,
    zero_inputs,
)
from hfl.accounting.cost_store import stored_cost
from hfl.models.base import ScalableModel
from hfl.seeding import aside_from_torch_stream

ModelFactory = Callable[[float], ScalableModel]
SHARED_COSTS_KEPT = 4096
"""How many shared measurements a process keeps (the oldest go first); each is a few hundred bytes."""
_shared_costs: dict[Hashable, TrainingCost] = {}


class CostScopes(NamedTuple):
    """What an experiment's models are, as hashable descriptions that are equal exactly when two
    experiments build the same models (their configs, less what cannot change a model)."""

    plain: Hashable
    """What `build(width)` makes: the model and data settings."""
    method: Hashable
    """What the method's own keys name: `plain` and every setting of the method and its budgets."""


def optimizer_kind(name: str, momentum: float) -> str:
    """The accounting's optimiser-state kind for an `fl.optimizer` setting."""
    return "adam" if name == "adam" else ("sgd_momentum" if momentum > 0 else "sgd")


@dataclass
class Accountant:
    """Answers "what does training this model cost?" for one experiment's data and optimiser.

    Methods ask with a key that names the model's structure (a sub-model's `shape` and frozen
    tensors) and a function that builds it: specs that differ only in their indices (a rolled
    window, other bases) cost the same and are measured once."""

    build: ModelFactory
    """Builds the plain model (no method's changes) at an absolute width ratio."""
    input_shape: tuple[int, ...]
    """One sample as the model reads it: C x H x W, or the sequence of token ids."""
    num_classes: int
    optimizer: str = "sgd_momentum"
    weight_decay: float = 0.0
    """The clients' weight decay: the optimiser's temporaries depend on it."""
    input_dtype: torch.dtype = torch.float32
    """float32: normalised images; int64: token ids, with a target token at every position."""
    conv_workspace: bool = False
    """Count the unfolded input CUDA's convolutions allocate without cuDNN (clients on CUDA with
    cuDNN off): on an H100 it was what put FeDepth's single-block peaks 6 % above the estimate."""
    cuda_headroom: int = 0
    """Bytes a budgeted client on CUDA keeps beyond its tensors, added to every peak (`backend.cuda_headroom_mib`)."""
    precision: str = "32-true"
    """The clients' `fl.precision`: training is measured under its autocast."""
    autocast_lists: str | None = None
    """"cuda" where clients train on CUDA: the measurement's autocast casts as CUDA's does (its lists
    differ from the CPU's); None: as the measuring device's."""
    shared_as: CostScopes | None = None
    """Share costs with every accountant of this process with equal scopes; None: this one's own."""
    _cache: dict[Hashable, TrainingCost] = field(default_factory=dict)

    def measure(
        self,
        model: nn.Module,
        batch_size: int,
        step: Step = cross_entropy_step,
        *,
        count_flops: bool = True,
        record_only: str | None = None,
        in_place: bool = False,
    ) -> TrainingCost:
        """Measure training `model` as this experiment's clients train (its input shape, classes,
        optimiser and weight decay); uncached. `in_place`: train `model` itself, not a copy (see
        `measure_training_cost`), as the cached costs do with the models they build."""
        return measure_training_cost(
            model, self.input_shape, self.num_classes, batch_size, self.optimizer, step=step,
            record_only=record_only, count_flops=count_flops, weight_decay=self.weight_decay, input_dtype=self.input_dtype,
            conv_workspace=self.conv_workspace, headroom=self.cuda_headroom, in_place=in_place, precision=self.precision,
            autocast_lists=self.autocast_lists,
        )

    def zero_inputs(self, size: int) -> Tensor:
        """`size` all-zero inputs of this experiment's shape and dtype (for probing shapes and FLOPs)."""
        return zero_inputs(self.input_shape, size, self.input_dtype)

    def cost(
        self, key: Hashable, build: Callable[[], nn.Module], batch_size: int, step: Step = cross_entropy_step, *, count_flops: bool = True
    ) -> TrainingCost:
        """The cost of training the model `build()` makes (its `requires_grad` flags say what
        trains) with `step`, measured the first time `key` is asked for at this batch size. A
        method's key names its model and step within the method (e.g. `("client", shape, frozen)`)."""
        return self._cached("method", key, batch_size, count_flops,
                            lambda: self.measure(build(), batch_size, step, count_flops=count_flops, in_place=True))

    def plain_cost(self, width: float, batch_size: int) -> TrainingCost:
        """Training the plain model at `width` (what a `width:` budget means, for every method alike)."""
        return self._cached("plain", ("plain", width), batch_size, True,
                            lambda: self.measure(self.build(width), batch_size, in_place=True))

    def block_cost(self, block: int, batch_size: int, width: float = 1.0) -> TrainingCost:
        """Training body block `block` alone (FeDepth's unit, as its Table 1 counts it): the other
        blocks frozen, only that block's saved activations counted, the head trained with it."""
        def measured() -> TrainingCost:
            model = self.build(width)
            model.requires_grad_(False)
            model.body[block].requires_grad_(True)
            model.head.requires_grad_(True)
            return self.measure(model, batch_size, record_only=f"body.{block}", in_place=True)

        return self._cached("plain", ("block", block, width), batch_size, True, measured)

    def _cached(self, scope: str, key: Hashable, batch_size: int, count_flops: bool, measured: Callable[[], TrainingCost]) -> TrainingCost:
        """`measured()`, the first time `key` is asked for at this batch size, in `scope` ("plain"
        or "method") of `shared_as`, or in this accountant's own cache."""
        # The default dtype decides the models' precision (float64 under torch.set_default_dtype).
        full_key = (key, batch_size, count_flops, torch.get_default_dtype())
        if self.shared_as is None:
            store = self._cache
        else:
            shared = (getattr(self.shared_as, scope), self.input_shape, self.num_classes, self.optimizer, self.weight_decay, self.input_dtype,
                      self.conv_workspace, self.cuda_headroom, self.precision, self.autocast_lists)
            store, full_key = _shared_costs, (*shared, *full_key)
        if full_key not in store:
            if store is _shared_costs and len(store) >= SHARED_COSTS_KEPT:
                del store[next(iter(store))]
            with aside_from_torch_stream():  # the probe models are built lazily
                # Only a shared key names the models it measured: filed for other processes (cost_store).
                store[full_key] = stored_cost(full_key, measured) if store is _shared_costs else measured()
        return store[full_key]
