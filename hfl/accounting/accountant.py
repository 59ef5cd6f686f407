"""Training costs per (sub-model shape, batch size), measured once and cached."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from hfl.accounting.cost import (
    Step,
    TrainingCost,
    cross_entropy_step,
    measure_training_cost,
)
from hfl.models.base import ScalableModel
from hfl.submodel.spec import SubmodelSpec, shape_model

ModelFactory = Callable[[float], ScalableModel]


def unchanged(model: ScalableModel) -> ScalableModel:
    return model


def optimizer_kind(name: str, momentum: float) -> str:
    """The accounting's optimiser-state kind for an `fl.optimizer` setting."""
    return "adam" if name == "adam" else ("sgd_momentum" if momentum > 0 else "sgd")


@dataclass
class Accountant:
    """Answers "what does training this sub-model cost?" for one experiment's model and data.

    Specs that differ only in their indices (a rolled window, a different channel choice) have the
    same cost, so the cache key is the shape: width, depth structure, frozen tensors, batch size."""

    build: ModelFactory
    """Builds the plain model at an absolute width ratio."""
    input_shape: tuple[int, ...]
    num_classes: int
    optimizer: str = "sgd_momentum"
    weight_decay: float = 0.0
    """The clients' weight decay: the optimiser's temporaries depend on it."""
    adapt: Callable[[ScalableModel], ScalableModel] = unchanged
    """The method's changes to every model it trains (exits, a norm per width); budgets written as
    `width:` amounts are costed without them, so they mean the same for every method."""
    _cache: dict[tuple, TrainingCost] = field(default_factory=dict)

    def measure(
        self, model: nn.Module, batch_size: int, step: Step = cross_entropy_step, *, count_flops: bool = True, record_only: str | None = None
    ) -> TrainingCost:
        """Measure training `model` as this experiment's clients train (its input shape, classes,
        optimiser and weight decay); uncached, for models a method builds itself."""
        return measure_training_cost(
            model, self.input_shape, self.num_classes, batch_size, self.optimizer, step=step,
            record_only=record_only, count_flops=count_flops, weight_decay=self.weight_decay,
        )

    def cost(self, width: float, batch_size: int, spec: SubmodelSpec | None = None, *, adapted: bool = True) -> TrainingCost:
        spec = spec or SubmodelSpec()
        key = (width, spec.dropped_blocks, spec.depth, spec.frozen, batch_size, adapted)
        if key not in self._cache:
            model = self.build(width)
            if adapted:
                model = self.adapt(model)
            shape_model(model, spec)
            for name, param in model.named_parameters():
                param.requires_grad_(name not in spec.frozen)
            self._cache[key] = self.measure(model, batch_size)
        return self._cache[key]

    def block_cost(self, block: int, batch_size: int, width: float = 1.0) -> TrainingCost:
        """Training body block `block` alone (FeDepth's unit): the other blocks frozen, only that
        block's saved activations counted, the head trained with it."""
        key = ("block", block, batch_size, width)
        if key not in self._cache:
            model = self.build(width)
            model.requires_grad_(False)
            model.body[block].requires_grad_(True)
            model.head.requires_grad_(True)
            self._cache[key] = self.measure(model, batch_size, record_only=f"body.{block}")
        return self._cache[key]
