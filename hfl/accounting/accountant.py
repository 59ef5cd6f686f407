"""Training costs of an experiment's models, measured once per key and batch size and cached."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from hfl.accounting.cost import (
    Step,
    TrainingCost,
    cross_entropy_step,
    measure_training_cost,
    zero_inputs,
)
from hfl.models.base import ScalableModel

ModelFactory = Callable[[float], ScalableModel]


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
    _cache: dict[tuple, TrainingCost] = field(default_factory=dict)

    def measure(
        self, model: nn.Module, batch_size: int, step: Step = cross_entropy_step, *, count_flops: bool = True, record_only: str | None = None
    ) -> TrainingCost:
        """Measure training `model` as this experiment's clients train (its input shape, classes,
        optimiser and weight decay); uncached."""
        return measure_training_cost(
            model, self.input_shape, self.num_classes, batch_size, self.optimizer, step=step,
            record_only=record_only, count_flops=count_flops, weight_decay=self.weight_decay, input_dtype=self.input_dtype,
        )

    def zero_inputs(self, size: int) -> Tensor:
        """`size` all-zero inputs of this experiment's shape and dtype (for probing shapes and FLOPs)."""
        return zero_inputs(self.input_shape, size, self.input_dtype)

    def cost(self, key: Hashable, build: Callable[[], nn.Module], batch_size: int, step: Step = cross_entropy_step) -> TrainingCost:
        """The cost of training the model `build()` makes (its `requires_grad` flags say what
        trains) with `step`, measured the first time `key` is asked for at this batch size."""
        if (key, batch_size) not in self._cache:
            self._cache[key, batch_size] = self.measure(build(), batch_size, step)
        return self._cache[key, batch_size]

    def plain_cost(self, width: float, batch_size: int) -> TrainingCost:
        """Training the plain model at `width` (what a `width:` budget means, for every method alike)."""
        return self.cost(("plain", width), lambda: self.build(width), batch_size)

    def block_cost(self, block: int, batch_size: int, width: float = 1.0) -> TrainingCost:
        """Training body block `block` alone (FeDepth's unit, as its Table 1 counts it): the other
        blocks frozen, only that block's saved activations counted, the head trained with it."""
        key = ("block", block, batch_size, width)
        if key not in self._cache:
            model = self.build(width)
            model.requires_grad_(False)
            model.body[block].requires_grad_(True)
            model.head.requires_grad_(True)
            self._cache[key] = self.measure(model, batch_size, record_only=f"body.{block}")
        return self._cache[key]
